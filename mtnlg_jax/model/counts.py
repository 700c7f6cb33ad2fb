"""What the model computes: its parameter count and its model FLOPs per token (for MFU)."""

import math

import jax


def count_params(params):
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def model_flops_per_token(model_cfg, num_params):
    """PaLM's 6 N + 12 L H Q T: matmuls forward and backward plus attention scores."""
    head_dim = model_cfg.hidden // model_cfg.heads
    attention = 12 * model_cfg.num_layers * model_cfg.heads * head_dim * model_cfg.seq_len
    return 6 * num_params + attention
