"""What the model computes: its parameter count and its model FLOPs per token (for MFU), from
a model config's shapes alone (GPT-3's block and Llama's: GQA, SwiGLU, untied, no biases).
A mixture of experts' model FLOPs count the active parameters (`active_params`): the
router, the shared experts and top_k of the routed experts a layer; param_count counts every
expert, layer_matmul_params (what a token's forward multiplies) the active ones. The dense
layers ahead of the experts (model.moe.dense_layers) count as a dense model's layers."""

import math

import jax

from mtnlg_jax.config import block_stack_layers, moe_ffn_hidden, shared_ffn_hidden
from mtnlg_jax.model.layers import attention_dims
from mtnlg_jax.model.moe import experts_of


def count_params(params):
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def mlp_matrices(model_cfg):
    """The MLP's (hidden x ffn_hidden) matrices: 2 for GeLU (in, out), 3 for SwiGLU."""
    return 3 if model_cfg.get('mlp', 'gelu') == 'swiglu' else 2


def inactive_params(model_cfg):
    """The routed experts' parameters a token does not use: (experts - top_k) experts' MLP
    matrices an MoE layer (0 for a dense model)."""
    experts = experts_of(model_cfg)
    if not experts:
        return 0
    moe_layers = block_stack_layers(model_cfg)
    return moe_layers * (experts - model_cfg.moe.top_k) * expert_params(model_cfg)


def active_params(model_cfg, num_params):
    """The parameters one token's forward uses: num_params less the unchosen experts."""
    return num_params - inactive_params(model_cfg)


def expert_params(model_cfg):
    """One routed expert's weights: the block's MLP matrices at model.moe.ffn_hidden (no
    biases: model/moe.py)."""
    return mlp_matrices(model_cfg) * model_cfg.hidden * moe_ffn_hidden(model_cfg)


def mlp_matmul_params(model_cfg, active=True, dense=False):
    """One block's MLP matmul weights: the dense MLP's (h x f each; dense: a dense layer
    ahead of the experts); a mixture of experts' router (h x X), shared experts' MLP and
    routed experts, top_k of them (active) or all."""
    h = model_cfg.hidden
    experts = 0 if dense else experts_of(model_cfg)
    if not experts:
        return mlp_matrices(model_cfg) * h * model_cfg.ffn_hidden
    routed = model_cfg.moe.top_k if active else experts
    shared = mlp_matrices(model_cfg) * h * shared_ffn_hidden(model_cfg)
    return h * experts + shared + routed * expert_params(model_cfg)


def layer_matmul_params(model_cfg, active=True, dense=False):
    """One block's matmul weights: Q and out (h x H D each), K and V (h x K D each), the MLP's
    (mlp_matmul_params: a mixture of experts' active ones unless active=False; the dense MLP's
    with dense). GPT-3 with f = 4 h: 12 h^2."""
    heads, kv_heads, head_dim = attention_dims(model_cfg)
    h = model_cfg.hidden
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
    return attention + mlp_matmul_params(model_cfg, active, dense)


def fp8_matmul_params(model_cfg, experts_at_fp8=False):
    """One block's matmul weights that model.fp8 multiplies in FP8 GEMMs (model/fp8_sites.py's
    sites): attention's Q, K, V and out, the dense MLP's or a mixture of experts' shared
    experts', and with experts_at_fp8 the routed experts' active ones (the padded exchange's
    batched FP8 GEMMs: model/fp8_experts.py; elsewhere they multiply FP8 values at the
    compute dtype's rate). The router stays in the compute dtype. 0 without FP8."""
    if model_cfg.get('fp8', 'none') == 'none':
        return 0
    experts = experts_of(model_cfg)
    mlp_width = shared_ffn_hidden(model_cfg) if experts else model_cfg.ffn_hidden
    mlp = mlp_matrices(model_cfg) * model_cfg.hidden * mlp_width
    routed = model_cfg.moe.top_k * expert_params(model_cfg) if experts and experts_at_fp8 else 0
    return layer_matmul_params(model_cfg) - mlp_matmul_params(model_cfg) + mlp + routed


def mlp_biases(model_cfg, width):
    """The biases of a dense MLP of `width` (model.bias): its inner ones and the output's."""
    return (mlp_matrices(model_cfg) - 1) * width + model_cfg.hidden


def param_count(model_cfg):
    """Parameters of the model (padded vocabulary included), from its shapes. GPT-3's block:
    V h + s h + 2 h + L (4 h^2 + 2 h f + 9 h + f); in general the matmul weights, the biases
    (model.bias), the norms' scales (and LayerNorm's biases), the token embedding, the output
    layer when untied and the position table when learned. A mixture of experts: every
    routed expert, the router and the shared experts' MLP (its biases with model.bias) in the
    dense MLP's place, but in the dense layers ahead of the experts."""
    h, vocab = model_cfg.hidden, model_cfg.padded_vocab
    moe_layers = block_stack_layers(model_cfg)
    outside = vocab * h + norm_params(model_cfg)
    if not model_cfg.get('tie_embeddings', True):
        outside += vocab * h
    if model_cfg.get('position', 'learned') == 'learned':
        outside += model_cfg.seq_len * h
    dense_layers = model_cfg.num_layers - moe_layers
    return (
        outside
        + moe_layers * layer_params(model_cfg)
        + dense_layers * layer_params(model_cfg, dense=True)
    )


def norm_params(model_cfg):
    """One norm's: a scale (RMSNorm), and a bias (LayerNorm)."""
    h = model_cfg.hidden
    return 2 * h if model_cfg.get('norm', 'layernorm') == 'layernorm' else h


def layer_params(model_cfg, dense=False):
    """One block's parameters: its matmul weights (every expert's), biases and two norms;
    dense: a dense layer ahead of the experts."""
    heads, kv_heads, head_dim = attention_dims(model_cfg)
    biases = 0
    if model_cfg.get('bias', True):
        moe = experts_of(model_cfg) and not dense
        mlp_width = shared_ffn_hidden(model_cfg) if moe else model_cfg.ffn_hidden
        biases = (heads + 2 * kv_heads) * head_dim + model_cfg.hidden
        biases += mlp_biases(model_cfg, mlp_width) if mlp_width else 0
    matmuls = layer_matmul_params(model_cfg, active=False, dense=dense)
    return matmuls + biases + 2 * norm_params(model_cfg)


def attention_flops_per_token(model_cfg):
    """PaLM's 12 L H Q T: the scores and their weighted sum, forward and backward (causal
    masking not halved), H Q = heads x head_dim."""
    heads, _, head_dim = attention_dims(model_cfg)
    return 12 * model_cfg.num_layers * heads * head_dim * model_cfg.seq_len


def model_flops_per_token(model_cfg, num_params):
    """PaLM's 6 N + 12 L H Q T: matmuls forward and backward plus attention scores; N the
    active parameters of num_params (a mixture of experts: the chosen experts only)."""
    return 6 * active_params(model_cfg, num_params) + attention_flops_per_token(model_cfg)
