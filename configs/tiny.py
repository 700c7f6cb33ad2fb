"""Tiny GPT for CPU development: a few million parameters, fp32 compute, 8 simulated devices.

The default of `make train`. Mesh data 2 x stage 2 x tensor 2 with an interleaved 1F1B
pipeline of 2 repeats: each stage holds 2 of the 4 layers, chunks of one layer. Data: the
default corpus's two sources (launch/export_corpus.py, then launch/preprocess.py), blended
0.9 King James Bible and 0.1 Python (the closing evaluation and sample are the Bible's); the
batch ramps up from 8 to 16 sequences over the first 40,960 tokens, as MT-NLG's did from 32
(8 sequences are 1 micro-batch per replica, 16 are 2).

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
    # Full recompute, though everything fits: on 2 CPU cores writing and reading the fp32
    # attention scores the 1F1B engine would keep costs more than recomputing the layers
    # (docs/benchmarks.md, "The tiny config's choices").
    model.remat = 'full'

    train = config.train
    # Sized so that `make train` stays inside 10 minutes on a 2-core CPU, setup included.
    train.global_batch = 16
    # 16 / (4 x data 2) = 2 micro-batches through the pipeline: on 2 cores larger micro-batches
    # run faster than more of them (docs/benchmarks.md, "The tiny config's choices").
    train.micro_batch = 4
    train.steps = 700
    train.log_every = 10
    train.eval_every = 100
    train.eval_batches = 8
    # 8 sequences for the first 320 samples (40 steps), then 16.
    train.rampup.update(dict(start=8, increment=8, tokens=40_960))

    opt = config.optimizer
    # Measured (docs/benchmarks.md, "make train"): KJV validation loss after 300 steps 5.25 with
    # lr 8e-3, 4.94 with 2e-3 and 1e-3, 5.07 with 5e-4.
    opt.lr = 1.5e-3
    opt.min_lr = 1.5e-4
    opt.weight_decay = 0.1
    # 700 steps = (40 x 8 + 660 x 16) sequences x 128 = 1,392,640 tokens: warm up over about
    # 1.5 %, decay over the whole run (what decay_tokens=0 would count; fixed so shorter runs
    # keep it).
    opt.warmup_tokens = 20_000
    opt.decay_tokens = 1_392_640

    config.data.sources = ((0.9, 'data/default/kjv'), (0.1, 'data/default/python_stdlib'))
    config.data.split = '969,30,1'
    config.data.tokenizer = 'data/default/tokenizer.model'
    return config
