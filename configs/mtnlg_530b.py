"""Megatron-Turing NLG 530 B (arXiv 2201.11990): the model, the recipe and the layout.

105 layers, hidden 20480, 128 heads (head dim 160), seq 2048, GPT-2 BPE (50257, padded to
51200); init normal(0, 4e-3); Adam(0.9, 0.95, 1e-8), weight decay 0.1, clip 1.0; lr 5e-5 with
linear warmup over 1 B tokens and cosine decay to 10 % over 340 B tokens; global batch 1920
ramped up from 32 by 32 over the first 12 B tokens; bf16 compute with fp32 master weights and
optimizer state. Layout of one replica: tensor 8 inside a DGX node, pipeline 35 across nodes
(3 layers per stage), data parallel over replicas with ZeRO-1. Data: the paper's blend of 15
sources at its sampling weights (MTNLG_BLEND), each a .bin/.idx pair under DATA_ROOT (written
by launch/preprocess.py, or Megatron-LM's tools/preprocess_data.py with the GPT-2 BPE); the
paths are yours to set.

The recipe differs from the paper's in two keys, the fastest that fits on 280 DGX A100 nodes
(bench/recipes.py, each compiled by XLA:GPU for the whole layout, ranked by the planner's
predicted step): Megatron's selective recompute (arXiv 2205.05198: the attention core, not the
whole layer) instead of full recompute, and the interleaved 1F1B schedule with 3 chunks of
one layer per stage (the layout Korthikanti et al. ran the 530 B with), whose bubble is a
third of 1F1B's. The paper's recipe is one override away:

    python launch/train.py --config configs/mtnlg_530b.py --workdir runs/mtnlg_530b
    ... --config.model.remat=full --config.pipeline.repeats=1     (the paper's)

Attention is fused on GPUs (`model.attention=auto`): MT-NLG's head dimension, 160, is over
cuDNN's flash attention limit on A100s (128), and cuDNN draws attention dropout masks from a
fixed seed, so with the paper's attention dropout 0.1 the step runs the Pallas flash kernel
(mtnlg_jax/model/flash_attention.py: Triton, per-sequence dropout keys) on A100s and H100s;
cuDNN on H100s once `model.attention_dropout=0`.
"""

from mtnlg_jax import config as config_lib

DATA_ROOT = '/data/mtnlg'
# Sampling weight (%) of each source in MT-NLG's training blend (arXiv 2201.11990, table 2).
MTNLG_BLEND = (
    (19.3, 'openwebtext2'),
    (15.7, 'cc-2021-04'),
    (14.3, 'books3'),
    (13.0, 'cc-2020-50'),
    (9.4, 'pile-cc'),
    (9.0, 'realnews'),
    (5.7, 'stackexchange'),
    (4.8, 'wikipedia'),
    (2.9, 'pubmed-abstracts'),
    (1.6, 'github'),
    (1.4, 'arxiv'),
    (1.0, 'bookcorpus2'),
    (0.9, 'pg-19'),
    (0.9, 'cc-stories'),
    (0.2, 'nih-exporter'),
)


def get_config():
    config = config_lib.defaults()
    config.mesh.update(dict(data=-1, stage=35, tensor=8))
    config.pipeline.repeats = 3  # interleaved 1F1B (the paper's: 1)
    # the fp32 gradient accumulation inside the dW GEMMs, each chunk's beside its backward
    # (parallel/chained.py): 23.08 -> 20.59 s replayed on A100s (docs/benchmarks.md, "The
    # accumulation in the GEMMs"), 8.90 -> 7.22 s on H100s ("The 530 B's dW GEMMs on H100s");
    # the 405B's step it slows
    config.pipeline.fused_accumulation = True

    config.model.update(
        dict(
            num_layers=105,
            hidden=20480,
            heads=128,
            seq_len=2048,
            vocab_size=50257,
            init_std=4e-3,
            attention_dropout=0.1,
            hidden_dropout=0.1,
            compute_dtype='bfloat16',
            remat='selective',  # the paper's: full
            sequence_parallel=True,
        )
    )
    config.train.update(
        dict(global_batch=1920, micro_batch=1, steps=140_000, log_every=1, eval_every=1000)
    )
    config.train.rampup.update(dict(start=32, increment=32, tokens=12_000_000_000))
    config.optimizer.update(
        dict(
            lr=5e-5,
            min_lr=5e-6,
            warmup_tokens=1_000_000_000,
            decay_tokens=340_000_000_000,
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            clip_norm=1.0,
        )
    )
    config.checkpoint.update(dict(every=100, keep=2))
    config.data.sources = tuple((weight, f'{DATA_ROOT}/{name}') for weight, name in MTNLG_BLEND)
    config.data.tokenizer = f'{DATA_ROOT}/gpt2'  # GPT-2 BPE (gpt2-vocab.json, gpt2-merges.txt)
    return config
