"""Qwen3-235B-A22B (arXiv 2505.09388, table 2; Hugging Face Qwen/Qwen3-235B-A22B's
config.json): configs/qwen3_30b_a3b.py's block at 235 B.

94 layers, hidden 4096, 64 query heads over 4 key/value heads of 128, q/k norms, 128 SwiGLU
experts of 1536, 8 a token renormalised, vocabulary 151936: 235.09 B parameters, 22.19 B
active a token (Qwen's 235 B / 22 B). model.ffn_hidden is the published intermediate_size
12288, which no layer uses.

What differs from Qwen's run is what differs for the 30B-A3B (the report's shapes and token
count, Llama 2's recipe, per-sequence balancing loss, sequence 4096 throughout), and a
capacity factor of 1.0 in place of dropless: under expert parallelism model/moe.py's
exchange has fixed buffers, every row of a rank for each expert when dropless, so the
experts would multiply (and the all-to-alls carry) experts / top_k = 16 times the chosen
rows (configs/mixtral_8x22b.py's reason, at 4 there).

Layout, for 512 H100s (`launch/plan.py --search --cluster h100-80gb --devices 512`, folding,
capacity, selective recompute and sequence parallelism fixed, ranked it first of 1,933;
docs/benchmarks.md, "Qwen3-235B-A22B on 512 H100s"): tensor 4 x expert 2 (the all-to-all
over expert x tensor, 8 ranks, inside a node) x pipeline 16 x data -1 (4 on 512), the 94
layers as 5 on the first and last stages and 6 on each of the 14 between
(pipeline.first_stage_layers / last_stage_layers: the first also holds the embedding, the
last the 151936-row head), interleaved 3 chunks a stage (2 + 2 + 1 or 2 + 2 + 2 layers),
selective recompute, sequence parallelism and parallel folding (model.moe.fold_tensor: the
128 experts whole over expert x tensor, 16 a rank). Compiled: 50.1 GiB a GPU, 1.04 x model
FLOPs, 11.3 % exposed communication, predicted MFU 31.5 % (the folded 1F1B layout with an
in-flight bound it replaces: 47.3 GiB, 17.7 %, its bubble 3.4 of 8.0 s). XLA:GPU's CUB sort
needs the CUDA runtime, so a compile-only plan takes XLA's own (docs/gpu.md):

    XLA_FLAGS=--xla_gpu_enable_cub_radix_sort=false python launch/plan.py \
        --config configs/qwen3_235b_a22b.py --devices 512 --target h100-80gb --compile
"""

import pathlib

from mtnlg_jax import config as config_lib


def get_config():
    config = config_lib.load(str(pathlib.Path(__file__).with_name('qwen3_30b_a3b.py')))
    config.model.update(dict(num_layers=94, hidden=4096, heads=64, kv_heads=4, ffn_hidden=12288))
    config.model.moe.update(dict(ffn_hidden=1536, capacity_factor=1.0, fold_tensor=True))
    config.mesh.update(dict(data=-1, stage=16, tensor=4, expert=2))
    config.pipeline.update(
        dict(first_stage_layers=5, last_stage_layers=5, repeats=3, schedule='interleaved')
    )
    config.train.micro_batch = 1  # the 30B-A3B's is 4
    return config
