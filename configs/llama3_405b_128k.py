"""Llama 3 405B at sequence 131072 (arXiv 2407.21783): table 4's long-context layout on 16,384
H100s, tensor 8 x context 16 x pipeline 16 x data 8, 16 M tokens a step (128 sequences).

configs/llama3_405b.py (the model, the pipeline of 7, 8 x 14, 7 layers interleaved x 4 with
its 16 micro-batches all in flight, selective recompute, sequence parallel, two sequence
pieces, the optimizer) with what the long-context stage changes: sequences of 131072 tokens,
each cut into 32 chunks over 16 context ranks (rank r holding chunks r and 31 - r,
parallel/context.py), keys and values gathered over `context` in every layer, as Meta's
all-gather context parallelism; each device holds 131072 / 16 = 8192 tokens of a sequence,
the 8K run's. Attention is the Pallas flash kernel, once per query chunk at its offset among
the gathered keys (cuDNN's kernel takes no offset); documents are masked inside packed
sequences (data.reset_attention_mask), Meta's reason for gathering keys and values.
ZeRO-1's reduce-scatter over data x context runs inside the loop, a layer in each backward
slot after its chunk's last (pipeline.overlap_grad_reduce), as the 8K run. XLA:GPU's
scheduler orders the step by profiled costs (train.pgle_profile_steps: the run profiles three
steps and compiles again; its own estimate starts the context reduce-scatter too late here,
unlike the 8K run's). launch/plan.py --target compiles it so, the replay's costs standing in
for the profile: 71.2 GiB a GPU (fits 80 GB) at 0.87 x the model's FLOPs (the flash kernels
by the score blocks they compute), **8.9 %** of its compute waiting on communication (11.9 %
by XLA's own estimate); predicted 10.6 s a step, 550 model TFLOP/s a GPU against Meta's 380
(docs/benchmarks.md, "Long context", says what that assumes of the flash kernel's speed).

What differs from Meta's run:
- Meta's long-context stage grew the sequence from 8K to 128K in six steps over about 800 B
  tokens and published no schedule for it; here the sequence is 131072 from the start and
  the optimizer is the pre-training's (configs/llama3_405b.py) without its batch ramp-up.
- The data mix and annealing are not here; positions run over the whole packed sequence
  (rope's Llama 3.1 scaling, original context 8192).

    python launch/plan.py --config configs/llama3_405b_128k.py --devices 16384 \\
        --target h100-80gb --compile
"""

import pathlib

from mtnlg_jax import config as config_lib

SEQ = 131072
SEQUENCES = 128  # 16 M tokens a step, as at 8192 (table 4)


def get_config():
    config = config_lib.load(str(pathlib.Path(__file__).with_name('llama3_405b.py')))
    config.model.seq_len = SEQ
    # 16 micro-batches a replica: all in flight under any bound, so every projection is kept
    config.model.remat_recompute = ''
    config.model.remat_offload = ''  # fits without (the 8K run's gate in host memory)
    config.pipeline.overlap_grad_reduce = True  # the step's tail: docs/benchmarks.md
    # XLA's scheduler by measured costs (train/pgle.py): its own estimate starts the context
    # reduce-scatter too late here; launch/plan.py --target compiles with the replay's costs
    config.train.pgle_profile_steps = 3
    # the 8K run's in-loop all-gather of the compute copy: not measured at 128K, so off
    config.pipeline.overlap_param_gather = False
    config.mesh.context = 16
    config.data.reset_attention_mask = True
    config.train.global_batch = SEQUENCES
    config.train.rampup.update(dict(start=0, increment=0, tokens=0))
    return config
