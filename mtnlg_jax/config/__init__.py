"""The config: every key, its checks, and what a run derives from it (imports nothing else).

    resolve.py   defaults(), resolve() (derived values kept apart from inputs), load()
    checks.py    a check per section, ConfigError naming the key, parse_split
    rampup.py    the batch-size ramp-up schedule

`from mtnlg_jax import config as config_lib` gives the names every other layer uses.
"""

from mtnlg_jax.config.checks import DATA_ORDERS, ConfigError, padded_vocab_size
from mtnlg_jax.config.resolve import defaults, inputs_of, load, resolve, resolve_model

__all__ = [
    'DATA_ORDERS',
    'ConfigError',
    'defaults',
    'inputs_of',
    'load',
    'padded_vocab_size',
    'resolve',
    'resolve_model',
]
