"""A predicted step time: what each device computes at an achieved fraction of its peak, the
communication it waits for, the pipeline's bubble from the engine's own table, the optimizer.

One forward of one layer, on one device (b sequences of s tokens, hidden h, MLP f, heads a,
tensor t, compute dtype of e bytes):

    matmuls     2 b s h (4 h + 2 f) / t FLOPs at peak x matmul(h / t); with model.fp8 the
                block's FP8 sites (counts.fp8_matmul_params: all but a mixture of experts'
                router, and its routed experts but in the padded exchange's GEMMs) at the
                FP8 peak where the GPU has one, forward and both gradients (blockwise: none,
                its GEMMs in the compute dtype: model/fp8.py)
    attention   4 b s^2 h / t FLOPs (Q K^T and the weighted sum, the whole square) at
                peak x matmul(h / a), and its softmax, mask and dropout: (6 e + 1) a b s^2 / t
                bytes of memory traffic, none where our engine runs a fused kernel on this
                GPU (model/attention_kernel.py: the scores stay on chip); where that
                kernel is the Pallas flash kernel, the score blocks it computes (the causal
                triangle, forward 2 matmuls, backward 7: flash_attention_flops), and
                selective recompute reruns none of it (its out and log-sum-exp are kept;
                cuDNN's out and softmax statistics likewise)
    context     context parallelism over c ranks: every sequence-long term above is s / c
                tokens of queries (their keys still s), and the keys' and values' all-gather
                over 'context' (b s 2 kv_heads d / t, ring bytes over the network) is waited
                for forward and where the backward recomputes, their gradients'
                reduce-scatter backward; the gradients' sum over 'context' is ZeRO-1's
                reduce-scatter over the replicas and 'context', once a step (plan/comm.py)
    elementwise layer norms, bias + dropout + residual adds: (10 e + 2) b s h bytes, split
                over t with sequence parallelism; bias + GeLU: 2 e b s f / t
    tensor      2 all-reduces of the (b, s, h) activation (sequence parallelism: 2
                reduce-scatters + 2 all-gathers, the same bytes), ring bytes over NVLink
                (inside a node) or the network, waited for (the documented exposure rule:
                each layer needs its own sum; a GPU compile's overlap table may say otherwise)

    experts    a mixture of experts (model/moe.py): the matmuls above count the active weights
                (the router, the shared experts, top_k routed experts: model/counts.py); over
                mesh.expert x > 1 the exchange's buffers are fixed, so every rank multiplies
                its experts' whole buffers whatever the load: the routed experts' matmuls
                run on padding x their active rows (arithmetic.expert_padding: X / k
                dropless, about the capacity factor else), and 2 all-to-alls of those
                buffers, (b s k padding, h) rows of which (x - 1) / x leave the device, are
                waited for as the tensor collectives are (plan/comm.py); at x = 1 every
                expert runs on every device one after another, its chosen rows only, and
                the spread of the load costs nothing. Folded (model.moe.fold_tensor): the
                exchange spans x t ranks, each tensor rank sends 1/t of the rows, and the
                experts' tensor collectives are a dense MLP's. Where the routed experts run
                the Pallas grouped kernel (one exchange rank at tensor 1, or the ragged
                exchange: arithmetic.grouped_kernel), their matmuls take 1 /
                GROUPED_MATMUL_SPEED of a dense matmul's time (measured on an H200)

    matmul(w) = matmul_efficiency x w / (w + matmul_knee): wide matmuls reach a fixed
                fraction of peak, narrow ones (a small width per device after the tensor
                split, a small head dimension) less; elementwise work moves bytes at
                memory_efficiency x HBM bandwidth, collectives at link_efficiency x link.

A backward costs twice a forward's computation and the same collectives. What a backward
recomputes depends on the engine that runs it (`semantics`):

    megatron    Megatron-LM and DeepSpeed (the published runs): remat full recomputes the
                forward, selective the attention core, none nothing
    ours        parallel/pipeline.py's 1F1B engine: a backward applies the VJP its forward
                kept, so it recomputes what model.remat says, as megatron; the last chunk's
                forward tick is empty (its backward's tick runs the forward, the head and
                the loss); bf16 gradients are added to the fp32 accumulators after every
                backward. Without a pipeline, ours is megatron's (jax.checkpoint per layer),
                plus the accumulation.

The step: the engine's schedule table (parallel/schedule.py) says which stage runs which
slot on each tick; a tick takes its slowest stage, plus the hand-off to the next stage (split
over tensor, over the network). Then, once per step and exposed (train/step.py runs them
after the last micro-batch): the reduce-scatter and all-gather of ZeRO-1 over each
parameter's replica axes (data x expert; a mixture of experts' routed experts: data) and
the stage all-reduce of the shared parameters (bytes as plan/comm.py counts them), and the
Adam update (30 bytes a parameter of the ZeRO shard).

The four efficiency figures of a GPU type are fitted on Narayanan et al. 2021's table 1
(plan/published.py; `fit`), nothing else.
"""

import dataclasses
import types

import numpy as np

from mtnlg_jax import config as config_lib
from mtnlg_jax.model import attention_kernel, counts, flash_attention
from mtnlg_jax.model.layers import attention_dims
from mtnlg_jax.model.moe import experts_of
from mtnlg_jax.parallel import engine as engine_lib
from mtnlg_jax.plan import arithmetic, comm
from mtnlg_jax.plan.arithmetic import itemsize
from mtnlg_jax.parallel.schedule import IDLE

# Our Pallas grouped matmul's active TFLOP/s over a capacity-padded batched einsum's (cuBLAS)
# at the same work, forward and both gradients: 140.0 against 237.3 at 64 experts (129.4 /
# 229.9 = 0.56 at 128) on an H200 (bench/gpu_check.py's grouped_matmul, docs/benchmarks.md
# "The first GPU check"); no other GPU measured, so every cluster's prediction uses it.
GROUPED_MATMUL_SPEED = 0.59
ADAM_BYTES_PER_PARAM = 30  # read fp32 master, m, v, gradient; write master, m, v; write e copy


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of a GPU's figures (see the module docstring)."""

    matmul_efficiency: float
    matmul_knee: float
    memory_efficiency: float
    link_efficiency: float
    source: str

    def as_array(self):
        return np.array(
            [self.matmul_efficiency, self.matmul_knee, self.memory_efficiency,
             self.link_efficiency]
        )  # fmt: skip


# Fitted by `fit(published.TABLE_1, clusters.CLUSTERS['a100-80gb'])`: tests/test_predict.py
# refits and compares. Table 1 pins one figure down, matmuls at 66.3 % of peak; the other
# three settle on their bounds (no width penalty down to 768 per device, the spec's HBM and
# link bandwidths): once attention, elementwise traffic and collectives are counted at the
# hardware's own speed, table 1 has nothing left to charge to them (its small models ran
# faster, not slower, than those counts). From two starting points the fit lands on the
# same values. No H100 or H200 step time is fitted: h100-80gb and h200-141gb reuse the A100's
# fractions of their own, higher, peak and bandwidths (an assumption, printed with every
# such prediction).
A100_FIT = 'fitted on Narayanan et al. 2021 (arXiv 2104.04473) table 1, A100 80 GB'
A100 = Efficiency(0.6632, 0.0, 1.0, 1.0, A100_FIT)
FIGURES = {
    'a100-80gb': A100,
    'h100-80gb': dataclasses.replace(A100, source='the A100 fit reused: no H100 row is fitted'),
    'h200-141gb': dataclasses.replace(A100, source='the A100 fit reused: no H200 row is fitted'),
}


def _ring(kind, size, group):
    if group <= 1:
        return 0.0
    return (2.0 if kind == 'all-reduce' else 1.0) * (group - 1) / group * size


def kernel_on(model_cfg, cluster, context=1, documents=False):
    """The attention kernel model/attention_kernel.py picks on `cluster`'s GPUs with each
    sequence over `context` ranks, over packed documents masked apart if `documents`; 'plain'
    on the CPU (cluster None)."""
    if cluster is None:
        return 'plain'
    gpu = types.SimpleNamespace(platform='gpu', compute_capability=cluster.compute_capability)
    return attention_kernel.attention_kernel(model_cfg, gpu, context, documents)


def fused_attention(model_cfg, cluster, context=1):
    """Whether attention runs a fused kernel (cuDNN, the flash kernel: the scores stay on
    chip) on `cluster`'s GPUs (kernel_on)."""
    return kernel_on(model_cfg, cluster, context) != 'plain'


def flash_attention_flops(config, generation):
    """(forward, backward) FLOPs of the Pallas flash kernels for one layer and micro-batch on
    one device: the score blocks they compute (flash_attention.score_area: the causal
    triangle, its diagonal tiles whole; under context parallelism each of a rank's two query
    chunks against the keys up to it) times their matmuls (forward 2; backward 7, the scores
    recomputed in both of its kernels), as the compiled step's count has them."""
    model, t, c = config.model, config.mesh.tensor, config.mesh.get('context', 1)
    s, (_, _, head_dim) = model.seq_len, attention_dims(model)
    queries = s // (2 * c) if c > 1 else s
    chosen = flash_attention.blocks(queries, head_dim, generation)
    per_head = 2 * config.train.micro_batch * model.heads / t * flash_attention.lane_width(head_dim)
    calls = 2 if c > 1 else 1
    area = [
        calls * flash_attention.score_area(queries, s, b)
        for b in (chosen.forward_q, chosen.backward)
    ]
    matmuls = flash_attention.KERNEL_MATMULS
    backward = matmuls[flash_attention.KEY_VALUE] + matmuls[flash_attention.QUERY]
    return per_head * area[0] * matmuls[flash_attention.FORWARD], per_head * area[1] * backward


class _Rates:
    """Seconds of a matmul, of memory traffic, and of a transfer, on one device."""

    def __init__(self, cluster, figures, dtype):
        self.peak = cluster.peak_tflops[dtype] * 1e12
        # FP8 by FP8 at the GPU's FP8 peak where it has FP8 tensor cores (as the replay's
        # plan/overlap.py prices them), else at the compute dtype's
        self.fp8_peak = cluster.peak_tflops.get('float8', 0.0) * 1e12 or self.peak
        self.figures = figures
        self.memory = cluster.hbm_bandwidth * figures.memory_efficiency
        self.cluster = cluster

    def matmul(self, flops, width, fp8=False):
        f = self.figures
        peak = self.fp8_peak if fp8 else self.peak
        return flops / (peak * f.matmul_efficiency * width / (width + f.matmul_knee))

    def bytes(self, size):
        return size / self.memory

    def link(self, size, group):
        inside = group <= self.cluster.gpus_per_node
        bandwidth = self.cluster.nvlink_bandwidth if inside else self.cluster.internode_bandwidth
        return size / (bandwidth * self.figures.link_efficiency)


def layer_forward(
    config, rates, exposed, fused_attention=False, exposed_experts=1.0, exposed_context=(1, 1),
    flash=False,
):  # fmt: skip
    """One layer's forward on one device (module docstring): seconds of its computation, of
    its attention core alone forward and backward (with `flash`, the Pallas flash kernels'
    score blocks: flash_attention_flops; else the whole square, the backward twice the
    forward), of the tensor collectives waited for (`exposed` of them), of a
    mixture of experts' all-to-alls waited for (`exposed_experts` of them), of the keys' and
    values' all-gather over 'context' and of their gradients' reduce-scatter (the backward's)
    waited for (`exposed_context`: (all-gather, reduce-scatter) shares), and the FLOPs of all
    of it and of the attention core. Under context parallelism a device holds s / c tokens of
    each sequence, whose queries see all s keys."""
    model, t, c = config.model, config.mesh.tensor, config.mesh.get('context', 1)
    padding = arithmetic.expert_padding(config)
    b, s, h = config.train.micro_batch, model.seq_len, model.hidden
    f = arithmetic.mlp_width(model, padding=padding)
    a, e = model.heads, itemsize(model.compute_dtype)
    _, kv_heads, head_dim = attention_dims(model)
    tokens = b * s // c  # of a micro-batch, on one device
    split = t if model.sequence_parallel else 1
    matmul_flops = 2 * tokens * counts.layer_matmul_params(model) / t
    group = arithmetic.exchange_ranks(config)
    padded = group > 1 and model.get('moe', {}).get('exchange', 'padded') == 'padded'
    fp8_flops = 2 * tokens * counts.fp8_matmul_params(model, padded) / t  # 0 without FP8
    if model.get('fp8', 'none') == 'blockwise':  # on FP8's grid, at the compute dtype's rate
        fp8_flops = 0.0
    experts = 0.0
    if experts_of(model) and group > 1:
        routed = 2 * tokens * model.moe.top_k * counts.expert_params(model) / t
        matmul_flops += routed * (padding - 1)  # the buffers' rows past the choices
        rows = tokens * model.moe.top_k * padding / (t if arithmetic.folded(config) else 1)
        sent = rows * h * e * (group - 1) / group
        # an expert group's ranks lie context x tensor devices apart (parallel/mesh.py): it
        # stays in a node only if all of that span does
        span = group * c * (1 if arithmetic.folded(config) else t)
        experts = 2 * rates.link(sent, span) * exposed_experts
    attention_flops = 4 * tokens * s * a * head_dim / t
    backward_flops = 2 * attention_flops
    if flash:
        generation = int(rates.cluster.compute_capability.split('.')[0])
        attention_flops, backward_flops = flash_attention_flops(config, generation)
    scores_bytes = 0.0 if fused_attention else (6 * e + 1) * a * tokens * s / t
    attention = rates.matmul(attention_flops, head_dim) + rates.bytes(scores_bytes)
    attention_backward = rates.matmul(backward_flops, head_dim) + 2 * rates.bytes(scores_bytes)
    mlp_tensors = counts.mlp_matrices(model)  # (s, b, f) tensors read and written: 2 or 3
    elementwise = rates.bytes((10 * e + 2) * tokens * h / split + mlp_tensors * e * tokens * f / t)
    gathered = rates.link(_ring('all-gather', b * s * 2 * kv_heads * head_dim * e / t, c), c * t)
    width = min(tokens, h / t)
    fp8 = rates.matmul(fp8_flops, width, fp8=True)
    matmuls = rates.matmul(matmul_flops - fp8_flops, width) + fp8
    if arithmetic.grouped_kernel(config):  # the routed experts' rows at the kernel's speed
        routed = 2 * tokens * model.moe.top_k * counts.expert_params(model) * padding / t
        matmuls += rates.matmul(routed, width) * (1 / GROUPED_MATMUL_SPEED - 1)
    collective = rates.link(_ring('all-reduce', tokens * h * e, t), t) * exposed
    again_flops, again_sums = _recomputed_products(model, tokens, t, f)
    return dict(
        compute=matmuls + attention + elementwise,
        attention=attention,
        attention_backward=attention_backward,
        tensor=(
            1
            + (sum(comm.exchanged_rows(config)) or 1)
            + arithmetic.folded(config) * comm.exchanged_rows(config)[1]
        )  # attention's, MLP's or experts' (+ shared's folded)
        * collective,
        recomputed=rates.matmul(again_flops, width) + again_sums * collective,
        recomputed_flops=again_flops,
        expert=experts,
        context=gathered * exposed_context[0],
        context_backward=gathered * exposed_context[1],
        flops=matmul_flops + attention_flops,
        attention_flops=attention_flops,
        attention_backward_flops=backward_flops,
    )


def _recomputed_products(model, tokens, t, f):
    """(FLOPs, row-parallel sums) that model.remat_recompute's names add to a layer's
    backward under selective recompute, on one device: the named matmuls run again, and a
    row-parallel one's tensor sum with it ('context', the attention core, is not a product
    here: a fused kernel keeps its output whatever the name says)."""
    dropped = config_lib.recomputed(model)
    heads, kv_heads, head_dim = attention_dims(model)
    h = model.hidden
    widths = dict(
        qkv=h * (heads + 2 * kv_heads) * head_dim,
        attn_out=heads * head_dim * h,
        mlp_in=h * f,  # GeLU's; SwiGLU's gate and up are named apart (config.recomputed)
        mlp_gate=h * f,
        mlp_up=h * f,
        mlp_out=f * h,
    )
    flops = sum(2 * tokens * widths[n] / t for n in dropped if n in widths)
    return flops, sum(n in ('attn_out', 'mlp_out') for n in dropped)


def head_forward(config, rates):
    """(seconds, FLOPs) of the output layer and loss on one device: the logits matmul and the
    fp32 softmax cross-entropy over the vocabulary shard (a context rank's own tokens)."""
    model, t = config.model, config.mesh.tensor
    rows = config.train.micro_batch * model.seq_len // config.mesh.get('context', 1)
    vocab = model.padded_vocab / t
    flops = 2 * rows * model.hidden * vocab
    seconds = rates.matmul(flops, min(rows, model.hidden)) + rates.bytes(
        (8 + itemsize(model.compute_dtype)) * rows * vocab
    )
    return seconds, flops


COMPONENTS = ('compute', 'recompute', 'tensor', 'expert', 'context', 'accumulate', 'flops')


def slot_costs(
    config, rates, semantics, exposed, accumulate, exposed_experts=1.0, exposed_context=(1, 1)
):  # fmt: skip
    """(forward, backward): {component: [middle chunk, last chunk]} of one slot, seconds (and
    FLOPs). Components: compute, recompute, tensor (collectives waited for), expert (a
    mixture of experts' all-to-alls waited for), context (the keys' and values' gathers over
    'context' and their gradients' reduce-scatters waited for; the backward gathers again
    where it recomputes), accumulate (the backward's gradients added to the fp32
    accumulators: `accumulate` seconds), flops."""
    kernel = 'plain'
    if semantics == 'ours':
        documents = config.data.get('reset_attention_mask', False)
        kernel = kernel_on(config.model, rates.cluster, config.mesh.context, documents)
    flash = kernel.startswith('flash')
    layer = layer_forward(
        config, rates, exposed, kernel != 'plain', exposed_experts, exposed_context, flash
    )
    n = arithmetic.chunk_slots(config)
    # selective recompute keeps a fused kernel's outputs: the flash kernel's out and
    # log-sum-exp (model/flash_attention.py), cuDNN's out and softmax statistics (gpt.py's
    # remat_policy); folded, a mixture of experts' exchanged rows (model/moe_exchange.py)
    kept = kernel != 'plain' and config.model.remat == 'selective'
    exchanged_again = 0.0 if arithmetic.folded(config) else layer['expert']
    again, again_flops = {
        'full': (layer['compute'] + layer['tensor'] + layer['expert'], layer['flops']),
        # selective: the attention core (unless a fused kernel's outputs are kept), and a
        # mixture of experts' two exchanges unless folded (plan/comm.py)
        'selective': (
            (0.0 if kept else layer['attention']) + exchanged_again + layer['recomputed'],
            (0.0 if kept else layer['attention_flops']) + layer['recomputed_flops'],
        ),
        'none': (0.0, 0.0),
    }[config.model.remat]
    # the backward's attention beyond twice the forward's (the flash kernels' 7 matmuls to 2)
    extra = {
        k: n * (layer[f'attention_backward{x}'] - 2 * layer[f'attention{x}'])
        for k, x in (('compute', ''), ('flops', '_flops'))
    }
    head, head_flops = head_forward(config, rates)
    run = {k: n * layer[k] for k in ('compute', 'tensor', 'expert', 'context', 'flops')}
    forward = dict(run, recompute=0.0, accumulate=0.0)
    gathers_again = run['context'] if config.model.remat != 'none' else 0.0
    backward = dict(
        compute=2 * run['compute'] + extra['compute'],
        tensor=run['tensor'],
        expert=run['expert'],
        context=n * layer['context_backward'] + gathers_again,
        recompute=n * again,
        accumulate=accumulate,
        flops=2 * run['flops'] + extra['flops'] + n * again_flops,
    )
    last_forward = dict(forward, compute=forward['compute'] + head, flops=run['flops'] + head_flops)
    last_backward = dict(
        backward, compute=backward['compute'] + 2 * head, flops=backward['flops'] + 2 * head_flops
    )
    if semantics == 'ours' and engine_lib.engine(config).pipelined:
        # The last chunk's forward tick is empty: its backward's tick runs it (and the head).
        last_backward = {k: last_backward[k] + last_forward[k] for k in COMPONENTS}
        last_forward = dict.fromkeys(COMPONENTS, 0.0)
    return (
        {k: [forward[k], last_forward[k]] for k in COMPONENTS},
        {k: [backward[k], last_backward[k]] for k in COMPONENTS},
    )


def _weight_gradient(forward, component):
    """A W slot's share of the backward (zero-bubble schedules): dW = x^T dy, the forward's
    matmuls once more and nothing else (no recompute: B recomputes where remat is on, so a
    full-recompute backward is B 2 forwards and W 1; no collectives: the weight gradients
    reduce with ZeRO-1's after the loop)."""
    return forward[component][0] if component in ('compute', 'flops') else 0.0


def _timeline(config, forward, backward, handoff):
    """{component: seconds of the busiest stage}, the step's pipeline seconds and the FLOPs a
    device runs (mean over stages), from the schedule table: a tick takes its slowest stage
    plus the hand-off. Without a pipeline: m micro-batches one after another."""
    micro = config.train.micro_steps
    engine = engine_lib.engine(config)
    table = engine.table(micro)
    if table is None:
        repeats = config.pipeline.repeats
        if not engine.pipelined:  # every chunk on the one stage, the last with the head
            work = {
                k: micro * ((repeats - 1) * (forward[k][0] + backward[k][0]) + forward[k][1]
                            + backward[k][1])
                for k in COMPONENTS
            }  # fmt: skip
            return work, sum(v for k, v in work.items() if k != 'flops'), work['flops']
        # GPipe's circular scan: v m + p - 1 iterations of a chunk's forward and backward.
        iterations = engine.ticks(micro)
        work = {k: micro * repeats * (forward[k][0] + backward[k][0]) for k in COMPONENTS}
        per = sum(forward[k][1] + backward[k][1] for k in COMPONENTS if k != 'flops')
        return work, iterations * per + iterations * 2 * handoff, work['flops']
    stage = np.arange(table.stages)[None, :]
    last = stage == table.last_stage  # the head's (stage 0 in zbv's V)
    fwd_last = (table.fwd_repeat == table.repeats - 1) & last
    bwd_last = (table.bwd_repeat == table.repeats - 1) & last
    fwd_busy, bwd_busy = table.fwd_micro != IDLE, table.bwd_micro != IDLE
    if table.split:  # B and W slots (zero_bubble.py)
        w_last = (table.w_repeat == table.repeats - 1) & last
        bwd_busy = np.stack([bwd_busy, table.w_micro != IDLE])
        bwd_last = np.stack([bwd_last, w_last])
    per_stage, tick = {}, 0.0
    for k in COMPONENTS:
        cost = np.where(fwd_last, forward[k][1], forward[k][0]) * fwd_busy
        if table.split:
            weights = _weight_gradient(forward, k)  # W's; B the rest of the backward
            middle = np.array([backward[k][0] - weights, weights])[:, None, None]
            lasts = np.array([backward[k][1] - weights, weights])[:, None, None]
            backward_cost = (np.where(bwd_last, lasts, middle) * bwd_busy).sum(axis=0)
        else:
            backward_cost = np.where(bwd_last, backward[k][1], backward[k][0]) * bwd_busy
        cost = cost + backward_cost
        per_stage[k] = cost.sum(axis=0)
        if k != 'flops':
            tick = tick + cost
    busiest = int(np.argmax(sum(per_stage[k] for k in COMPONENTS if k != 'flops')))
    work = {k: float(per_stage[k][busiest]) for k in COMPONENTS}
    step = float((tick.max(axis=1) + handoff).sum())
    return work, step, float(per_stage['flops'].mean())


def traffic(config):
    """What the per-step terms need and costs a few milliseconds to count (the search
    caches it per mesh): compute-copy and ZeRO-shard parameters per device, and plan/comm.py's
    bytes per device per step."""
    compute, zero = arithmetic.local_param_counts(config)
    return dict(compute=compute, zero=zero, comm=comm.comm_bytes_per_device(config))


def step_time(
    config, cluster, figures=None, semantics='ours', overlap=None, counts=None, host_s=0.0
):
    """The predicted step of a resolved config on `cluster` (clusters.Cluster), as a dict of
    seconds (predicted_step_s and its parts), TFLOP/s per GPU (executed, and the model's)
    and MFU.

    figures: an Efficiency (default: FIGURES[cluster.name]); semantics: 'ours' or
    'megatron' (module docstring); overlap: {(kind, axis): share of its bytes hidden behind
    computation}, from a GPU compile's overlap table (default: the documented rule, nothing
    hidden); counts: `traffic(config)`, when the caller has it; host_s: what the step waits
    for its transfers to and from host memory (model.remat_offload), from a GPU compile's
    replay (the analytic parts have no term for them)."""
    figures = figures or FIGURES[cluster.name]
    overlap = overlap or {}
    counts = counts or traffic(config)
    rates = _Rates(cluster, figures, config.model.compute_dtype)
    model, mesh, train = config.model, config.mesh, config.train
    e = itemsize(model.compute_dtype)

    def exposed(kind, axis):
        return 1.0 - overlap.get((kind, axis), 0.0)

    tensor_kind = 'reduce-scatter' if model.sequence_parallel else 'all-reduce'
    accumulate = 0.0
    if semantics == 'ours':  # bf16 gradients read, fp32 accumulators read and written
        accumulate = rates.bytes((e + 8) * counts['compute'] / config.pipeline.repeats)
    forward, backward = slot_costs(
        config,
        rates,
        semantics,
        exposed(tensor_kind, 'tensor'),
        accumulate,
        exposed(comm.exchange_kind(config), comm.axes_key(config, comm.exchange_axes(config))),
        (exposed('all-gather', 'context'), exposed('reduce-scatter', 'context')),
    )
    handoff = 0.0
    context = mesh.get('context', 1)
    replica = mesh.stage * context * mesh.tensor
    engine = engine_lib.engine(config)
    if engine.pipelined:
        activation = train.micro_batch * model.seq_len // context * model.hidden * e
        split = mesh.tensor if model.seq_len % mesh.tensor == 0 else 1
        table = engine.table(train.micro_steps)
        ways = 2 if table is not None and table.v_shape else 1  # zbv's V: each link twice
        handoff = ways * rates.link(activation / split, replica) + rates.link(
            _ring('all-gather', activation, split), split
        )
        handoff *= exposed('collective-permute', 'stage')
    work, pipeline_s, flops = _timeline(config, forward, backward, handoff)
    devices = mesh.data * mesh.expert * replica  # expert ranks replicate all but the experts

    def per_step(axis, kinds, group):
        return sum(
            rates.link(counts['comm'].get(kind, {}).get(axis, 0.0), group) * exposed(kind, axis)
            for kind in kinds
        )

    data_s = sum(  # ZeRO-1's collectives, over each parameter's replica axes (and context)
        rates.link(size, devices) * exposed(kind, key)
        for kind, key, size in comm.zero_bytes(counts['comm'])
    )
    stage_s = per_step('stage', ('all-reduce', 'reduce-scatter'), replica)  # the tables' too
    optimizer_s = rates.bytes(ADAM_BYTES_PER_PARAM * counts['zero'] + 4 * counts['compute'])
    busy = sum(v for k, v in work.items() if k != 'flops')
    handoffs = pipeline_s - busy if engine.pipelined else 0.0
    table = engine.table(train.micro_steps)
    pipeline_comm_s = handoff * (table.ticks if table is not None else 0)
    total = pipeline_s + data_s + stage_s + optimizer_s + host_s
    peak = cluster.peak_tflops[model.compute_dtype] * 1e12
    model_flops = arithmetic.model_flops_per_step(config) / devices
    return dict(
        predicted_step_s=total,
        compute_s=work['compute'],
        recompute_s=work['recompute'],
        tensor_comm_s=work['tensor'],
        expert_comm_s=work['expert'],
        context_comm_s=work['context'],
        expert_padding=arithmetic.expert_padding(config) if experts_of(model) else None,
        accumulate_s=work['accumulate'],
        pipeline_comm_s=pipeline_comm_s,
        bubble_s=max(handoffs - pipeline_comm_s, 0.0),
        data_comm_s=data_s,
        stage_comm_s=stage_s,
        optimizer_s=optimizer_s,
        host_s=host_s,
        tflops_per_gpu=flops / total / 1e12,  # executed: recompute, padding, a causal triangle
        model_tflops_per_gpu=model_flops / total / 1e12,  # MFU's: 6N + 12LHQT (the whole square)
        mfu=model_flops / total / peak,
        semantics=semantics,
        efficiency=dataclasses.asdict(figures),
    )


def predict_rows(rows, cluster, figures=None):
    """[(row, published seconds, predicted step dict)] of published rows (plan/published.py),
    each predicted as the engine that ran it (semantics 'megatron')."""
    from mtnlg_jax.plan import published  # noqa: PLC0415

    out = []
    for row in rows:
        config = published.config_of(row)
        flops = arithmetic.megatron_flops_per_step(config.model, row.global_batch)
        seconds = published.published_seconds(row, flops)
        out.append((row, seconds, step_time(config, cluster, figures, semantics='megatron')))
    return out


def fit(rows, cluster, start=(0.75, 100.0, 0.7, 0.7)):
    """The Efficiency that best predicts `rows` (least squares of log predicted / published
    step time), by scipy's trust-region least squares within physical bounds."""
    from scipy import optimize  # noqa: PLC0415
    from mtnlg_jax.plan import published  # noqa: PLC0415

    configs = [published.config_of(row) for row in rows]
    counts = [traffic(config) for config in configs]
    targets = [
        published.published_seconds(
            row, arithmetic.megatron_flops_per_step(c.model, row.global_batch)
        )
        for row, c in zip(rows, configs)
    ]

    def residuals(x):
        figures = Efficiency(*x, source='fit')
        return [
            np.log(step_time(c, cluster, figures, 'megatron', counts=n)['predicted_step_s'] / t)
            for c, n, t in zip(configs, counts, targets)
        ]

    result = optimize.least_squares(
        residuals, np.array(start), bounds=([0.2, 0.0, 0.1, 0.1], [1.0, 4000.0, 1.0, 1.0])
    )
    return Efficiency(*[float(x) for x in result.x], source=f'{rows[0].source} (fit)')
