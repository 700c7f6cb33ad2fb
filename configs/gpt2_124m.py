"""GPT-2 small (124 M parameters) with the GPT-3 paper's recipe for its size.

12 layers, hidden 768, 12 heads, seq 1024, GPT-2 BPE vocabulary (50257, padded to 50304);
batch 512 x 1024 = 0.5 M tokens, lr 6e-4 with 375 M warmup tokens, cosine to 10 % over 260 B.
Data parallel over every device; bf16 compute.

    python launch/train.py --config configs/gpt2_124m.py --workdir runs/gpt2_124m \
        --config.data.sources="((1.0, 'PATH/PREFIX'),)"   # PREFIX.bin/.idx: launch/preprocess.py

The corpus is tokenized with the same files, as Megatron does it:
    python launch/preprocess.py --input corpus.jsonl --tokenizer-type GPT2BPETokenizer \
        --vocab-file data/gpt2/vocab.json --merge-file data/gpt2/merges.txt \
        --output-prefix PATH/PREFIX --append-eod --workers 8
"""

from mtnlg_jax import config as config_lib


def get_config():
    config = config_lib.defaults()
    config.mesh.update(dict(data=-1, stage=1, tensor=1))

    config.model.update(
        dict(
            num_layers=12,
            hidden=768,
            heads=12,
            seq_len=1024,
            vocab_size=50257,
            init_std=0.02,
            attention_dropout=0.1,
            hidden_dropout=0.1,
            compute_dtype='bfloat16',
            remat='none',
            sequence_parallel=True,
        )
    )
    config.train.update(
        dict(global_batch=512, micro_batch=8, steps=500_000, log_every=10, eval_every=1000)
    )
    config.optimizer.update(
        dict(
            lr=6e-4,
            min_lr=6e-5,
            warmup_tokens=375_000_000,
            decay_tokens=260_000_000_000,
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            clip_norm=1.0,
        )
    )
    config.checkpoint.update(dict(every=1000, keep=3))
    config.data.tokenizer = 'data/gpt2'  # GPT-2 BPE: DIR/vocab.json + merges.txt
    return config
