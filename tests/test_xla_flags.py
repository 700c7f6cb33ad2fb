"""The recommended XLA:GPU flags: applied before JAX starts, the user's own XLA_FLAGS win, and
the banner says which are in effect."""

import os
import pathlib

from mtnlg_jax.xla import flags as xla_flags
from mtnlg_jax.xla import gpu_compile

LHS = 'xla_gpu_enable_latency_hiding_scheduler'


def test_recommended_flags_are_added_to_the_users_own():
    environ = {'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
    applied = xla_flags.apply(environ)
    assert [flag for flag, _ in applied] == [f for f, _, _ in xla_flags.RECOMMENDED_GPU_FLAGS]
    assert environ['XLA_FLAGS'].endswith('--xla_force_host_platform_device_count=8')
    assert f'--{LHS}=true' in environ['XLA_FLAGS']
    assert all(source == 'ours' for _, _, source in xla_flags.in_effect(environ))


def test_a_flag_the_user_sets_wins_whatever_its_value():
    environ = {'XLA_FLAGS': f'--{LHS}=false'}
    applied = xla_flags.apply(environ)
    assert LHS not in [flag for flag, _ in applied]
    assert environ['XLA_FLAGS'].count(LHS) == 1
    effect = {flag: (value, source) for flag, value, source in xla_flags.in_effect(environ)}
    assert effect[LHS] == ('false', 'XLA_FLAGS')
    assert f'--{LHS}=false (your XLA_FLAGS)' in xla_flags.describe(environ)


def test_applying_twice_changes_nothing():
    environ = {}
    xla_flags.apply(environ)
    once = environ['XLA_FLAGS']
    xla_flags.apply(environ)
    assert environ['XLA_FLAGS'] == once
    assert xla_flags.describe({}) == 'none of ours'


def test_the_gpu_compiler_is_looked_for_where_make_installs_it():
    # make gpu-compile installs into the repository's .gpu-compile/; the module must find it
    # from its own place in the package, or the GPU-target tests would skip without a word.
    root = pathlib.Path(__file__).resolve().parents[1]
    if 'MTNLG_GPU_COMPILE_DIR' not in os.environ:
        assert gpu_compile.COMPILER_DIR == root / '.gpu-compile'
    if (gpu_compile.COMPILER_DIR / '.installed').exists():
        assert gpu_compile.missing() is None, gpu_compile.missing()


def test_flags_this_xla_does_not_know_are_named_not_fatal(monkeypatch):
    # XLA aborts a process whose XLA_FLAGS names a flag it does not know; under a jaxlib the
    # flags were not compared on, apply() asks a child process and leaves those out.
    assert xla_flags.unknown_to_xla(f'--{LHS}=true --xla_no_such_flag=1') == {'xla_no_such_flag'}
    assert xla_flags.unknown_to_xla(f'--{LHS}=true') == set()
    rows = (*xla_flags.RECOMMENDED_GPU_FLAGS, ('xla_no_such_flag', '1', 'gone'))
    monkeypatch.setattr(xla_flags, 'RECOMMENDED_GPU_FLAGS', rows)
    environ = {}
    applied = xla_flags.apply(environ, jaxlib='99.0')
    assert 'xla_no_such_flag' not in [flag for flag, _ in applied]
    assert f'--{LHS}=true' in environ['XLA_FLAGS']
    assert xla_flags.left_out(environ) == [*xla_flags.ONLY_ON_VERIFIED, 'xla_no_such_flag']
    xla_flags.apply(environ := {}, jaxlib=xla_flags.VERIFIED_JAXLIB)  # no child: all applied
    assert 'xla_no_such_flag' in environ['XLA_FLAGS']
