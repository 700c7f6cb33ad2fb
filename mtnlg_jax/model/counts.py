"""What the model computes: its parameter count and its model FLOPs per token (for MFU), from
a model config's shapes alone (GPT-3's block and Llama's: GQA, SwiGLU, untied, no biases)."""

import math

import jax

from mtnlg_jax.model.layers import attention_dims


def count_params(params):
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def mlp_matrices(model_cfg):
    """The MLP's (hidden x ffn_hidden) matrices: 2 for GeLU (in, out), 3 for SwiGLU."""
    return 3 if model_cfg.get('mlp', 'gelu') == 'swiglu' else 2


def layer_matmul_params(model_cfg):
    """One block's matmul weights: Q and out (h x H D each), K and V (h x K D each), the MLP's
    matrices (h x f each). GPT-3 with f = 4 h: 12 h^2."""
    heads, kv_heads, head_dim = attention_dims(model_cfg)
    h = model_cfg.hidden
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
    return attention + mlp_matrices(model_cfg) * h * model_cfg.ffn_hidden


def param_count(model_cfg):
    """Parameters of the model (padded vocabulary included), from its shapes. GPT-3's block:
    V h + s h + 2 h + L (4 h^2 + 2 h f + 9 h + f); in general the matmul weights, the biases
    (model.bias), the norms' scales (and LayerNorm's biases), the token embedding, the output
    layer when untied and the position table when learned."""
    heads, kv_heads, head_dim = attention_dims(model_cfg)
    h, f, vocab = model_cfg.hidden, model_cfg.ffn_hidden, model_cfg.padded_vocab
    norm = 2 * h if model_cfg.get('norm', 'layernorm') == 'layernorm' else h
    biases = 0
    if model_cfg.get('bias', True):
        biases = (heads + 2 * kv_heads) * head_dim + h + (mlp_matrices(model_cfg) - 1) * f + h
    per_layer = layer_matmul_params(model_cfg) + biases + 2 * norm
    outside = vocab * h + norm
    if not model_cfg.get('tie_embeddings', True):
        outside += vocab * h
    if model_cfg.get('position', 'learned') == 'learned':
        outside += model_cfg.seq_len * h
    return outside + model_cfg.num_layers * per_layer


def attention_flops_per_token(model_cfg):
    """PaLM's 12 L H Q T: the scores and their weighted sum, forward and backward (causal
    masking not halved), H Q = heads x head_dim."""
    heads, _, head_dim = attention_dims(model_cfg)
    return 12 * model_cfg.num_layers * heads * head_dim * model_cfg.seq_len


def model_flops_per_token(model_cfg, num_params):
    """PaLM's 6 N + 12 L H Q T: matmuls forward and backward plus attention scores."""
    return 6 * num_params + attention_flops_per_token(model_cfg)
