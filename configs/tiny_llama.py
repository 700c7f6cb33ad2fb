"""Tiny Llama for CPU development: configs/tiny.py's run (data, mesh, pipeline, batch, steps)
with Llama 3's block instead of GPT-3's.

Rotary positions (theta 500000, Llama 3.1's 'llama3' scaling with an original context of 64
of the 128 positions, so every band of the scaling is used), RMSNorm, SwiGLU (ffn_hidden 0:
8/3 x 256 = 682 rounded up to a multiple of 64: 704), 8 query heads over 2 key/value heads
(one a tensor rank), untied output layer, no biases. Mesh data 2 x stage 2 x tensor 2, an
interleaved 1F1B pipeline of 2 repeats, as tiny.

    make train CONFIG=configs/tiny_llama.py      # workdir runs/tiny_llama
"""

import pathlib

from mtnlg_jax import config as config_lib


def get_config():
    config = config_lib.load(str(pathlib.Path(__file__).with_name('tiny.py')))
    config.model.update(
        dict(
            position='rope',
            rope_theta=500000.0,
            norm='rmsnorm',
            mlp='swiglu',
            ffn_multiple=64,
            kv_heads=2,
            tie_embeddings=False,
            bias=False,
        )
    )
    config.model.rope_scaling.update(
        dict(
            type='llama3',
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_context=64,
        )
    )
    return config
