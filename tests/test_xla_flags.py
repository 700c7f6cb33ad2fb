"""The recommended XLA:GPU flags: applied before JAX starts, the user's own XLA_FLAGS win, and
the banner says which are in effect. A config's own options (train.xla_options): checked by
XLA before the step, then in the step's compile."""

import os
import pathlib

import jax
import pytest

from mtnlg_jax import config as config_lib
from mtnlg_jax.plan import compile as compile_lib
from mtnlg_jax.xla import flags as xla_flags
from mtnlg_jax.xla import gpu_compile
from mtnlg_jax.xla import options as xla_options

ROOT = pathlib.Path(__file__).resolve().parents[1]

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


def test_a_configs_xla_options_are_checked_by_xla_before_the_step():
    combine = 'xla_gpu_reduce_scatter_combine_threshold_bytes'
    assert xla_options.refused({}) is None
    assert xla_options.refused({combine: '1', LHS: False}) is None
    assert "No such compile option: 'xla_nope'" in xla_options.refused({'xla_nope': '1'})
    assert "'abc' is not a valid int64" in xla_options.refused({combine: 'abc'})


def test_a_configs_xla_options_reach_the_train_steps_compile():
    """An option XLA does not know, past the check, fails the step's own compile: so the
    config's options are among the step's."""
    config = config_lib.load(str(ROOT / 'configs' / 'tiny.py'))
    config.train.xla_options = 'xla_not_an_option=1'
    config = config_lib.resolve(config, 8)
    with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option: 'xla_not_an"):
        compile_lib.compile_train_step(config)
