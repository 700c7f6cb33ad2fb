"""The config: every key, its checks, and what a run derives from it (imports nothing else).

    keys.py      the key table: default, values, meaning and resume rule of every key
    resolve.py   defaults(), resolve() (derived values kept apart from inputs), load()
    checks.py    the checks across keys, a section at a time; parse_split
    rampup.py    the batch-size ramp-up schedule
    stage_layers.py  layers per pipeline stage (even, or first / last stages of their own)

`from mtnlg_jax import config as config_lib` gives the names every other layer uses.
"""

from mtnlg_jax.config.checks import (
    block_stack_layers,
    default_ffn_hidden,
    mlp_inputs,
    moe_ffn_hidden,
    padded_vocab_size,
    offloaded,
    recomputed,
    replicas,
    shared_ffn_hidden,
    xla_options,
)
from mtnlg_jax.config.keys import ConfigError
from mtnlg_jax.config.resolve import defaults, inputs_of, load, resolve, resolve_model

__all__ = [
    'block_stack_layers',
    'ConfigError',
    'default_ffn_hidden',
    'defaults',
    'mlp_inputs',
    'inputs_of',
    'load',
    'moe_ffn_hidden',
    'padded_vocab_size',
    'offloaded',
    'recomputed',
    'replicas',
    'resolve',
    'resolve_model',
    'shared_ffn_hidden',
    'xla_options',
]
