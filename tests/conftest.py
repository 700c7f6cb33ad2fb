"""Every test runs on a CPU with 8 simulated devices, set before JAX is imported."""

import os

os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')


import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope='module')
def token_data(tmp_path_factory):
    """A small learnable dataset for command-line runs: a repeating pattern of ids below 300."""
    from mtnlg_jax.data.loader import write_token_file

    path = tmp_path_factory.mktemp('data')
    pattern = np.random.default_rng(0).integers(0, 300, 97)
    write_token_file(str(path / 'train.npy'), np.tile(pattern, 200).astype(np.uint16))
    write_token_file(str(path / 'valid.npy'), np.tile(pattern, 20).astype(np.uint16))
    return path
