"""The block's matmuls in FP8 (model.fp8): which they are, how each reaches model/fp8.py, and
the delayed recipe's amax history.

    sites of a block (SITES), each one product of an activation x by a weight w:
        qkv                the fused QKV kernel (embed, 3, heads, head_dim), whole
        q, kv              grouped-query attention's two kernels (the KV one fused)
        attn_out           attention's output projection (heads x head_dim contracted)
        mlp_up, mlp_out    the MLP's in kernel (SwiGLU's gate and in stacked as two slots),
                           its out kernel; an MoE block's shared experts use them (its routed
                           experts' products: model/fp8_experts.py)
    One product a kernel, its slots unfolded: x's amax and quantization once, one input
    gradient to reduce over `tensor` (the slots' gradients summed inside the contraction), as
    the bf16 step's one einsum. Blockwise multiplies slot by slot (its blocks need one N).
    in the compute dtype as ever: the embeddings, the output layer, norms, attention's scores,
    softmax and context, the router

Each site is x (..., K) @ w (K, N) through fp8.matmul with model.fp8's recipe and
model.fp8_margin. Which tokens share a scale: tensorwise and delayed take x's amax over the
tensor the matmul sees, a micro-batch's rows (one sequence piece of them under
model.sequence_pieces); w's over the whole weight, whatever its layout: under SPMD jnp.max of
a weight split over `tensor` is the global max (tests/test_fp8_model.py). Blockwise scales
are local to a 1 x 128 tile (128 x 128 for weights), so no layout changes them.

Tensorwise and delayed quantize each weight once a step (quantized_weights): from the compute
copy, outside the micro-step loop, each site's kernel stacked over the layers is quantized
layer by layer (its scale the layer's amax over the whole kernel, as project's; delayed's
from the layer's history, this amax recorded for it as each micro-step did), one copy, with K
last (the forward GEMM's operand; the input gradient's GEMM transposes its layer's slice as
it runs: a second copy as it is, (K, N), held all step, was 6 GiB of the 405B's stage), and
the block stack's scan hands each layer its slice (layer_weights); the weight's gradient goes
to the bf16 kernel as ever. The same values as quantizing in every micro-step, without the amax
reductions, quantizations and transposes of every micro-step. Unpipelined, the train step
quantizes the whole stack (weights_once, stack_weights); pipelined, each stage its chunks
before the tick loop (the model's StageFunctions.prepare, parallel/stage_functions.py), a
loop-invariant input of the ticks and of each chunk's VJP, so no micro-batch in flight
stashes a quantized copy. Not yet: the dense layers ahead of experts (their own stack, run
with the embedding) and an MoE block's shared experts quantize in every micro-step.

Tensorwise and delayed also gather x quantized (gathering): where the block hands a site of
GATHERED_SITES x whole along the sequence (all-gathered over `tensor` under sequence
parallelism), the block hands it x as it lies and the product quantizes the shard (x's scale
still its whole tensor's amax, a max over the shards), then gathers it: the all-gather in FP8,
half the bytes, and the quantized x that the backward keeps (model.remat = selective's
fp8_input, a pipeline's stash per micro-batch in flight) a shard, 1 / tensor of it. Likewise
the gradient dy of SCATTERED_SITES (row parallel: their output reduce-scattered, so dy arrives
a shard) is quantized as it lies and gathered in e5m2 for the input and weight gradients. The
same values as quantizing the gathered x and dy.

What selective recompute keeps of a product (model/block.py's SELECTIVE_SAVED): x quantized
and its scale (fp8_input), but for SCATTERED_SITES only the scale: their x (attention's
context, SwiGLU's product) is whole along the sequence, t times a gathered site's shard, and
the backward recomputes it from kept matmul outputs as the bf16 step does, so it quantizes it
again by the kept scale (fp8.matmul's keep_input): the same values, without a stash of them
per micro-batch in flight (6.5 + 2 GiB of the 405B's 16 micro-batches x 4 chunks). Grouped
attention's q and kv products take one x: the block quantizes it once for both (project's
shared), so one quantized x is kept and gathered for the two (2 GiB of the 405B's stashes).

delayed: every block holds a buffer (model/buffers.py), `fp8_history` (sites, 2 [x, w],
model.fp8_amax_history), the amax values of earlier steps. A site's scale is
scale_of(the largest amax in its history); while the history is all zeros (the first step)
the current amax scales it, as tensorwise. Each step the block emits its sites' current amax
values as the side value `fp8_amax` (layers, sites, 2), combined by max over micro-steps,
pipeline chunks, stages and replicas (parallel/stage_functions.py); after the step the rule
`fp8_amax_history` pushes them in front of the history, dropping its oldest.
"""

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp

from mtnlg_jax.model import buffers, fp8
from mtnlg_jax.parallel.stage_functions import SideValue

SITES = ('qkv', 'q', 'kv', 'attn_out', 'mlp_up', 'mlp_out')
AMAX = 'fp8_amax'  # the side value: (layers, sites, 2) this step's amax of x and of w
RULE = 'fp8_amax_history'
_RECORDING = contextvars.ContextVar('mtnlg_jax_fp8_recording', default=None)
_STACK = contextvars.ContextVar('mtnlg_jax_fp8_stack', default=None)  # {site: stacked}
_LAYER = contextvars.ContextVar('mtnlg_jax_fp8_layer', default=None)  # {site: one layer's}
_GATHER = contextvars.ContextVar('mtnlg_jax_fp8_gather', default=None)  # gathering()'s
# The sites whose x the block hands whole along the sequence (gathered over `tensor` under
# sequence parallelism): tensorwise and delayed gather it quantized instead (gathering).
GATHERED_SITES = ('qkv', 'q', 'kv', 'mlp_up')
# The row-parallel sites, whose output is reduce-scattered along the sequence: their gradient
# dy arrives a sequence shard, and tensorwise and delayed gather it quantized (gathering).
SCATTERED_SITES = ('attn_out', 'mlp_out')


def settings(cfg):
    """(recipe, margin) of a model config, or None under model.fp8 = none."""
    recipe = cfg.get('fp8', 'none')
    return None if recipe == 'none' else (recipe, cfg.get('fp8_margin', 0))


def compiler_options(cfg):
    """The XLA options a program of a model config needs (jax.jit's compiler_options)."""
    return fp8.compiler_options(cfg.get('fp8', 'none'))


def history_buffer(cfg):
    """The delayed recipe's buffer of one block (the module docstring), or None."""
    if cfg.get('fp8', 'none') != 'delayed':
        return None
    zeros = jnp.zeros((len(SITES), 2, cfg.fp8_amax_history), jnp.float32)
    return buffers.buffer(zeros, (None, None, None), rule=RULE)


def side_values(recipe, num_layers):
    """{AMAX: SideValue} under the delayed recipe (model.fp8), else {}."""
    if recipe != 'delayed':
        return {}
    return {AMAX: SideValue('max', shape=(num_layers, len(SITES), 2))}


@buffers.update_rule(RULE)
def _push(value, values, step):
    """value (layers, sites, 2, history) in layer order: the step's amax values in front."""
    newest = jnp.maximum(values[AMAX], 0.0)  # a site no block ran: -inf -> 0, an empty slot
    return jnp.concatenate([newest[..., None], value[..., :-1]], axis=-1)


def project(setting, site, x, w, contract=1, shared=None):
    """x (..., *K) @ w (*K, *N) in FP8, K the last `contract` dimensions of x and the first of
    w (folded into one: the fold keeps a split dimension outermost); N stays as it is (a fused
    kernel's slot axis sits outside the heads tensor parallelism splits: folding it would move
    data), but for blockwise, whose weight blocks need one N (the caller gives it one slot).
    w may be a tuple of kernels of one shape, multiplied as slots (fp8.matmul): the result
    (..., slots, *N). shared: a dict the caller hands every product of one x (attention's q
    and kv): the first stores x quantized (fp8.quantized_input, by its own scale), the others
    multiply that, so the backward keeps one quantized x for them all (tensorwise and delayed;
    their x scales are the same: one x's amax, or histories of the same amax values)."""
    recipe, margin = setting
    first = w[0] if isinstance(w, tuple) else w
    lead = x.shape[: x.ndim - contract]
    k_shape, n_shape = first.shape[:contract], first.shape[contract:]
    x2 = x.reshape(*lead, math.prod(k_shape))
    w2 = jax.tree.map(lambda v: v.reshape(math.prod(k_shape), *n_shape), w)
    if isinstance(w, tuple):  # slots (fp8.matmul): the product's N is (slots, *N)
        n_shape = (len(w), *n_shape)
    if recipe == 'blockwise':
        w2 = w2.reshape(w2.shape[0], math.prod(n_shape))
    ahead = (_LAYER.get() or {}).get(site) if recipe != 'blockwise' else None
    if ahead is not None and ahead[0].shape != (*n_shape, math.prod(k_shape)):
        raise ValueError(f'FP8 site {site}: its weight was quantized ahead in another shape')
    quantized = None if ahead is None else ahead[:2]
    scales = None
    if recipe == 'delayed':
        w_amax = fp8.amax(w2) if ahead is None else ahead[2]  # w's: the step's, taken once
        now = tuple(jax.lax.stop_gradient(a) for a in (fp8.amax(x2), w_amax))
        recording = _RECORDING.get()
        if recording is None:  # outside a block's recording: current scaling
            scales, quantized = tuple(fp8.scale_of(a, fp8.E4M3, margin) for a in now), None
        else:
            scales = recording.scales(site, now, margin)
            recording.record(site, now)
    gather = _GATHER.get() if recipe != 'blockwise' else None
    gathers = [gather if site in sites else None for sites in (GATHERED_SITES, SCATTERED_SITES)]
    keep = site not in SCATTERED_SITES  # their x: requantized in the backward (the docstring)
    given = _shared_input(shared, recipe, x2, scales, margin)
    out = fp8.matmul(
        x2, w2, recipe, scales, margin, quantized, *gathers, keep_input=keep, x_quantized=given
    )  # fmt: skip
    return out.reshape(*lead, *n_shape)


def _shared_input(shared, recipe, x, scales, margin):
    """x quantized (fp8.quantized_input's q, scale and their named pair) from `shared`
    (project's), stored there by the first product of x; None without `shared` or under
    blockwise (its tiles are each product's)."""
    if shared is None or recipe == 'blockwise':
        return None
    if 'x' not in shared:
        shared['x'] = fp8.quantized_input(x, None if scales is None else scales[0], margin)
    return shared['x']


def _site_kernels(block):
    """{site: (kernel or tuple of slot kernels, contract)} of a dense block's parameters (a
    plain dict; each kernel stacked over layers or not); an MoE block's shared experts are
    not among them (they quantize in every micro-step)."""
    attention, mlp = block.get('attention', {}), block.get('mlp', {})
    names = {'qkv': 'qkv_kernel', 'q': 'q_kernel', 'kv': 'kv_kernel', 'attn_out': 'out_kernel'}
    sites = {
        s: (attention[k], 2 if s == 'attn_out' else 1) for s, k in names.items() if k in attention
    }
    if 'gate_kernel' in mlp:
        sites['mlp_up'] = ((mlp['gate_kernel'], mlp['in_kernel']), 1)
    elif 'in_kernel' in mlp:
        sites['mlp_up'] = (mlp['in_kernel'], 1)
    if 'out_kernel' in mlp:
        sites['mlp_out'] = (mlp['out_kernel'], 1)
    return sites


def _quantized_stack(w, contract, margin, past=None):
    """w (layers, *K, *N) or a tuple of slots of that shape, quantized layer by layer as
    project quantizes one layer's, with K last: (q (layers, [slots,] *N, K), scales (layers,),
    amax values (layers,)). past: delayed's (layers,) largest amax in each layer's
    history, the scale's where above 0 (Recording.scales); None: tensorwise's, this step's."""
    slots = w if isinstance(w, tuple) else (w,)
    layers, k = slots[0].shape[0], math.prod(slots[0].shape[1 : 1 + contract])
    folded = [v.reshape(layers, k, *v.shape[1 + contract :]) for v in slots]
    # each layer's amax reduced over its own axes, not over a (layers, -1) reshape: that
    # merges the dimensions split over `tensor`, and XLA all-gathers the whole kernel for it
    every = [jnp.max(jnp.abs(v), axis=tuple(range(1, v.ndim))) for v in folded]
    amax = functools.reduce(jnp.maximum, every).astype(jnp.float32)
    scale = fp8.scale_of(
        amax if past is None else jnp.where(past > 0, past, amax), fp8.E4M3, margin
    )
    q = [fp8.quantize(v, fp8.E4M3, scale.reshape(-1, *(1,) * (v.ndim - 1))) for v in folded]
    q = jnp.stack(q, 2) if isinstance(w, tuple) else q[0]
    return jnp.moveaxis(q, 1, -1), scale, amax


def quantized_weights(setting, blocks):
    """The tensorwise or delayed sites of `blocks` (block parameters beside their buffers, a
    plain dict stacked over layers: a whole stack or a pipeline's chunk) quantized layer by
    layer (the module docstring), {site: stacked} for the blocks' scan (apply_block_stack's
    weights); None under blockwise or without FP8."""
    if setting is None or setting[0] not in ('tensorwise', 'delayed'):
        return None
    margin, history = setting[1], blocks.get('fp8_history')
    past = None if history is None else jax.lax.stop_gradient(jnp.max(history[:, :, 1], -1))
    return {
        s: _quantized_stack(
            jax.lax.stop_gradient(w), c, margin, None if past is None else past[:, SITES.index(s)]
        )
        for s, (w, c) in _site_kernels(blocks).items()
    }


@contextlib.contextmanager
def weights_once(setting, blocks, layers):
    """While a step's engine traces: the sites of `blocks` (the compute copy's block stack
    beside its buffers, stacked over `layers`) quantized once (quantized_weights), for the
    stack's scan (stack_weights); nothing under blockwise or blocks None."""
    stack = None if blocks is None else quantized_weights(setting, blocks)
    if stack is None:
        yield
        return
    token = _STACK.set((layers, stack))
    try:
        yield
    finally:
        _STACK.reset(token)


def stack_weights(layers):
    """The quantized weights (weights_once) of the block stack of `layers` layers being
    traced, {site: stacked}, or None outside weights_once."""
    held = _STACK.get()
    if held is None:
        return None
    if held[0] != layers:
        raise ValueError(f'FP8 weights quantized for {held[0]} layers, a stack of {layers} runs')
    return held[1]


@contextlib.contextmanager
def layer_weights(weights):
    """While one layer of the stack runs: its slice of stack_weights' (None: none)."""
    token = _LAYER.set(weights)
    try:
        yield
    finally:
        _LAYER.reset(token)


def gathers_quantized(setting):
    """Whether the products of GATHERED_SITES gather their x quantized (tensorwise and
    delayed: gathering), so that the block hands them x as it lies."""
    return setting is not None and setting[0] in ('tensorwise', 'delayed')


@contextlib.contextmanager
def gathering(gather):
    """While a block runs: the products of GATHERED_SITES take x as it lies (a sequence-
    parallel shard) and gather it once quantized with `gather` (fp8.matmul's gather: the
    all-gather in FP8, the x kept for the backward a shard), those of SCATTERED_SITES their
    gradient dy (gather_dy); gather None: x and dy as they come."""
    token = _GATHER.set(gather)
    try:
        yield
    finally:
        _GATHER.reset(token)


class Recording:
    """One block's delayed-recipe bookkeeping while it runs: the scales its history gives, the
    amax values its sites see (max over the calls of a site: sequence pieces)."""

    def __init__(self, history):
        self.history = jax.lax.stop_gradient(history)  # (sites, 2, length)
        self.amax = {}

    def scales(self, site, now, margin):
        past = jnp.max(self.history[SITES.index(site)], axis=-1)  # (2,): x's, w's
        return tuple(
            fp8.scale_of(jnp.where(past[i] > 0, past[i], now[i]), fp8.E4M3, margin)
            for i in range(2)
        )

    def record(self, site, now):
        now = jnp.stack(now)
        self.amax[site] = now if site not in self.amax else jnp.maximum(self.amax[site], now)

    def values(self, layer, num_layers):
        """{AMAX: (num_layers, sites, 2)}: this block's row its amax values (0 for a site it
        has not), the other rows -inf (max's identity)."""
        table = jnp.stack([self.amax.get(site, jnp.zeros((2,), jnp.float32)) for site in SITES])
        row = jnp.arange(num_layers) == layer
        return {AMAX: jnp.where(row[:, None, None], table[None], -jnp.inf)}


@contextlib.contextmanager
def recording(history):
    """While a block runs: its sites' scales from `history` (the block's fp8_history), their
    amax values kept (Recording); yields None when history is None (no delayed recipe)."""
    if history is None:
        yield None
        return
    token = _RECORDING.set(Recording(history))
    try:
        yield _RECORDING.get()
    finally:
        _RECORDING.reset(token)
