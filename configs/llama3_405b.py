"""Llama 3 405B (arXiv 2407.21783) as Meta trained it on 8,192 H100s: table 3's shapes,
section 3.4.1's recipe, table 4's layout.

126 layers, hidden 16384, SwiGLU 53248, 128 query heads over 8 key/value heads (head dim
128), configs/llama3_8b.py's block (rope theta 500000 with Llama 3.1's scaling, RMSNorm, no
biases, untied embeddings, vocabulary 128256): 405.85 B parameters with both embedding
tables. AdamW, peak LR 8e-5, linear warm-up over 8,000 steps, cosine to 8e-7 over 1.2 M
steps; 16 M tokens a step (2048 x 8192). Layout: tensor 8 x pipeline 16 x data -1 (64 on
8,192 GPUs), sequence parallel, selective recompute keeping every projection, bf16, the
interleaved 1F1B schedule (Meta interleaved too) with 4 chunks a stage and every micro-batch in
flight (pipeline.max_in_flight 0): SwiGLU's gate waits in the host's memory between a
micro-batch's forward and its backward (model.remat_offload = 'mlp_gate': the 1F1B engine
copies a tick's slots there and back beside the tick's work, parallel/offload.py; its up stays
on the GPU). As Meta, the first and the last stage hold one layer fewer, 7, 8 x 14, 7
(pipeline.first_stage_layers / last_stage_layers; docs/training.md, "Pipeline stages of
unequal depth"); their 7 layers run as chunks of 1, 2, 2, 2 (stage 0, whose first chunk
holds the embedding) and 2, 2, 2, 1 (stage 15, the head's last). Each block runs on two
pieces of the sequence (model.sequence_pieces), so that one piece's tensor collectives
overlap the other's matmuls.
ZeRO-1's reduce-scatter runs inside the loop, a layer in each backward slot after its chunk's
last (pipeline.overlap_grad_reduce); the embedding's and the head's tables, each one stage's,
cross the replicas in one reduce-scatter after it (parallel/zero.py). The compute copy's
all-gather of chunks 1 to 3 runs a layer at a time inside chunk 0's first forwards
(pipeline.overlap_param_gather, parallel/gathering_tick.py; its step asks XLA for 8 collectives
in flight). XLA:GPU's scheduler orders the step by its own estimate (train.pgle_profile_steps
0; its analytical estimate is off with the host copies: parallel/offload.py; by the replay's
costs as a profile it waits more: 5.4 %, lockstep 9.77 s). launch/plan.py --target compiles
it so: 65.9 GiB a GPU (and 16.3 GiB in the host's
memory), 3.9 % of its compute waiting on communication, 45 GB a step to the host and 41 GB
back, 0.002 s of it waited for; predicted 10.69 s a step, MFU 51.1 %: 506 model TFLOP/s a GPU
(6N + 12LHQT) against Meta's 430; replayed 7.81 s, 9.63 s with each lockstep tick at its
slowest stage. The layouts beside it (docs/benchmarks.md, "SwiGLU's gate alone in host
memory"): 18 micro-batches in flight with the queries made again, 72.5 GiB, lockstep 9.88 s,
471 predicted; the gate and the up in host memory, 50.0 GiB, lockstep 10.28 s (twice the
copies, which the pipeline's end ticks wait for); nothing in host memory fits only bounded
(16 in flight keeping every projection: 70.8 GiB, 10.71 s; "More micro-batches in flight for
the attention's projections"; "Llama blocks" has the other layouts: full recompute is slower).

What differs from Meta's run:
- Host memory: Meta names no activations kept in the host's. Every micro-batch in flight
  with selective recompute would hold 80.7 GiB a GPU on four chunks a stage (119.1 on one);
  the gate's 16.3 GiB wait in the host's instead, and a bound on the micro-batches in flight
  would cost idle ticks (predicted bubble 1.60 s at 16).
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
    config.model.remat = 'selective'  # every projection kept, nothing made again
    config.model.remat_recompute = ''
    # SwiGLU's gate in host memory (parallel/offload.py): every micro-batch in flight fits
    config.model.remat_offload = 'mlp_gate'
    # two pieces a sequence: a piece's tensor collectives overlap the other's matmuls (docs/gpu.md)
    config.model.sequence_pieces = 2
    config.mesh.update(dict(data=-1, stage=16, tensor=8))
    config.pipeline.update(
        dict(first_stage_layers=7, last_stage_layers=7, repeats=4, max_in_flight=0)
    )
    # ZeRO-1's reduce-scatter in the loop: better than after the loop in every figure
    config.pipeline.overlap_grad_reduce = True
    # and the compute copy's all-gather inside chunk 0's first forwards (parallel/gathering_tick.py)
    config.pipeline.overlap_param_gather = True
    # XLA's own estimate orders it best (the replay's costs as a profile: 5.4 % exposed
    # against 3.9, the docstring); 3 profiles each batch size of the ramp-up (train/pgle.py)
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
