"""Llama 3 405B (arXiv 2407.21783) as Meta trained it on 8,192 H100s: table 3's shapes,
section 3.4.1's recipe, table 4's layout.

126 layers, hidden 16384, SwiGLU 53248, 128 query heads over 8 key/value heads (head dim
128), configs/llama3_8b.py's block (rope theta 500000 with Llama 3.1's scaling, RMSNorm, no
biases, untied embeddings, vocabulary 128256): 405.85 B parameters with both embedding
tables. AdamW, peak LR 8e-5, linear warm-up over 8,000 steps, cosine to 8e-7 over 1.2 M
steps; 16 M tokens a step (2048 x 8192). Layout: tensor 8 x pipeline 16 x data -1 (64 on
8,192 GPUs), sequence parallel, selective recompute less the attention's input projection
(model.remat_recompute = 'qkv': made again in the backward), bf16, the interleaved 1F1B
schedule (Meta interleaved too) with 4 chunks a stage and at most 18 micro-batches' chunk
inputs on a stage (pipeline.max_in_flight x 4 = 72; Megatron's 1F1B holds p = 16). As Meta, the
first and the last stage hold one layer fewer, 7, 8 x 14, 7 (pipeline.first_stage_layers /
last_stage_layers; docs/training.md, "Pipeline stages of unequal depth"); their 7 layers run
as chunks of 1, 2, 2, 2 (stage 0, whose first chunk holds the embedding) and 2, 2, 2, 1
(stage 15, the head's last). Each block runs on two pieces of the sequence
(model.sequence_pieces), so that one piece's tensor collectives overlap the other's matmuls.
ZeRO-1's reduce-scatter runs inside the loop, a layer in each backward slot after its chunk's
last (pipeline.overlap_grad_reduce); the embedding's and the head's tables, each one stage's,
cross the replicas in one reduce-scatter after it (parallel/zero.py). The compute copy's
all-gather of chunks 1 to 3 runs a layer at a time inside chunk 0's first forwards
(pipeline.overlap_param_gather, parallel/gathering_tick.py; its step asks XLA for 8 collectives
in flight). XLA:GPU's scheduler orders the step by its own estimate (train.pgle_profile_steps
0). launch/plan.py --target compiles it so: 72.5 GiB a GPU, 4.0 % of its compute waiting on
communication; predicted 11.46 s a step, MFU 47.7 %: 471 model TFLOP/s a GPU (6N + 12LHQT)
against Meta's 430; replayed 8.02 s, 9.88 s with each lockstep tick at its slowest stage.
Ordered by profiled costs instead (train.pgle_profile_steps 3, the replay's costs standing in
for the profile) it waits more: 5.2 %, lockstep 9.99 s (docs/benchmarks.md, "The residual
stream added piece by piece"). The bound and the recompute are the pair that fits fastest
(measured with the reduce-scatter after the loop): 16 micro-batches keeping every projection
compile to 70.8 GiB and 10.71 s, 19 with 'qkv' to 73.8 GiB and 9.94 s (0.7 GiB from the 74.5
GiB of 80 GB), unbounded with 'qkv,attn_out' to 70.5 GiB and 10.22 s (docs/benchmarks.md, "More
micro-batches in flight for the attention's projections"; "Llama blocks" has the other layouts:
full recompute is slower).

What differs from Meta's run:
- The in-flight bound: unbounded, selective recompute holds 119.1 GiB a GPU on one chunk a
  stage (80.7 GiB on four); bounded it costs idle ticks (predicted bubble 1.60 s of 11.7).
- Meta ramped the sequence as well as the batch: 4 M tokens at sequence 4096, 8 M at 8192
  after 252 M tokens, 16 M after 2.87 T. Here the sequence is 8192 throughout: 8 M tokens
  (1024 sequences) until 2.87 T tokens (train.rampup), then 16 M. The warm-up and decay,
  counted in tokens here, are Meta's steps at Meta's batch sizes.
- Meta's context parallelism (long-context stage) and its data mix and annealing are not
  here; documents are packed without masks unless data.reset_attention_mask is set.

    python launch/plan.py --config configs/llama3_405b.py --devices 8192 --target h100-80gb
"""

import pathlib

from mtnlg_jax import config as config_lib

SEQ = 8192
META_BATCHES = (4 * 2**20, 8 * 2**20, 16 * 2**20)  # tokens a step, in Meta's three phases
META_SWITCHES = (252e6, 2.87e12)  # tokens seen when the batch doubled
WARMUP_STEPS, DECAY_STEPS = 8_000, 1_200_000


def tokens_after(steps):
    """Tokens Meta's run had seen after `steps` steps of its batch schedule."""
    seen = 0.0
    for batch, switch in zip(META_BATCHES, META_SWITCHES + (float('inf'),)):
        phase = min(steps, max(0.0, (switch - seen) / batch))
        seen, steps = seen + phase * batch, steps - phase
    return seen


def get_config():
    config = config_lib.load(str(pathlib.Path(__file__).with_name('llama3_8b.py')))
    config.model.update(dict(num_layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248))
    config.model.remat = 'selective'  # fits with the in-flight bound below (docstring)
    config.model.remat_recompute = 'qkv'  # 0.07 GiB a chunk input: 18 in flight fit
    # two pieces a sequence: a piece's tensor collectives overlap the other's matmuls (docs/gpu.md)
    config.model.sequence_pieces = 2
    config.mesh.update(dict(data=-1, stage=16, tensor=8))
    config.pipeline.update(
        dict(first_stage_layers=7, last_stage_layers=7, repeats=4, max_in_flight=18)
    )
    # ZeRO-1's reduce-scatter in the loop: better than after the loop in every figure
    config.pipeline.overlap_grad_reduce = True
    # and the compute copy's all-gather inside chunk 0's first forwards (parallel/gathering_tick.py)
    config.pipeline.overlap_param_gather = True
    # XLA's own estimate orders it best (the replay's costs as a profile: 5.2 % exposed
    # against 4.0, the docstring); 3 profiles each batch size of the ramp-up (train/pgle.py)
    config.train.pgle_profile_steps = 0
    config.train.update(dict(global_batch=2048, micro_batch=1, steps=DECAY_STEPS))
    config.train.rampup.update(dict(start=1024, increment=1024, tokens=int(META_SWITCHES[1])))
    config.optimizer.update(
        dict(
            lr=8e-5,
            min_lr=8e-7,
            warmup_tokens=int(tokens_after(WARMUP_STEPS)),
            decay_tokens=int(tokens_after(DECAY_STEPS)),
        )
    )
    return config
