"""Arithmetic of a run: FLOPs and, from a resolved config alone
(shapes and mesh sizes, no devices), bytes per device of state and activations.

FLOPs:
  model FLOPs per token (PaLM, arXiv 2204.02311, for MFU; recompute not counted):
      6 N + 12 L H Q T
  (a mixture of experts: N the active parameters, the router, shared experts and top_k of
  the routed experts a layer: model/counts.py)
  Megatron's hardware FLOPs per step (arXiv 2104.04473) with full recompute:
      96 B s l h^2 (1 + s / (6 h) + V / (16 l h))      (72 instead of 96 without recompute)
"""

import math

import jax
import numpy as np
from flax import nnx

from mtnlg_jax import config as config_lib
from mtnlg_jax.model import counts, gpt
from mtnlg_jax.model.counts import model_flops_per_token
from mtnlg_jax.model.layers import attention_dims
from mtnlg_jax.parallel import engine as engine_lib
from mtnlg_jax.parallel import rules, stage_order


def megatron_flops_per_step(model_cfg, global_batch, recompute=True):
    """Megatron-LM 2021's per-iteration FLOPs (eq. 3), with or without full recompute,
    96 B s l h^2 (1 + s / (6 h) + V / (16 l h)) for GPT-3's block (72 without recompute),
    where 12 h^2 is a layer's matmul weights and h the attention width: in general
    96 B s (l W / 12 + l s H Q / 6 + h V / 16), W = layer_matmul_params (GQA, SwiGLU; the
    dense layers ahead of a mixture of experts with their own W)."""
    tokens = global_batch * model_cfg.seq_len
    layers, h, v = model_cfg.num_layers, model_cfg.hidden, model_cfg.padded_vocab
    width = counts.attention_flops_per_token(model_cfg) / (12 * layers * model_cfg.seq_len)
    moe_layers = config_lib.block_stack_layers(model_cfg)
    weights = moe_layers * counts.layer_matmul_params(model_cfg) + (
        layers - moe_layers
    ) * counts.layer_matmul_params(model_cfg, dense=True)
    per_token = weights / 12 + layers * model_cfg.seq_len * width / 6 + h * v / 16
    return (96 if recompute else 72) * tokens * per_token


# ---------------------------------------------------------------------------------------------
# The planner: everything below needs a resolved config only (mesh sizes, no devices).

GIGA = 1e9


def itemsize(dtype):
    return np.dtype(dtype).itemsize


param_count = counts.param_count  # the model's own count (model/counts.py)


def mesh_sizes(config):
    """{axis: size} of a resolved config's mesh, every axis (rules.MESH_AXES)."""
    return {axis: config.mesh[axis] for axis in rules.MESH_AXES}


def abstract_params(model_cfg):
    """(ShapeDtypeStructs, logical axes) of the parameter tree, nothing allocated."""
    _, params, axes = gpt.split(nnx.eval_shape(lambda: gpt.create(model_cfg, 0)))
    return params, axes


def _local_numel(shape, spec, sizes):
    """Elements of the largest shard of `shape` split by PartitionSpec `spec` over `sizes`."""
    total = 1
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for size, axes in zip(shape, entries):
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        total *= -(-size // math.prod(sizes[a] for a in axes))
    return total


EXPERT_AXIS = 'expert'


def is_routed_expert(names):
    """Whether a parameter of these logical axes is a routed expert's weights (model/moe.py:
    gate, in and out kernels; the router's kernel is not)."""
    return ('experts' in names and 'expert_mlp' in names) or 'folded_experts' in names


def folded(config):
    """Whether a mixture of experts runs folded (model.moe.fold_tensor over tensor > 1):
    its exchange over expert x tensor, each expert whole."""
    model = config.model
    return bool(counts.experts_of(model) and model.moe.fold_tensor and config.mesh.tensor > 1)


def uncounted_expert_copies(config):
    """Whether a mixture of experts runs at one expert rank split over tensor (> 1) unfolded:
    its experts then take model/moe.py's batched path (the grouped-matmul kernel has no
    tensor-parallel form), a gathered copy of each tile's expert weights that this plan does
    not count (Mixtral 8x22B so: 108.1 GiB compiled against 73.9 GiB planned,
    docs/benchmarks.md, "Mixtral 8x22B on 256 H100s"); plan/search.py leaves such layouts out."""
    mesh = config.mesh
    return bool(
        counts.experts_of(config.model) and mesh.expert == 1 and mesh.tensor > 1
        and not folded(config)
    )  # fmt: skip


def exchange_ranks(config):
    """The ranks a mixture of experts' exchange spans: mesh.expert, x mesh.tensor folded."""
    return config.mesh.expert * (config.mesh.tensor if folded(config) else 1)


def grouped_kernel(config):
    """Whether a mixture of experts' routed experts run model/grouped_matmul.py's kernel on a
    GPU (model/moe.py's grouped_mlp): at one exchange rank with each expert's width whole
    (tensor 1), and in the ragged exchange; the padded exchange and a width split over tensor
    run batched einsums (cuBLAS)."""
    model = config.model
    if not counts.experts_of(model):
        return False
    if exchange_ranks(config) > 1:
        return model.moe.get('exchange', 'padded') == 'ragged'
    return config.mesh.tensor == 1


def planned_spec(names):
    """The rule table's PartitionSpec of a parameter, its routed experts split over 'expert'
    by expert (parallel/rules.py maps `experts` to nothing until expert parallelism does; the
    planner splits them already, so a config's mesh.expert divides the expert weights)."""
    spec = list(rules.logical_to_spec(names)) + [None] * len(names)
    spec = spec[: len(names)]
    taken = {a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())}
    if is_routed_expert(names) and EXPERT_AXIS not in taken:
        spec[names.index('experts')] = EXPERT_AXIS
    return jax.sharding.PartitionSpec(*spec)


def local_param_counts(config, routed_experts=None):
    """(compute-copy elements per device, ZeRO-shard elements per device): the rule table's
    split (tensor, stage; routed experts over expert: planned_spec) and, for the fp32 state,
    ZeRO-1's over data (parallel/rules.py). routed_experts True / False: a mixture of
    experts' routed expert weights only / everything else; None: all."""
    params, axes = abstract_params(config.model)
    sizes = mesh_sizes(config)
    compute = zero = 0
    for leaf, names in zip(jax.tree.leaves(params), jax.tree.leaves(axes, is_leaf=_is_axes)):
        if routed_experts is not None and routed_experts != is_routed_expert(names):
            continue
        spec = planned_spec(names)
        compute += _local_numel(leaf.shape, spec, sizes)
        zero += _local_numel(leaf.shape, rules.state_spec(spec, leaf.shape, sizes), sizes)
    return compute, zero


def expert_bytes(config):
    """Bytes per device of a mixture of experts' routed expert weights, split over tensor
    (each expert's width), stage (its layers) and expert (the experts): the compute copy,
    its step's gradients and the fp32 state (state_bytes' parts, experts only; zeros for a
    dense model)."""
    compute, zero = local_param_counts(config, routed_experts=True)
    e = itemsize(config.model.compute_dtype)
    share = engine_lib.engine(config).block_grads_share
    return dict(params=compute * e, grads=compute * (share * e + 4), optimizer=zero * 12)


def local_shared_params(config, joint=None):
    """Compute-copy elements per device of the parameters outside the block stack (embeddings,
    final norm): the ones every pipeline stage holds, whose gradients are summed over stage.
    joint True / False: only those whose ZeRO-1 split is over ('stage', 'data') together /
    the others (rules.state_spec); None: all."""
    params, axes = abstract_params(config.model)
    sizes = mesh_sizes(config)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    total = 0
    for (path, leaf), names in zip(leaves, jax.tree.leaves(axes, is_leaf=_is_axes)):
        if getattr(path[0], 'key', None) == 'blocks':
            continue
        spec = planned_spec(names)
        split = rules.state_spec(spec, leaf.shape, sizes)
        if joint is None or joint == any(rules.is_stage_zero(a) for a in split):
            total += _local_numel(leaf.shape, spec, sizes)
    return total


def local_paired_table(config):
    """Elements a device holds of one of the two tables whose gradients one reduce-scatter
    carries (engine.owned_tables, parallel/zero.py's `pair`), where their ZeRO shards split
    over 'stage' and the replicas; 0 where none do."""
    if engine_lib.owned_tables(config) is None:
        return 0
    params, axes = abstract_params(config.model)
    table, spec = params[engine_lib.TABLES[1]], planned_spec(axes[engine_lib.TABLES[1]])
    sizes = mesh_sizes(config)
    if not any(rules.is_stage_zero(a) for a in rules.state_spec(spec, table.shape, sizes)):
        return 0
    return _local_numel(table.shape, spec, sizes)


def _is_axes(x):
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def state_bytes(config):
    """Bytes per device of the training state, as train/step.py holds it:

    params     compute-dtype copy the forward runs on (split over tensor, stage)
    grads      a micro-step's compute-dtype gradients (the 1F1B / interleaved engine's: one
               chunk's and the shared parameters') + the replica's fp32 accumulators, whole
               (summed locally until the step's reduce-scatter, as Megatron's fp32 gradient
               buffer)
    optimizer  fp32 master weights + Adam's two moments on the ZeRO-1 shard

    At data 1 and bf16 that is the paper's 2 + 2 + 4 + 4 + 4 + 4 = 20 bytes per parameter; at
    data d, 8 + 12 / d."""
    compute, zero = local_param_counts(config)
    e = itemsize(config.model.compute_dtype)
    shared = local_shared_params(config)
    step = (compute - shared) * engine_lib.engine(config).block_grads_share + shared
    return dict(params=compute * e, grads=step * e + compute * 4, optimizer=zero * 12)


def chunk_slots(config):
    """Layer slots a pipeline chunk holds and runs through: L / (p v), or with stages of
    unequal depth the largest chunk's layers (a shorter chunk's padding slots take their
    memory, parallel/stage_order.py; the slowest stage sets the pace)."""
    return stage_order.of_config(config).slots


def engine_table(config, micro_steps=None):
    """The 1F1B engine's schedule table of a config (parallel/schedule.py); None for the
    engines without one (no pipeline, GPipe's scan)."""
    return engine_lib.engine(config).table(micro_steps or config.train.micro_steps)


def expert_padding(config):
    """Rows a mixture of experts' routed experts multiply, and its all-to-alls carry, per
    (token, choice) row (model/moe.py; folded, each tensor rank sends its 1/t share of
    every expert's slots: the same ratio). Under expert parallelism (mesh.expert > 1) the
    exchange's buffers are fixed: each expert takes C rows from every rank, C = b x its
    slots in a sequence, ceil(factor s k / X), under a capacity factor, b s (every row a rank
    holds) dropless, so X C rows stand for b s k choices: X / k dropless, about the capacity
    factor else. 1 at one expert rank (the grouped matmul's rows are the choices, its tiles'
    padding aside) and for a dense model."""
    model = config.model
    if not counts.experts_of(model) or exchange_ranks(config) <= 1:
        return 1.0
    moe, s = model.moe, model.seq_len
    slots = math.ceil(moe.capacity_factor * s * moe.top_k / moe.experts)
    return moe.experts * (slots if moe.capacity_factor else s) / (s * moe.top_k)


def mlp_width(model_cfg, dense=False, padding=1.0):
    """The MLP width one token's activations have: model.ffn_hidden (a dense model's, or
    dense: a dense layer's ahead of the experts); a mixture of experts' top_k routed experts'
    (x `padding`, expert_padding) and the shared experts' (the grouped matmuls' rows are the
    token's k choices; the router's logits and the dispatch's index arrays are not counted)."""
    if dense or not counts.experts_of(model_cfg):
        return model_cfg.ffn_hidden
    routed = model_cfg.moe.top_k * config_lib.moe_ffn_hidden(model_cfg) * padding
    return routed + config_lib.shared_ffn_hidden(model_cfg)


def expert_rows_width(model_cfg, padding=1.0, dense=False):
    """Elements a token's choices keep of (rows, hidden) shape in a mixture of experts (0 for
    a dense model or layer): k x `padding` rows of the hidden width, whole over tensor."""
    if dense or not counts.experts_of(model_cfg):
        return 0
    return model_cfg.moe.top_k * padding * model_cfg.hidden


def layer_activation_bytes(
    model_cfg, rows, tensor, remat, fused_attention=False, context=1, dense=False, padding=1.0,
    fold=False,
):  # fmt: skip
    """Bytes one layer keeps for its backward pass, per micro-batch of `rows` sequences.
    fused_attention: a fused kernel (cuDNN, the flash kernel) keeps its fp32 log-sum-exp
    where the plain path keeps the (seq x seq) scores and probabilities. context: ranks of
    context parallelism, each holding s / c of every sequence: its scores are (s / c) x s,
    and a layer kept whole also keeps the keys and values gathered over 'context' (s, b,
    2 kv_heads d / t). dense: a dense layer ahead of a mixture of experts. padding: a mixture
    of experts' rows per choice (expert_padding); fold: folded (each tensor rank its 1/t of
    the rows, of whole experts' width).

    A mixture of experts keeps, beyond its MLP's width (mlp_width: k x padding rows of the
    experts' widths), the experts' outputs (model/moe.py's `moe_out`: k x padding rows of
    (hidden) a token, whole over tensor) under selective and none; under none also their
    inputs (the rows gathered, or received by the all-to-all, in expert order). Folded,
    selective keeps the rows both all-to-alls deliver (1/t of them a tensor rank) in place of
    the experts' outputs: the all-to-all back is linear and the combine's backward reads what
    it delivered, so `moe_out` is no residual (Qwen3-235B-A22B folded on 512 H100s, XLA:GPU's
    live ranges at the step's peak: the residual slots hold 57,856 bytes a token a layer, this
    count; with moe_out counted, 74,240; docs/benchmarks.md).

    remat none: s b h (6 e + 12 e / t) + a s^2 b (4 + e) / t: the block's inputs, layer-norm
        outputs, residual branch outputs (6 x (s, b, h), replicated over tensor), QKV, context
        and the MLP's two (s, b, 4h) tensors (split over tensor; GQA's K and V are kv_heads
        wide, SwiGLU keeps three (s, b, f): gate, up and their product), fp32 scores and
        compute-dtype probabilities (split over heads): Korthikanti et al.'s count (arXiv
        2205.05198) for this block, without dropout masks. XLA:CPU keeps 1.2 x it a layer
        (GPT's and Llama's blocks at hidden 64, seq 256: the causal mask's select and the
        activations' own intermediates); not fitted, as no config trains without recompute.
    selective: what model.block.SELECTIVE_SAVED names, no more: the two residual branches'
        outputs (2 x (s, b, h), split over t under sequence parallelism), QKV and the context
        (split over tensor), the MLP's input projections (GeLU's one (s, b, 4h); SwiGLU's gate
        and up, their product recomputed). Norms, activations and dropout masks are recomputed.
        Measured per layer on XLA:CPU (tests/test_plan_compiled.py): GPT's and Llama's
        blocks, with and without sequence parallelism, within 1 %; Korthikanti's selective
        count, which this engine never kept, was 1.6 to 2.3 x it. model.remat_recompute's
        names are not kept, model.remat_offload's not on the device (_less_recomputed).
    full: the layer input only, s b h e.
    Sequence parallelism splits the replicated (s, b, h) ones over t."""
    whole, h, a = model_cfg.seq_len, model_cfg.hidden, model_cfg.heads
    s = whole // context
    e = itemsize(model_cfg.compute_dtype)
    heads, kv_heads, head_dim = attention_dims(model_cfg)
    swiglu = model_cfg.get('mlp', 'gelu') == 'swiglu'
    split = (2 * heads + 2 * kv_heads) * head_dim  # Q, K, V and the context
    residual = tensor if model_cfg.get('sequence_parallel', False) else 1
    if remat == 'full':
        return s * rows * h * e / residual
    expert_rows = expert_rows_width(model_cfg, padding, dense) * e / (tensor if fold else 1)
    if remat == 'selective':
        saved_mlp = mlp_width(model_cfg, dense, padding) * (2 if swiglu else 1)
        # folded: the all-to-alls' two deliveries (model/moe.py), else the experts' outputs
        routed = 2 * expert_rows if fold else expert_rows
        branches, split, saved_mlp = _less_recomputed(model_cfg, split, saved_mlp, fused_attention)
        kept = branches * h * e / residual + (split + saved_mlp) * e / tensor + routed
        return s * rows * kept
    f = mlp_width(model_cfg, dense, padding) * (3 if swiglu else 2)
    kept = s * rows * (6 * h * e / residual + (split + f) * e / tensor + 2 * expert_rows)
    core = a * s * rows * 4 if fused_attention else a * s * whole * rows * (4 + e)
    if context > 1:
        core += 2 * kv_heads * head_dim * whole * rows * e
    return kept + core / tensor


def _less_recomputed(model_cfg, split, saved_mlp, fused_attention):
    """selective's kept residual branches (of 2), Q, K, V and context width and MLP width
    on the device, less what model.remat_recompute makes again and model.remat_offload
    holds in host memory (a fused kernel keeps its output, the context, on the device
    whatever the names say)."""
    dropped = config_lib.recomputed(model_cfg) + config_lib.offloaded(model_cfg)
    heads, kv_heads, head_dim = attention_dims(model_cfg)
    if 'qkv' in dropped:
        split -= (heads + 2 * kv_heads) * head_dim
    if 'context' in dropped and not fused_attention:
        split -= heads * head_dim
    branches = 2 - ('attn_out' in dropped) - ('mlp_out' in dropped)
    inputs = config_lib.mlp_inputs(model_cfg)
    return branches, split, saved_mlp * sum(n not in dropped for n in inputs) / len(inputs)


def boundary_activation_bytes(model_cfg, sequences):
    """Layer-boundary activations of `sequences` sequences with full recompute (the paper's
    batch x layers x seq x hidden x 2 bytes)."""
    e = itemsize(model_cfg.compute_dtype)
    return sequences * model_cfg.num_layers * model_cfg.seq_len * model_cfg.hidden * e


def loss_bytes(model, rows, tensor, context=1):
    """Bytes per device of the output layer and loss (model/loss.py): one piece of the
    sequence's fp32 logits and their gradient in the compute dtype, and the fp32 sum of the
    embedding's gradient (vocab split over tensor; the sequence over context)."""
    vocab = model.padded_vocab // tensor
    piece = rows * (model.seq_len // context // model.loss_chunks) * vocab
    return piece * (4 + itemsize(model.compute_dtype)) + vocab * model.hidden * 4


def tap_bytes(model_cfg, rows, tensor, context=1):
    """Bytes of one layer's taps (parallel/taps.py), per micro-batch of `rows` sequences: each
    kernel matmul's input x and output gradient dy, split over tensor by heads or MLP width
    (attention-out's and MLP-out's x, the others' dy), and the residual-stream ones (the
    inputs of QKV and MLP-in, one a block whichever kernels read it, the output gradients of
    attention-out and MLP-out) as their sequence shard under sequence parallelism, else whole
    (the blocks' dense matmuls; of an MoE only the shared experts' MLP, not the routed
    experts')."""
    heads, kv_heads, head_dim = attention_dims(model_cfg)
    h, t = model_cfg.hidden, tensor
    f = (
        config_lib.shared_ffn_hidden(model_cfg)
        if counts.experts_of(model_cfg)
        else mlp_width(model_cfg)
    )
    mlps = (2 if model_cfg.get('mlp', 'gelu') == 'swiglu' else 1) if f else 0  # in (and gate)
    residual = t if model_cfg.get('sequence_parallel', False) else 1  # as layer_activation_bytes
    stream = (2 if f else 1) * 2 * h / residual  # x in, dy out: attention's, the MLP's
    split = (heads * head_dim + f + (heads + 2 * kv_heads) * head_dim + mlps * f) / t
    tokens = model_cfg.seq_len // context * rows
    return tokens * (stream + split) * itemsize(model_cfg.compute_dtype)


def activation_bytes(config, fused_attention=False):
    """Bytes per device of activations at the peak of a step, as the configured schedule and
    recompute keep them (b = train.micro_batch rows per micro-step and replica).
    fused_attention: the layer recomputed under remat full / selective materialises no scores.
    Layers kept whole (remat none) are counted with the plain path's scores either way: with
    the flash kernel XLA:GPU keeps 0.55 GiB a layer of gpt2_124m (12 against 6 layers,
    compiled), where the count without scores says 0.20 and with them 0.76; until that is
    explained the larger stands.

    no pipeline: micro-steps run one after another, so one micro-batch's activations: every
        layer's kept values, one layer recomputed (remat full / selective), the output
        layer's and loss's (loss_bytes)
    pipeline, 1f1b / interleaved (parallel/pipeline.py): what each forward keeps for its
        chunk's backward (its residual slots, one per micro-batch in flight: the chunk's
        layers' kept values under model.remat), the stage inputs waiting for their forward
        and the output gradients waiting for their backward (its stash and gradient slots)
        and the two hand-offs in flight, each split over tensor along the sequence, one
        layer recomputed (remat full / selective), the loss's on the last stage; zbh1 (the
        residuals held to B) adds B's taps held to W (tap slots x tap_bytes a layer), zbv
        the same with two more hand-offs in flight (its V sends both ways)
    pipeline, gpipe (parallel/gpipe.py, differentiated as one program): each stage keeps
        what every one of its v m + p - 1 iterations saved (the chunk input under full
        recompute), one chunk recomputed, the (m, b, s, h) embedded inputs, recirculating and
        output buffers, and `split` micro-batches of logits and their gradient (gpipe
        differentiates GPT.logits and cross_entropy, not the fused loss).
    The dense layers ahead of a mixture of experts (model.moe.dense_layers): kept once
    unpipelined; pipelined, in every residual slot (expected, not measured: they run in the
    first chunk's embedding branch, a conditional whose residuals are both branches')."""
    model, train = config.model, config.train
    stages, tensor = config.mesh.stage, config.mesh.tensor
    context = config.mesh.get('context', 1)  # every sequence-long value is 1 / c of it
    rows, micro = train.micro_batch, train.micro_steps
    e = itemsize(model.compute_dtype)
    boundary = model.seq_len // context * rows * model.hidden * e
    logits = loss_bytes(model, rows, tensor, context)
    padding, fold = expert_padding(config), folded(config)
    full_layer = layer_activation_bytes(
        model, rows, tensor, 'none', fused_attention, context, padding=padding, fold=fold
    )

    # a fused kernel keeps its context whatever model.remat_recompute names; layers kept whole
    # count the plain path's scores either way (above)
    kept_fused = fused_attention and model.remat == 'selective'

    def layers(count, dense=False):
        kept = layer_activation_bytes(
            model, rows, tensor, model.remat, kept_fused, context, dense=dense,
            padding=padding, fold=fold,
        )  # fmt: skip
        return count * kept

    moe_layers = config_lib.block_stack_layers(model)
    dense = layers(model.num_layers - moe_layers, dense=True)  # 0 but ahead of the experts
    if not engine_lib.engine(config).pipelined:
        kept = layers(moe_layers) + dense
        recomputed = full_layer if model.remat != 'none' else 0
        return dict(layers=kept, recomputed=recomputed, pipeline_buffers=0, logits=logits)
    chunk_layers = chunk_slots(config)
    table = engine_table(config)
    if table is not None:
        handoff = boundary // tensor if model.seq_len % tensor == 0 else boundary
        chunk = layers(chunk_layers) + dense  # expected, not measured: see docs/models.md
        tapped = table.tap_slots * chunk_layers * tap_bytes(model, rows, tensor, context)
        in_flight = 4 if table.v_shape else 2  # hand-offs: both ways in the V
        return dict(
            layers=table.resid_slots * chunk,
            recomputed=full_layer if model.remat != 'none' else 0,
            pipeline_buffers=(table.stash_slots + table.grad_slots + in_flight) * handoff + tapped,
            logits=logits,
        )
    iterations = engine_lib.engine(config).ticks(micro)
    if model.remat == 'none':
        per_iteration = chunk_layers * full_layer
        recomputed = 0
    else:
        per_iteration = boundary
        recomputed = chunk_layers * full_layer
    split = stages if micro % stages == 0 else 1
    return dict(
        layers=iterations * per_iteration,
        recomputed=recomputed,
        pipeline_buffers=3 * micro * boundary,
        logits=split * 2 * 4 * rows * model.seq_len // context * model.padded_vocab // tensor,
    )


def model_flops_per_step(config):
    """PaLM's model FLOPs (6 N + 12 L H Q T per token) of one global batch."""
    tokens = config.train.global_batch * config.model.seq_len
    return model_flops_per_token(config.model, param_count(config.model)) * tokens


def hardware_flops_per_step(config):
    """Megatron's FLOPs of one global batch: 96 B s l h^2 (...) with full recompute, 72
    without (selective recompute counts as none: it repeats only the attention core)."""
    recompute = config.model.remat == 'full'
    return megatron_flops_per_step(config.model, config.train.global_batch, recompute)
