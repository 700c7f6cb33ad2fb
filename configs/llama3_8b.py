"""Llama 3 8B (arXiv 2407.21783, table 3) with Llama 3.1's rope scaling, as its published
checkpoints carry it.

32 layers, hidden 4096, SwiGLU 14336, 32 query heads over 8 key/value heads (head dim 128),
RMSNorm (eps 1e-5), rope theta 500000 with 'llama3' scaling (factor 8, low / high frequency
factors 1 / 4, original context 8192), no biases, untied embeddings, vocabulary 128256,
sequence 8192; peak LR 3e-4 (table 3).

What differs from Meta's run: Meta published only the peak LR and the shapes of the 8B; the
rest is Llama 2's recipe (arXiv 2307.09288): AdamW (0.9, 0.95), weight decay 0.1, clip 1.0,
2,000 warm-up steps, cosine to 10 % of the peak over the 15 T tokens of Llama 3, a batch of
4 M tokens (512 x 8192). No sequence-length ramp (Meta's 405B started at 4096); documents
are packed without masks unless data.reset_attention_mask is set. Layout: Meta did not
publish the 8B's; tensor 2 x data -1 with selective recompute fits an 80 GB H100
(launch/plan.py --config configs/llama3_8b.py --devices 8 --target h100-80gb).

    python launch/train.py --config configs/llama3_8b.py --workdir runs/llama3_8b \
        --config.data.sources="((1.0, 'PATH/PREFIX'),)" \
        --config.data.tokenizer=PATH/tokenizer.json
"""

from mtnlg_jax import config as config_lib

SEQ = 8192
TOKENS = 15e12  # Llama 3's pre-training corpus
LLAMA3_BLOCK = dict(
    position='rope',
    rope_theta=500000.0,
    norm='rmsnorm',
    layer_norm_epsilon=1e-5,
    mlp='swiglu',
    tie_embeddings=False,
    bias=False,
    vocab_size=128256,
    seq_len=SEQ,
    init_std=0.02,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    compute_dtype='bfloat16',
    sequence_parallel=True,
)
LLAMA31_ROPE_SCALING = dict(
    type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192
)


def llama3(shape, lr, min_lr, global_batch, warmup_steps, mesh, remat='selective'):
    """A Llama 3 config: `shape` (num_layers, hidden, heads, kv_heads, ffn_hidden), the
    optimizer's peak and floor, the batch in sequences of 8192, the warm-up in steps of that
    batch, and the mesh ({axis: size}; an axis not named keeps its default)."""
    config = config_lib.defaults()
    config.mesh.update(mesh)
    layers, hidden, heads, kv_heads, ffn = shape
    config.model.update(
        dict(num_layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=ffn)
    )
    config.model.update(LLAMA3_BLOCK)
    config.model.remat = remat
    config.model.rope_scaling.update(LLAMA31_ROPE_SCALING)
    tokens_per_step = global_batch * SEQ
    config.train.update(
        dict(
            global_batch=global_batch,
            micro_batch=1,
            steps=int(TOKENS // tokens_per_step),
            log_every=10,
            eval_every=1000,
        )
    )
    config.optimizer.update(
        dict(
            lr=lr,
            min_lr=min_lr,
            warmup_tokens=warmup_steps * tokens_per_step,
            decay_tokens=0,  # the run's tokens
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            clip_norm=1.0,
        )
    )
    config.checkpoint.update(dict(every=1000, keep=3))
    config.data.tokenizer = 'data/llama3/tokenizer.json'  # Meta's, as Hugging Face ships it
    return config


def get_config():
    return llama3(
        (32, 4096, 32, 8, 14336),
        lr=3e-4,
        min_lr=3e-5,
        global_batch=512,
        warmup_steps=2000,
        mesh=dict(data=-1, tensor=2),
    )
