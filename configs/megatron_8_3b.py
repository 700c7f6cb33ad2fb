"""Megatron-LM's GPT-2 8.3 B (arXiv 1909.08053), 8-way tensor parallel as in the paper.

72 layers, hidden 3072, 24 heads (head dim 128), seq 1024, vocabulary 50257 padded to 51200;
batch 512 for 300 k iterations; lr 1.5e-4, 3 k warmup iterations, cosine to 1e-5; weight
decay 0.01; dropout 0.1; init normal(0, 0.02) with each residual branch's output projection
scaled by 1/sqrt(2 x layers). The paper counts iterations; here the schedule is in tokens:
3 k x 512 x 1024 = 1.57 B warmup tokens, 300 k x 512 x 1024 = 157 B decay tokens.

    python launch/train.py --config configs/megatron_8_3b.py --workdir runs/megatron_8_3b \
        --config.data.sources="((1.0, 'PATH/PREFIX'),)"   # PREFIX.bin/.idx: launch/preprocess.py
"""

from mtnlg_jax import config as config_lib

TOKENS_PER_ITERATION = 512 * 1024


def get_config():
    config = config_lib.defaults()
    config.mesh.update(dict(data=-1, stage=1, tensor=8))

    config.model.update(
        dict(
            num_layers=72,
            hidden=3072,
            heads=24,
            seq_len=1024,
            vocab_size=50257,
            init_std=0.02,
            attention_dropout=0.1,
            hidden_dropout=0.1,
            compute_dtype='bfloat16',
            remat='full',
            sequence_parallel=True,
        )
    )
    config.train.update(
        dict(global_batch=512, micro_batch=8, steps=300_000, log_every=10, eval_every=1000)
    )
    config.optimizer.update(
        dict(
            lr=1.5e-4,
            min_lr=1e-5,
            warmup_tokens=3_000 * TOKENS_PER_ITERATION,
            decay_tokens=300_000 * TOKENS_PER_ITERATION,
            b1=0.9,
            b2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            clip_norm=1.0,
        )
    )
    config.checkpoint.update(dict(every=1000, keep=3))
    config.data.tokenizer = 'data/gpt2'  # GPT-2 BPE: DIR/vocab.json + merges.txt
    return config
