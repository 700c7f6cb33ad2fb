"""Mixtral 8x22B (Mistral's announcement, April 2024; Hugging Face
mistralai/Mixtral-8x22B-v0.1's config.json): configs/mixtral_8x7b.py's block at 8x22B.

56 layers, hidden 6144, 48 query heads over 8 key/value heads (head dim 128), 8 SwiGLU experts
of 16384, top 2 renormalised, rope theta 1e6, vocabulary 32000 (v0.1's; the Instruct model's
is 32768): 140.62 B parameters, 39.15 B active a token (Mistral's 141 B / 39 B).

What differs from Mistral's run is what differs for the 8x7B: no published recipe, data or
layout (Llama 2's recipe, sequence 8192 where the published context is 65536), and a
capacity factor of 1.0 in place of dropless: under expert parallelism model/moe.py's
exchange has fixed buffers, every row of a rank for each expert when dropless, so the experts
would multiply (and the all-to-alls carry) experts / top_k = 4 times the chosen rows.

Layout, for 256 H100s (`launch/plan.py --search --cluster h100-80gb --devices 256`, capacity,
selective recompute and sequence parallelism fixed, ranked it third of 1,288, 0.7 % behind
the first and 13 GiB further from 80 GB; the second, one expert rank, does not fit as
compiled; docs/benchmarks.md, "Mixtral 8x22B on 256 H100s"):
tensor 4 x expert 2 (the experts' all-to-all inside a node) x pipeline 8 (7 layers a stage,
interleaved 7 chunks of 1) x data -1 (4 on 256), selective recompute, sequence parallelism,
and parallel folding (model.moe.fold_tensor: in the MoE layers the 4 tensor ranks are more
expert ranks, the 8 experts whole over expert x tensor): compiled both ways, folding cut the
exposed communication from 21.9 % to 13.6 % of compute and the replayed step from 9.49 s to
7.15 s (docs/benchmarks.md, "Mixtral 8x22B on 256 H100s").

    python launch/plan.py --config configs/mixtral_8x22b.py --devices 256 --target h100-80gb \
        --compile
"""

import pathlib

from mtnlg_jax import config as config_lib


def get_config():
    config = config_lib.load(str(pathlib.Path(__file__).with_name('mixtral_8x7b.py')))
    config.model.update(dict(num_layers=56, hidden=6144, heads=48, kv_heads=8, ffn_hidden=16384))
    config.model.moe.ffn_hidden = 16384
    config.model.moe.capacity_factor = 1.0
    config.model.moe.fold_tensor = True
    config.mesh.update(dict(data=-1, stage=8, tensor=4, expert=2))
    config.pipeline.update(dict(repeats=7, schedule='interleaved'))
    return config
