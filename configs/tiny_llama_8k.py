"""Tiny Llama at sequence 8192 on 8 CPU devices: context parallelism 4 x tensor 2.

configs/tiny_llama.py's block and data with sequences of 8192 tokens, each split over 4
context ranks (8 chunks of 1024, rank r holding chunks r and 7 - r) and its heads over 2
tensor ranks (sequence parallel: the residual stream over context x tensor, 1024 tokens a
device); packed documents masked exactly (data.reset_attention_mask, reset_position_ids,
eod_mask_loss). Rope's llama3 scaling takes an original context of 1024 of the 8192
positions. Attention runs the plain path (on a CPU the flash kernel is interpreted).

One sequence a micro-step (4 a step): XLA:CPU compiles it to 0.9 GiB a device, 8.2 GB of host
memory for the 8 devices in training, where 2 a micro-step took 2.2 GiB a device and was
killed for memory on a 24 GB machine (21.6 GB resident). A step takes about 145 s on a 2-core
VM (the (8192 x 8192) scores of the plain path, a chunk pair's against every key): the 100
steps are hours there (docs/benchmarks.md, "Long context").

    python launch/train.py --config configs/tiny_llama_8k.py --workdir runs/tiny_llama_8k
"""

import pathlib

from mtnlg_jax import config as config_lib


def get_config():
    config = config_lib.load(str(pathlib.Path(__file__).with_name('tiny_llama.py')))
    config.mesh.update(dict(data=1, stage=1, context=4, tensor=2))
    config.pipeline.repeats = 1
    config.model.seq_len = 8192
    config.model.sequence_parallel = True
    config.model.rope_scaling.original_context = 1024
    config.data.update(dict(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True))
    train = config.train
    train.global_batch = 4  # 32,768 tokens a step
    train.micro_batch = 1  # 4 micro-steps: 0.9 GiB a device compiled (2.2 GiB at 2)
    train.rampup.update(dict(start=0, increment=0, tokens=0))
    train.steps = 100
    train.eval_batches = 2
    opt = config.optimizer
    opt.warmup_tokens = 100_000
    opt.decay_tokens = 100 * 4 * 8192
    return config
