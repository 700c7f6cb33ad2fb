"""Qwen3-235B-A22B (arXiv 2505.09388, table 2; Hugging Face Qwen/Qwen3-235B-A22B's
config.json): configs/qwen3_30b_a3b.py's block at 235 B.

94 layers, hidden 4096, 64 query heads over 4 key/value heads of 128, q/k norms, 128 SwiGLU
experts of 1536, 8 a token renormalised, vocabulary 151936: 235.09 B parameters, 22.19 B
active a token (Qwen's 235 B / 22 B). model.ffn_hidden is the published intermediate_size
12288, which no layer uses.

What differs from Qwen's run is what differs for the 30B-A3B (the report's shapes and token
count, Llama 2's recipe, per-sequence balancing loss, sequence 4096 throughout). Layout:
tensor 4 x pipeline 16 x data -1, the 94 layers as 5 on the first and last stages and 6 on
each of the 14 between (pipeline.first_stage_layers / last_stage_layers: the first also
holds the embedding, the last the 151936-row head); mesh.expert stays 1 here until the
planner counts MoE layouts (expert parallelism runs; a model of this size needs it to fit).

    python launch/plan.py --config configs/qwen3_235b_a22b.py --devices 512 --target h100-80gb
"""

import pathlib

from mtnlg_jax import config as config_lib


def get_config():
    config = config_lib.load(str(pathlib.Path(__file__).with_name('qwen3_30b_a3b.py')))
    config.model.update(dict(num_layers=94, hidden=4096, heads=64, kv_heads=4, ffn_hidden=12288))
    config.model.moe.ffn_hidden = 1536
    config.mesh.update(dict(data=-1, stage=16, tensor=4))
    config.pipeline.update(dict(first_stage_layers=5, last_stage_layers=5))
    return config
