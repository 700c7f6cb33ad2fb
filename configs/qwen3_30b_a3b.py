"""Qwen3-30B-A3B (arXiv 2505.09388, table 2; Hugging Face Qwen/Qwen3-30B-A3B's config.json):
the Llama block with per-head q/k norms and 128 fine-grained SwiGLU experts, 8 a token.

48 layers, hidden 2048, 32 query heads over 4 key/value heads of 128 (4096 wide: heads x
head_dim is not hidden), RMSNorm of each query and key head before rope (model.qk_norm),
experts 768 wide (moe_intermediate_size), a softmax router renormalised over the 8 chosen
(norm_topk_prob), no shared expert, every layer an MoE, RMSNorm eps 1e-6, rope theta 1e6, no
biases, untied embeddings, vocabulary 151936: 30.53 B parameters, 3.35 B active a token
(Qwen's 30.5 B / 3.3 B). model.ffn_hidden is the published intermediate_size 6144, which no
layer uses (Qwen3-MoE's dense layers, absent here).

What differs from Qwen's run: the report gives the shapes, 36 T tokens in three stages (4096
tokens a sequence, then 32768) and a global-batch load-balancing loss; not the recipe. Here:
configs/llama3_8b.py's recipe (Llama 2's: AdamW, 2,000 warm-up steps of 4 M tokens, cosine
to 10 %) at peak LR 3e-4 over 36 T tokens, sequence 4096 throughout, Switch's loss at 0.001
(Hugging Face's router_aux_loss_coef for Qwen3-MoE) per sequence rather than over the global
batch, and a capacity factor of 1.0 in place of dropless (configs/qwen3_235b_a22b.py's
reason: under expert parallelism the exchange's fixed buffers would take experts / top_k = 16
times the chosen rows dropless).

Layout, for 128 H100s (16 nodes: half the 8x7B's 256 for 0.62 x its model FLOPs, 6 x 3.35 B
x 36 T; 36 T tokens at the predicted 2.59 s a step of 4 M tokens is 257 days, 64 GPUs would
double it): `launch/plan.py --search --cluster h100-80gb --devices 128`, the config's 4
stages, folding, capacity, selective recompute and sequence parallelism fixed, ranked it first
of 4,308 (docs/benchmarks.md, "Mixtral 8x7B and Qwen3-30B-A3B: the search's layouts
compiled"): tensor 2 x expert 4 (the all-to-all over expert x tensor, 8 ranks, inside a
node) x pipeline 4 (12 layers a stage, interleaved 12 chunks of one) x data -1 (4 on 128),
micro-batch 4 (16 micro-steps), parallel folding (model.moe.fold_tensor: the 128 experts
whole over expert x tensor, 16 a rank). The layout it replaces (tensor 4 x pipeline 4, expert
1, the experts split over tensor by their width) was planned at 41.2 GiB "fits" on 64, but it takes
model/moe.py's batched path, whose gathered weight copies the plan does not count (the
8x22B's such layout: 108.1 GiB compiled against 73.9 planned); never compiled. Compiled:
60.9 GiB a GPU (planned 62.5), 0.99 x model FLOPs, exposed communication 38.1 % of compute
(the all-to-all 0.39 s, 2 % hidden; the stage hand-offs over the network 0.27 s), replayed
3.07 s, lockstep 3.36 s, predicted 2.59 s, MFU 38.2 %. XLA:GPU's CUB sort needs the CUDA
runtime, so a compile-only plan takes XLA's own (docs/gpu.md):

    XLA_FLAGS=--xla_gpu_enable_cub_radix_sort=false python launch/plan.py \
        --config configs/qwen3_30b_a3b.py --devices 128 --target h100-80gb
"""

import pathlib

from mtnlg_jax import config as config_lib

SEQ = 4096
TOKENS = 36e12  # Qwen3's pre-training corpus
QWEN3_BLOCK = dict(
    rope_theta=1e6,
    vocab_size=151936,
    layer_norm_epsilon=1e-6,
    head_dim=128,
    qk_norm=True,
    seq_len=SEQ,
)
QWEN3_MOE = dict(
    experts=128,
    top_k=8,
    router='softmax',
    norm_top_k=True,
    aux_loss_coeff=0.001,
    capacity_factor=0.0,
)


def qwen3_moe(shape, mesh):
    """configs/llama3_8b.py's block and recipe as Qwen3-MoE: `shape` (num_layers, hidden,
    heads, kv_heads, dense width, expert width), `mesh` ({axis: size})."""
    config = config_lib.load(str(pathlib.Path(__file__).with_name('llama3_8b.py')))
    # Llama 3 8B's 4 M-token batch, in sequences of SEQ
    batch = config.train.global_batch * config.model.seq_len // SEQ
    layers, hidden, heads, kv_heads, ffn, width = shape
    config.model.update(dict(QWEN3_BLOCK, num_layers=layers, hidden=hidden, heads=heads,
                             kv_heads=kv_heads, ffn_hidden=ffn))  # fmt: skip
    config.model.rope_scaling.type = 'none'
    config.model.moe.update(dict(QWEN3_MOE, ffn_hidden=width))
    config.train.update(dict(global_batch=batch, steps=int(TOKENS // (batch * SEQ))))
    config.mesh.update(mesh)
    config.data.tokenizer = 'data/qwen3/tokenizer.json'  # Qwen's, as Hugging Face ships it
    return config


def get_config():
    config = qwen3_moe(
        (48, 2048, 32, 4, 6144, 768), mesh=dict(data=-1, stage=4, tensor=2, expert=4)
    )
    config.model.moe.update(dict(capacity_factor=1.0, fold_tensor=True))
    config.pipeline.update(dict(repeats=12, schedule='interleaved'))
    config.train.micro_batch = 4
    return config
