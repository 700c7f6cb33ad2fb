"""The paper's optimizer: AdamW with global-norm clipping, learning rate as a function of tokens.

MT-NLG: Adam(0.9, 0.95, 1e-8), weight decay 0.1 (not on biases or layer norms), clip 1.0,
linear warmup over the first 1 B tokens, cosine decay to 10 % of peak over 340 B tokens.
The schedule is counted in tokens, not steps, so it stays right when the batch size ramps up;
the train step evaluates it at the tokens seen and scales the update itself.
"""

import jax
import optax


def learning_rate_schedule(opt_cfg):
    """lr(tokens_seen): optax's warmup + cosine, with tokens as its 'count'. The token
    counts go in as floats: Llama 3's (8.4 B warm-up tokens, 17 T decay tokens) overflow the
    int32 a jitted step would make of Python integers."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=opt_cfg.lr,
        warmup_steps=float(opt_cfg.warmup_tokens),
        decay_steps=float(opt_cfg.decay_tokens),
        end_value=opt_cfg.min_lr,
    )


def weight_decay_mask(params):
    """True for the leaves weight decay applies to: matmul kernels and embeddings."""

    def decays(path, _):
        name = path[-1].key
        return name.endswith('kernel') or name.endswith('embed')

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(opt_cfg):
    """Clip, Adam moments and decoupled weight decay; the step multiplies by -lr(tokens)."""
    return optax.chain(
        optax.clip_by_global_norm(opt_cfg.clip_norm) if opt_cfg.clip_norm > 0 else optax.identity(),
        optax.scale_by_adam(b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps),
        optax.add_decayed_weights(opt_cfg.weight_decay, mask=weight_decay_mask),
    )
