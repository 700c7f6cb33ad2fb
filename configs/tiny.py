"""Tiny GPT for CPU development: a few million parameters, fp32 compute, 8 simulated devices.

The default of `make train`. Mesh data 2 x stage 2 x tensor 2 with an interleaved 1F1B
pipeline of 2 repeats: each stage holds 2 of the 4 layers, chunks of one layer. Data: the default corpus's
two sources (launch/export_corpus.py, then launch/preprocess.py), blended 0.8 King James
Bible and 0.2 Python (the closing evaluation and sample are the Bible's); the
batch ramps up from 8 to 16 sequences over the first 40,960 tokens, as MT-NLG's did from 32
(8 sequences are 2 micro-batches).

    python launch/train.py --config configs/tiny.py --workdir runs/tiny   # makes 8 CPU devices
"""

from mtnlg_jax import config as config_lib


def get_config():
    config = config_lib.defaults()

    config.mesh.data = 2
    config.mesh.stage = 2
    config.mesh.tensor = 2
    config.pipeline.repeats = 2  # with the default schedule 1f1b: interleaved 1F1B

    model = config.model
    model.num_layers = 4
    model.hidden = 256
    model.heads = 8
    model.seq_len = 128
    model.vocab_size = 8192  # the default corpus's sentencepiece model
    model.init_std = 0.02
    model.compute_dtype = 'float32'  # bf16 matmuls are slow on CPU
    model.attention_dropout = 0.0
    model.hidden_dropout = 0.0
    model.remat = 'full'

    train = config.train
    # 2-core CPU: about 1 s a step, so `make train` stays well inside 10 minutes.
    train.global_batch = 16
    train.micro_batch = 2  # 16 / (2 x data 2) = 4 micro-batches through the pipeline
    train.steps = 200
    train.log_every = 10
    train.eval_every = 50
    train.eval_batches = 8
    # 8 sequences (2 micro-batches) for the first 320 samples, then 16 (4 micro-batches).
    train.rampup.update(dict(start=8, increment=8, tokens=40_960))

    opt = config.optimizer
    # 4e-3: measured on make train's run, KJV validation loss 5.21 after 200 steps against
    # 5.29 with 1e-3 (README, "The default run").
    opt.lr = 4e-3
    opt.min_lr = 4e-4
    opt.weight_decay = 0.1
    # 200 steps = (40 x 8 + 160 x 16) sequences x 128 = 368,640 tokens: warm up over about 5 %,
    # decay over the whole run (what decay_tokens=0 would count; fixed so shorter runs keep it).
    opt.warmup_tokens = 20_000
    opt.decay_tokens = 368_640

    config.data.sources = ((0.8, 'data/default/kjv'), (0.2, 'data/default/python_stdlib'))
    config.data.split = '969,30,1'
    config.data.tokenizer = 'data/default/tokenizer.model'
    return config
