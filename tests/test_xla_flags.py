"""The recommended XLA:GPU flags: applied before JAX starts, the user's own XLA_FLAGS win, and
the banner says which are in effect."""

from mtnlg_jax import xla_flags

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
