"""Mixtral 8x22B (Mistral's announcement, April 2024; Hugging Face
mistralai/Mixtral-8x22B-v0.1's config.json): configs/mixtral_8x7b.py's block at 8x22B.

56 layers, hidden 6144, 48 query heads over 8 key/value heads (head dim 128), 8 SwiGLU experts
of 16384, top 2 renormalised, rope theta 1e6, vocabulary 32000 (v0.1's; the Instruct model's
is 32768): 140.62 B parameters, 39.15 B active a token (Mistral's 141 B / 39 B).

What differs from Mistral's run is what differs for the 8x7B (no published recipe, data or
layout: Llama 2's recipe, sequence 8192 where the published context is 65536). Layout:
tensor 8 x pipeline 8 (7 layers a stage) x data -1; mesh.expert stays 1 here until the
planner counts MoE layouts (the target: 256 H100s with expert parallelism).

    python launch/plan.py --config configs/mixtral_8x22b.py --devices 256 --target h100-80gb
"""

import pathlib

from mtnlg_jax import config as config_lib


def get_config():
    config = config_lib.load(str(pathlib.Path(__file__).with_name('mixtral_8x7b.py')))
    config.model.update(dict(num_layers=56, hidden=6144, heads=48, kv_heads=8, ffn_hidden=16384))
    config.model.moe.ffn_hidden = 16384
    config.mesh.update(dict(data=-1, stage=8, tensor=8))
    return config
