"""A mixture of experts in place of the block's MLP: a router picks top_k of `experts` MLPs
for every token, the tokens are sorted by expert and each expert multiplies only its own.

    x (batch, seq, embed)
      -> router (fp32): logits = x @ router_kernel, scores = softmax | sigmoid (logits);
         the k experts of highest score + router_bias (the bias only chooses), their weights
         the scores, renormalised to sum to 1 under model.moe.norm_top_k
      -> capacity (model.moe.capacity_factor > 0): within each sequence an expert takes at
         most C = ceil(factor x seq x k / experts) choices, every token's first choice
         before any second choice, in token order; the rest are dropped (weight 0)
      -> dispatch: the batch's (token, choice) pairs sorted by expert (dropped ones last),
         each expert's rows a contiguous group:

             rows  [ e0 e0 e0 | e1 | e2 e2 | ... | dropped ]   group_sizes (experts,)

         a grouped matmul multiplies group g by expert g's weights: the work of the chosen
         experts only, never of every expert on every token
      -> the rows back in token order, weighted and summed over the k choices
      -> + the shared experts (one dense MLP of model.moe.shared_ffn_hidden, always on)

Under expert parallelism (mesh.expert > 1, inside the train step's region manual over
'expert') model/moe_exchange.py's exchange takes dispatch's place: the rows go to their
experts' ranks and come back, in capacity-padded buffers by all_to_all or, as
model.moe.exchange = 'ragged', the chosen rows alone by ragged_all_to_all. Under parallel
folding (model.moe.fold_tensor) the tensor ranks are more expert ranks: the exchange runs over
expert x tensor, each tensor rank sending its 1/t share of every expert's rows, each expert
whole on its rank (no tensor all-reduce in the experts).

The grouped matmul (`grouped_matmul_kind`): each group padded to whole tiles of rows
(model/grouped_matmul.py's layout), every tile multiplied by its expert's weights: the work
of the chosen rows plus at most one partial tile per expert. On GPUs the Pallas kernel of
model/grouped_matmul.py reads each tile's expert weights in place; on the CPU a batched
matmul over the tiles reads them as a gathered copy, (tiles, embed, width), about 17 copies
of the experts at the CPU's tile size (memory the tests' small models afford); on TPUs
jax.lax.ragged_dot. XLA:CPU and XLA:GPU (jax 0.10.2) both lower ragged_dot to a dense product
over every expert: compiled for an H100 at tiny_moe's shapes its matmul FLOPs are 7.97 times
the active count (a (rows, experts x hidden) masked copy of the input against every expert's
weights), the tiles' 1.05 times.

Parameters (E = embed, X = experts, F = model.moe.ffn_hidden; logical axes in brackets, see
parallel/rules.py: `experts` splits over the `expert` mesh axis, each rank its own experts;
`expert_mlp` splits over tensor as `mlp` does; `expert_scores`, the router's, stay whole):

    router_kernel   (E, X)        [embed, expert_scores]      fp32 in use
    gate_kernel     (X, E, F)     [experts, embed, expert_mlp]  SwiGLU blocks only
    in_kernel       (X, E, F)     [experts, embed, expert_mlp]
    out_kernel      (X, F, E)     [experts, expert_mlp, embed]
    shared          the block's MLP (model/layers.py) of the shared width, if any
    router_bias     (X,)          [expert_scores] a buffer (model/buffers.py), not a parameter

The experts have no biases (Mixtral's, Qwen's and DeepSeek's have none).

Side values each MoE block emits (parallel/stage_functions.py), summed over the batch:

    moe_aux_loss  differentiable: Switch's load-balancing loss of each sequence, aux_loss_coeff
                  x X x sum_e f_e P_e (f_e: the fraction of the sequence's choices that went
                  to e, P_e: e's mean normalised score), times seq: the step divides by the
                  token count, so the objective gains its mean over sequences (per sequence:
                  a group fixed by the data, so every layout computes the same loss)
    moe_z_loss    differentiable: z_loss_coeff x the sum over tokens of logsumexp(logits)^2
    moe_loads     (layers, X): the choices each expert received (before capacity), each layer
                  its own row
    moe_dropped   the choices dropped by capacity

router_bias moves after each step by bias_update_rate x sign(mean load - load) of its layer's
row of moe_loads (auxiliary-loss-free balancing): an under-loaded expert is chosen more often.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mtnlg_jax.config import moe_ffn_hidden, shared_ffn_hidden
from mtnlg_jax.model import buffers, fp8_experts, fp8_sites, grouped_matmul, moe_exchange
from mtnlg_jax.model.layers import mlp, out_std, param, use
from mtnlg_jax.parallel import context as context_lib
from mtnlg_jax.parallel.rules import EXPERT_AXIS, constrain, gather, own, shards, total
from mtnlg_jax.parallel.stage_functions import SideValue

AUX_LOSS, Z_LOSS, LOADS, DROPPED = 'moe_aux_loss', 'moe_z_loss', 'moe_loads', 'moe_dropped'
# Names selective recompute keeps (model/block.py's SELECTIVE_SAVED): the router's choice and
# the dispatch's sort, so the backward never routes or sorts again, and the grouped matmuls'
# outputs, as the dense MLP's; folded, the rows each all-to-all delivers (1/t of the rows a
# rank of the unfolded exchange holds), so the backward runs no exchange again.
SAVED_NAMES = ('moe_route', 'moe_in', 'moe_out', 'moe_exchanged')
# The CPU's grouped matmul pads each expert's group to whole blocks: the block is the largest
# power of two that keeps the padding within 1/16 of the rows (at most BLOCK_MAX rows).
PADDING_SHARE, BLOCK_MAX = 16, 256


def experts_of(cfg):
    """model.moe.experts of a model config (0: a dense MLP; a config without the section too)."""
    return cfg.moe.experts if 'moe' in cfg else 0


def side_values(num_layers, experts):
    """{name: SideValue} a model of `experts` routed experts emits ({} for a dense model)."""
    if not experts:
        return {}
    return {
        AUX_LOSS: SideValue('sum', differentiable=True),
        Z_LOSS: SideValue('sum', differentiable=True),
        LOADS: SideValue('sum', shape=(num_layers, experts)),
        DROPPED: SideValue('sum'),
    }


def grouped_matmul_kind(device):
    """'pallas' (model/grouped_matmul.py's kernel) on a GPU, 'ragged' (jax.lax.ragged_dot) on a
    TPU, 'blocks' on the CPU (device None too): XLA:CPU and XLA:GPU lower ragged_dot densely
    over every expert (the module's docstring)."""
    platform = None if device is None else device.platform
    return {'gpu': 'pallas', 'cuda': 'pallas', 'tpu': 'ragged'}.get(platform, 'blocks')


def bias_rule(rate):
    """The name of router_bias's update rule at `rate`, registered on first use: the rate is
    the rule's own (a resumed run may change it; the buffer stays)."""
    name = f'router_bias(rate={rate!r})'
    if name not in buffers.RULES:

        def move(value, values, step):
            """value (MoE layers, experts) in layer order; loads the step's, over the batch,
            a row for every layer (the dense layers ahead of the experts, if any, first)."""
            loads = values[LOADS]
            if loads.shape[0] != value.shape[0]:
                loads = loads[loads.shape[0] - value.shape[0] :]
            return value + rate * jnp.sign(loads.mean(-1, keepdims=True) - loads)

        buffers.update_rule(name)(move)
    return name


class MoE(nnx.Module):
    """The module docstring's layer: __call__(x, layer) -> (output, side values)."""

    def __init__(self, cfg, rngs, grouped='blocks'):
        moe = cfg.moe
        experts, hidden, width = moe.experts, cfg.hidden, moe_ffn_hidden(cfg)
        # parallel folding: each expert whole on its rank of expert x tensor (rules.py)
        self.fold = moe.get('fold_tensor', False)
        experts_axis, width_axis = (
            ('folded_experts', None) if self.fold else ('experts', 'expert_mlp')
        )
        inward = (experts_axis, 'embed', width_axis)
        scores = ('embed', 'expert_scores')  # every rank routes to every expert
        self.router_kernel = param(rngs, (hidden, experts), scores, cfg.init_std)
        self.swiglu = cfg.get('mlp', 'gelu') == 'swiglu'
        self.gate_kernel = (
            param(rngs, (experts, hidden, width), inward, cfg.init_std) if self.swiglu else None
        )
        self.in_kernel = param(rngs, (experts, hidden, width), inward, cfg.init_std)
        self.out_kernel = param(
            rngs, (experts, width, hidden), (experts_axis, width_axis, 'embed'), out_std(cfg)
        )
        shared = shared_ffn_hidden(cfg)
        self.shared = mlp(cfg, rngs, shared) if shared else None
        rule = bias_rule(moe.bias_update_rate)
        self.router_bias = buffers.buffer(
            jnp.zeros((experts,), jnp.float32), ('expert_scores',), rule
        )
        self.experts, self.top_k, self.num_layers = experts, moe.top_k, cfg.num_layers
        self.router, self.norm_top_k = moe.router, moe.norm_top_k
        self.routed_scale = moe.get('routed_scale', 1.0)
        self.capacity_factor = moe.capacity_factor
        self.aux_loss_coeff, self.z_loss_coeff = moe.aux_loss_coeff, moe.z_loss_coeff
        self.grouped = grouped  # grouped_matmul_kind()
        self.exchange_kind = moe.get('exchange', 'padded')  # moe_exchange.EXCHANGES
        self.native_ragged = grouped != 'blocks'  # XLA:CPU has no ragged all-to-all
        self.dtype = cfg.compute_dtype
        self.fp8 = fp8_sites.settings(cfg)  # (recipe, margin) or None

    def __call__(self, x, layer):
        """x (batch, residual_seq, embed), the block's normalised input; layer: the block's
        global index (its row of moe_loads). Returns (batch, residual_seq, embed) and the
        side values. Capacity counts whole sequences: x is gathered along seq (under
        sequence parallelism one all-gather over tensor) where the experts read it, but
        folded, where the exchange gathers it itself and the router reads each rank's slice."""
        whole = constrain(x, ('batch', 'seq', 'embed'))
        over_experts = EXPERT_AXIS in jax.sharding.get_abstract_mesh().manual_axes
        folded = self.fold and over_experts and shards('folded_experts') > 1
        logits, scores, chosen, weights = self.route(x if folded else whole)
        keep = self.kept(chosen)
        weights = jnp.where(keep, weights, 0.0)
        if folded:
            out = moe_exchange.folded(self, x, chosen, weights, keep)
        elif over_experts and shards('experts') > 1:
            out = moe_exchange.exchange(self, whole, chosen, weights, keep)
        else:
            out = self.dispatch(whole, chosen, weights, keep)
        out = constrain(out, ('batch', 'residual_seq', 'embed'))
        if self.shared is not None:
            out = out + self.shared(whole)
        return out, self.values(logits, scores, chosen, keep, layer)

    def route(self, x):
        """(logits, scores (batch, seq, experts), chosen, weights (batch, seq, top_k)), fp32:
        the k experts of highest score + router_bias, their scores as weights."""
        kernel = self.router_kernel[...].astype(jnp.float32)
        logits = jnp.einsum('bse,ex->bsx', x.astype(jnp.float32), kernel)
        scores = jax.nn.softmax(logits) if self.router == 'softmax' else jax.nn.sigmoid(logits)
        bias = jax.lax.stop_gradient(self.router_bias[...].astype(jnp.float32))
        chosen = checkpoint_name(jax.lax.top_k(scores + bias, self.top_k)[1], 'moe_route')
        weights = jnp.take_along_axis(scores, chosen, axis=-1)
        if self.norm_top_k:
            weights = weights / weights.sum(-1, keepdims=True)
        return logits, scores, chosen, weights * self.routed_scale

    def kept(self, chosen):
        """(batch, seq, top_k) bool: the choices within their expert's capacity (all of them
        when dropless). Each sequence competes alone: its choices queue at their experts first
        choices first, then second ones, each in token order: under context parallelism the
        sequence is held in the chunk order (parallel/context.py), so the queue is formed in
        the sequence's own order and the answer put back, and every layout drops the same
        choices. The one-hot here is (tokens x experts) of int32, no hidden dimension."""
        if not self.capacity_factor:
            return jnp.ones(chosen.shape, bool)
        chosen = gather(chosen, ('batch', 'seq', None), 1)  # the whole sequence (manual)
        b, s, k = chosen.shape
        context = shards('seq')
        order = context_lib.chunk_order(s, context)
        if context > 1:
            chosen = chosen[:, np.argsort(order)]  # in sequence order
        capacity = self.slots(s)
        queue = jax.nn.one_hot(chosen.transpose(0, 2, 1).reshape(b, k * s), self.experts)
        queue = queue.astype(jnp.int32)
        place = ((jnp.cumsum(queue, axis=1) - 1) * queue).sum(-1)  # within its expert's queue
        keep = (place < capacity).reshape(b, k, s).transpose(0, 2, 1)
        return own(keep[:, order], 'seq', 1) if context > 1 else keep

    def dispatch(self, x, chosen, weights, keep):
        """The routed experts' output (batch, seq, embed): the (token, choice) rows sorted by
        expert, the dropped past the last, through the grouped matmuls and back."""
        b, s, embed = x.shape
        k = self.top_k
        ids = jnp.where(keep, chosen, self.experts).reshape(-1)
        order = checkpoint_name(jnp.argsort(ids, stable=True), 'moe_route')  # no second sort
        group_sizes = jnp.bincount(ids, length=self.experts + 1)[:-1].astype(jnp.int32)
        rows = x.reshape(b * s, embed)[order // k]
        out = self.grouped_mlp(rows, group_sizes)
        back = jnp.zeros_like(order).at[order].set(jnp.arange(order.size))  # order's inverse
        out = out[back].reshape(b, s, k, embed)
        return jnp.einsum('bske,bsk->bse', out, weights.astype(out.dtype))

    def slots(self, seq):
        """Each expert's slots in a sequence of `seq` tokens under capacity_factor."""
        return math.ceil(self.capacity_factor * seq * self.top_k / self.experts)

    def held_slots(self, held):
        """slots() of the whole sequences of which `held` tokens each are here: where
        'context' is manual a rank's places can hold all of an expert's slots (never more
        than its own tokens)."""
        parts = shards('seq', manual=True)
        return self.slots(held) if parts == 1 else min(self.slots(held * parts), held)

    def grouped_mlp(self, rows, group_sizes, kernels=None, axes=()):
        """The experts' MLP on rows (n, embed) sorted by expert, group g of group_sizes[g]
        rows through expert g (kernels, axes: expert_mlp's); rows past the groups come out 0."""
        if self.grouped == 'ragged':
            return self.expert_mlp(
                rows, lambda a, w: jax.lax.ragged_dot(a, w, group_sizes, precision=None), kernels,
                axes,
            )  # fmt: skip
        # the kernel has no tensor-parallel form yet: split experts take the batched path
        # (folded, each expert is whole whatever the rule table splits expert_mlp over), as
        # do widths its tiles do not divide (tiny_moe's 88)
        kernel = self.grouped == 'pallas' and (self.fold or shards('expert_mlp') == 1)
        kernel = kernel and grouped_matmul.takes(*(kernels or self.kernels())[0].shape[-2:])
        tile = block_rows(rows.shape[0], self.experts, kernel)
        layout = grouped_matmul.tile_layout(group_sizes, rows.shape[0], tile)
        if kernel:
            matmul = functools.partial(grouped_matmul.grouped_matmul, layout=layout)
        else:

            def matmul(a, w):  # the tiles' batched matmul, each with its expert's weights
                tiles = a.reshape(-1, tile, a.shape[-1])
                out = jnp.einsum('nbe,nef->nbf', tiles, w[layout.tile_expert])
                return out.reshape(-1, w.shape[-1])

        out = self.expert_mlp(grouped_matmul.to_tiles(rows, layout), matmul, kernels, axes)
        return grouped_matmul.from_tiles(out, layout)

    def kernels(self):
        """The experts' weights in the compute dtype: (in, out), or (in, out, gate) SwiGLU."""
        kernels = (self.in_kernel, self.out_kernel) + ((self.gate_kernel,) if self.swiglu else ())
        return tuple(use(kernel, self.dtype) for kernel in kernels)

    def expert_mlp(self, rows, matmul, kernels=None, axes=()):
        """The block's MLP kind through matmul(rows, expert weights): GeLU, or SwiGLU.
        kernels: kernels()'s form (default: this module's). Under model.fp8 each matmul on
        FP8 values (model/fp8_experts.py), its scales the max over `axes`, the manual mesh
        axes an exchange sent the rows over."""
        kernels = self.kernels() if kernels is None else kernels
        if self.fp8 is not None:
            matmul = fp8_experts.quantized(matmul, *self.fp8, axes=axes)

        def up(kernel):
            return checkpoint_name(matmul(rows, kernel), 'moe_in')

        h = up(kernels[0])
        h = jax.nn.silu(up(kernels[2])) * h if self.swiglu else jax.nn.gelu(h, True)
        return checkpoint_name(matmul(h, kernels[1]), 'moe_out')

    def values(self, logits, scores, chosen, keep, layer):
        """The side values of this layer (the module docstring). Where 'context' is manual
        (each rank holds its own places of every sequence) the load-balancing loss is of the
        whole sequences' counts and mean scores, 1 / context of it on each rank: the step
        sums the side values over 'context' (the transpose of the sum sums its gradient)."""
        b, s, k = chosen.shape
        counts = jax.nn.one_hot(chosen, self.experts, dtype=jnp.float32).sum(2).sum(1)  # (b, X)
        probability = (scores / scores.sum(-1, keepdims=True)).mean(1)  # (b, X)
        parts = shards('seq', manual=True)  # the places held here: s of s x parts
        if parts > 1:
            probability = total(probability, 'seq') / parts
        fraction = total(counts, 'seq') / (s * parts * k)
        aux = self.experts * (fraction * probability).sum() * s
        z = jnp.square(jax.nn.logsumexp(logits, axis=-1)).sum()
        row = jax.nn.one_hot(layer, self.num_layers, dtype=jnp.float32)
        return {
            AUX_LOSS: self.aux_loss_coeff * aux,
            Z_LOSS: self.z_loss_coeff * z,
            LOADS: row[:, None] * counts.sum(0)[None, :],
            DROPPED: (~keep).sum().astype(jnp.float32),
        }


def block_rows(rows, experts, kernel=False):
    """The grouped matmul's tile: the largest power of two with experts x tile within
    1/PADDING_SHARE of the rows, at most BLOCK_MAX; the Pallas kernel's at least Triton's
    smallest matmul side."""
    block = 1
    while block * 2 <= BLOCK_MAX and experts * block * 2 * PADDING_SHARE <= rows:
        block *= 2
    return max(block, grouped_matmul.SMALLEST) if kernel else block
