"""Pieces the decoder blocks are made of: named parameters, the norms (LayerNorm, RMSNorm),
the MLPs (GPT's GeLU, Llama's SwiGLU), dropout.

Every parameter carries `logical_axes` metadata (its dimensions' logical names); the rule table
in parallel/rules.py alone turns those into mesh axes. `model.bias = False` leaves the MLPs
(and attention's projections) without bias parameters; LayerNorm keeps its own.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mtnlg_jax.model import fp8_sites
from mtnlg_jax.parallel import taps
from mtnlg_jax.parallel.rules import constrain, piece_index


RESIDUAL = ('batch', 'residual_seq', 'embed')  # the residual stream's layout


def param(rngs, shape, logical_axes, std=None):
    """A parameter drawn from normal(0, std), or zeros when std is None."""
    if std is None:
        value = jnp.zeros(shape, jnp.float32)
    else:
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, logical_axes=tuple(logical_axes))


def use(variable, dtype):
    """A parameter's value in the compute dtype, cast where it is used: the forward sees the
    same numbers whether the parameters arrive in fp32 or already cast, and when they arrive
    in fp32 their gradient is summed in fp32 over every use (e.g. a pipeline's iterations)."""
    return variable[...].astype(dtype)


class LayerNorm(nnx.Module):
    """Layer norm over `embed`, computed in fp32 whatever the compute dtype."""

    def __init__(self, hidden, epsilon):
        self.scale = nnx.Param(jnp.ones((hidden,), jnp.float32), logical_axes=('embed',))
        self.bias = nnx.Param(jnp.zeros((hidden,), jnp.float32), logical_axes=('embed',))
        self.epsilon = epsilon

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over `embed` (Llama's): x / sqrt(mean(x^2) + eps) * scale, in fp32
    whatever the compute dtype; no mean subtracted, no bias."""

    def __init__(self, hidden, epsilon):
        self.scale = nnx.Param(jnp.ones((hidden,), jnp.float32), logical_axes=('embed',))
        self.epsilon = epsilon

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.epsilon)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def norm(cfg):
    """The norm `model.norm` names, over cfg.hidden with `model.layer_norm_epsilon`."""
    kind = cfg.get('norm', 'layernorm')
    return (RMSNorm if kind == 'rmsnorm' else LayerNorm)(cfg.hidden, cfg.layer_norm_epsilon)


def out_std(cfg):
    """The output projections' init std: init_std / sqrt(2 L), GPT-2's and Megatron's."""
    return cfg.init_std / math.sqrt(2 * cfg.num_layers)


def project(module, site, spec, x, kernel, contract=1):
    """x times a kernel parameter: the einsum `spec` in module.dtype (parallel/taps.py's, which
    a zero-bubble backward taps), or under model.fp8
    (module.fp8: fp8_sites.settings) the FP8 matmul of the block's `site` (model/fp8_sites.py)
    contracting x's last `contract` dimensions with the kernel's first."""
    w = use(kernel, module.dtype)
    if module.fp8 is None:
        return taps.matmul(kernel, spec, x, w)
    return fp8_sites.project(module.fp8, site, x, w, contract)


def maybe_bias(cfg, shape, logical_axes):
    """A zero bias parameter, or None under `model.bias = False`."""
    return param(None, shape, logical_axes) if cfg.get('bias', True) else None


def add_bias(x, bias, dtype):
    return x if bias is None else x + use(bias, dtype)


class MLP(nnx.Module):
    """hidden -> ffn_hidden (GeLU, tanh approximation as GPT-2) -> hidden."""

    def __init__(self, cfg, rngs, width=None):
        """width: the MLP's (None: model.ffn_hidden; an MoE block's shared experts: theirs)."""
        f = width or cfg.ffn_hidden
        self.in_kernel = param(rngs, (cfg.hidden, f), ('embed', 'mlp'), cfg.init_std)
        self.in_bias = maybe_bias(cfg, (f,), ('mlp',))
        self.out_kernel = param(rngs, (f, cfg.hidden), ('mlp', 'embed'), out_std(cfg))
        self.out_bias = maybe_bias(cfg, (cfg.hidden,), ('embed',))
        self.dtype = cfg.compute_dtype
        self.fp8 = fp8_sites.settings(cfg)
        self.gather_once = gathers_once(cfg)

    def __call__(self, x):
        h = project(self, 'mlp_up', 'bse,ef->bsf', x, self.in_kernel)
        h = add_bias(h, self.in_bias, self.dtype)
        h = checkpoint_name(constrain(h, ('batch', 'seq', 'mlp')), 'mlp_in')
        h = jax.nn.gelu(h, approximate=True)
        return project_down(self, h)


def project_down(mlp, h):
    """MLP-out: (batch, seq, mlp) -> (batch, residual_seq, embed), row parallel."""
    out = project(mlp, 'mlp_out', 'bsf,fe->bse', h, mlp.out_kernel)
    return onto_residual(out, mlp.out_bias, mlp.dtype, 'mlp_out', mlp.gather_once)


def gathers_once(cfg):
    """Whether onto_residual gathers a row-parallel output's gradient once: on sequence
    pieces (model.sequence_pieces > 1), where the other piece's work hides the one gather.
    With whole sequences the partitioner's own two gathers (one for each transposed matmul)
    let XLA:GPU order the input's gradient first and hide its reduce-scatter under the
    kernel's (the 530 B on H100s: 0.347 s exposed, 0.454 with one gather: docs/benchmarks.md).
    Under tensorwise and delayed FP8 the product gathers its gradient itself, once, in e5m2
    (fp8_sites.gathering): a gather in bf16 ahead of it would double the bytes."""
    fp8_gathers = fp8_sites.gathers_quantized(fp8_sites.settings(cfg))
    return cfg.get('sequence_pieces', 1) > 1 and not fp8_gathers


def onto_residual(out, bias, dtype, name, once):
    """A row-parallel product's output (batch, seq, embed), summed over `tensor`, onto the
    residual stream (sequence parallel: a reduce-scatter onto its sequence shards), its bias
    added, named for the recompute policy. `once` (gathers_once): backward, its gradient is
    gathered along the sequence once, for both the input's and the kernel's products, and the
    bias is added after the sum, on the shard (its gradient from the shard); left to the
    partitioner, each of the two transposed matmuls gathered it itself (a quarter of the
    405 B's tensor traffic: docs/benchmarks.md)."""
    if not once:
        return checkpoint_name(constrain(add_bias(out, bias, dtype), RESIDUAL), name)
    out = constrain(_whole_cotangent(out), RESIDUAL)
    return checkpoint_name(add_bias(out, bias, dtype), name)


@jax.custom_vjp
def _whole_cotangent(x):
    return x


def _whole_cotangent_backward(_, g):
    return (constrain(g, ('batch', 'seq', 'embed')),)


_whole_cotangent.defvjp(lambda x: (x, None), _whole_cotangent_backward)


class SwiGLU(nnx.Module):
    """Llama's MLP: out( silu(x gate) * (x in) ), gate and in (up) column parallel over `mlp`,
    out (down) row parallel. Hugging Face's gate_proj, up_proj, down_proj are gate_kernel,
    in_kernel, out_kernel (transposed)."""

    def __init__(self, cfg, rngs, width=None):
        """width: as MLP's."""
        f = width or cfg.ffn_hidden
        self.gate_kernel = param(rngs, (cfg.hidden, f), ('embed', 'mlp'), cfg.init_std)
        self.in_kernel = param(rngs, (cfg.hidden, f), ('embed', 'mlp'), cfg.init_std)
        self.gate_bias = maybe_bias(cfg, (f,), ('mlp',))
        self.in_bias = maybe_bias(cfg, (f,), ('mlp',))
        self.out_kernel = param(rngs, (f, cfg.hidden), ('mlp', 'embed'), out_std(cfg))
        self.out_bias = maybe_bias(cfg, (cfg.hidden,), ('embed',))
        self.dtype = cfg.compute_dtype
        self.fp8 = fp8_sites.settings(cfg)
        self.gather_once = gathers_once(cfg)

    def __call__(self, x):
        def up(h, bias, name):  # named apart for the recompute policy: 'mlp_gate', 'mlp_up'
            h = add_bias(h, bias, self.dtype)
            return checkpoint_name(constrain(h, ('batch', 'seq', 'mlp')), name)

        if self.fp8 is None or self.fp8[0] == 'blockwise':  # FP8's site 'mlp_up' is both
            gate = project(self, 'mlp_up', 'bse,ef->bsf', x, self.gate_kernel)
            gate = up(gate, self.gate_bias, 'mlp_gate')
            h = up(
                project(self, 'mlp_up', 'bse,ef->bsf', x, self.in_kernel), self.in_bias, 'mlp_up'
            )
        else:  # one FP8 product of the two kernels stacked as slots (model/fp8_sites.py)
            w = tuple(use(k, self.dtype) for k in (self.gate_kernel, self.in_kernel))
            gate, h = jnp.moveaxis(fp8_sites.project(self.fp8, 'mlp_up', x, w), -2, 0)
            gate, h = up(gate, self.gate_bias, 'mlp_gate'), up(h, self.in_bias, 'mlp_up')
        return project_down(self, jax.nn.silu(gate) * h)


def mlp(cfg, rngs, width=None):
    """The MLP `model.mlp` names, of `width` (None: model.ffn_hidden)."""
    return (SwiGLU if cfg.get('mlp', 'gelu') == 'swiglu' else MLP)(cfg, rngs, width)


# Dropout sites of one block (model/block.py, model/attention.py), told apart in the
# per-sequence keys.
ATTN_PROBS, ATTN_RESIDUAL, MLP_RESIDUAL = range(3)
SITES_PER_BLOCK = 3


def dropout(x, rate, row_keys, site):
    """Inverted dropout whose mask depends only on each sequence's own key and the site.

    `row_keys` holds one PRNG key per sequence (shape: x's leading batch dimensions), derived
    from the step's seed and the sequence's index in the global batch, so the masks are the
    same whatever the mesh layout, the split into micro-steps or the pipeline schedule. `site`
    tells dropout sites of one forward apart. Where each context rank holds its own places of
    the sequence in a region manual over 'context' (the train step's), its rank is folded in
    too: the ranks draw their own masks, not one mask each. No-op when rate is 0 or row_keys
    is None.
    """
    if rate == 0.0 or row_keys is None:
        return x
    batch_shape, row_shape = x.shape[: row_keys.ndim], x.shape[row_keys.ndim :]
    keys, rank = row_keys.reshape(-1), piece_index('seq')
    if rank is not None:
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, rank)
    keep = jax.vmap(
        lambda key: jax.random.bernoulli(jax.random.fold_in(key, site), 1.0 - rate, row_shape)
    )(keys)
    return jnp.where(keep.reshape(batch_shape + row_shape), x / (1.0 - rate), 0).astype(x.dtype)


def attention_dims(cfg):
    """(heads, kv_heads, head_dim) of a model config: `model.kv_heads` 0 means heads (full
    multi-head attention), `model.head_dim` 0 means hidden / heads."""
    kv_heads = cfg.get('kv_heads', 0) or cfg.heads
    head_dim = cfg.get('head_dim', 0) or cfg.hidden // cfg.heads
    return cfg.heads, kv_heads, head_dim
