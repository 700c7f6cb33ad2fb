"""The plan of a resolved config as one JSON-ready dict, the compiled step's figures next to it
(plan/printout.py prints it as the table launch/plan.py shows).

    plan = make_plan(config, cluster='a100-80gb')     arithmetic only, no devices
    add_compiled(plan, compiled, info)                 + memory_analysis, collectives, FLOPs
"""

import numpy as np

from mtnlg_jax import config as config_lib
from mtnlg_jax.model import counts
from mtnlg_jax.parallel import branches, grad_reduce, stage_order
from mtnlg_jax.plan import (
    arithmetic,
    clusters,
    comm,
    hlo,
    hlo_module,
    lockstep,
    loop_copies,
    matmul_sites,
    overlap,
    pgle,
    predict,
)

# Keys other tools read (README, bench/scale.py, the pipeline and communication tests).
PER_DEVICE_KEYS = ('params', 'grads', 'optimizer', 'activations', 'total')


def memory(config, cluster=None):
    """(bytes per device by part of the state with their 'total', activations by kind) on
    `cluster` (a clusters.Cluster: its GPUs decide whether attention is fused, as
    model/attention_kernel.py's attention_kernel does; None: XLA:CPU's plain attention)."""
    state = arithmetic.state_bytes(config)
    fused = predict.fused_attention(config.model, cluster, config.mesh.context)
    activations = arithmetic.activation_bytes(config, fused)
    # No second copy of the optimizer state: XLA writes the step's new master weights and
    # moments into the donated old ones, leaf by leaf (the GPU check's 2 B on one H200: peak
    # 48.71 GiB = these parts; docs/benchmarks.md, the second GPU check).
    per_device = dict(state, activations=sum(activations.values()))
    per_device['total'] = sum(per_device.values())
    return per_device, activations


def make_plan(config, cluster=None):
    """Everything the arithmetic says about a resolved config; cluster: a CLUSTERS name."""
    per_device, activations = memory(config, cluster and clusters.CLUSTERS[cluster])
    communication = comm.comm_bytes_per_device(config)
    hardware = arithmetic.hardware_flops_per_step(config)
    plan = dict(
        config=config_summary(config),
        params=arithmetic.param_count(config.model),
        per_device_bytes=per_device,
        activation_bytes=activations,
        model_flops_per_step=arithmetic.model_flops_per_step(config),
        hardware_flops_per_step=hardware,
        comm_bytes_per_device=communication,
    )
    if counts.experts_of(config.model):
        plan['moe'] = moe_figures(config, plan['params'])
    if cluster is not None:
        plan['cluster'] = clusters.estimate(
            clusters.CLUSTERS[cluster], config, per_device['total'], hardware, communication
        )
    return plan


def moe_figures(config, params):
    """A mixture of experts' part of the plan: its routing, total and active parameters, the
    routed experts' bytes per device (split over expert, tensor and stage) and the
    all-to-all bytes one device sends per step by axis, and the rows the experts multiply
    per (token, choice) row (arithmetic.expert_padding)."""
    model = config.model
    all_to_all = comm.all_to_all_bytes(config)
    moe_layers = config_lib.block_stack_layers(model)  # but the dense layers ahead of them
    return dict(
        experts=model.moe.experts,
        top_k=model.moe.top_k,
        expert_ranks=arithmetic.exchange_ranks(config),
        folded=arithmetic.folded(config),
        params=params,
        active_params=counts.active_params(model, params),
        routed_expert_params=moe_layers * model.moe.experts * counts.expert_params(model),
        expert_bytes_per_device=arithmetic.expert_bytes(config),
        all_to_all_bytes_per_device=(
            {comm.axes_key(config, comm.exchange_axes(config)): all_to_all} if all_to_all else {}
        ),
        expert_padding=arithmetic.expert_padding(config),
        uncounted_copies=arithmetic.uncounted_expert_copies(config),
        expert_padding_source="the exchange's fixed buffers at mesh.expert > 1: X / k "
        'dropless, about the capacity factor else (model/moe.py)',
    )


def cpu_equivalent(config):
    """The config as XLA:CPU compiles it: a bf16 (or fp16) step runs its dots, collectives and
    buffers in fp32 there (measured: the bf16 step of a layout needs the fp32 step's memory
    and moves its bytes), so its compiled figures compare with the fp32 plan."""
    if config.model.compute_dtype == 'float32':
        return config
    config = config.copy_and_resolve_references()
    config.model.compute_dtype = 'float32'
    return config


def config_summary(config):
    """The parts of a resolved config that the figures depend on."""
    mesh = config.mesh
    return dict(
        mesh=dict(data=mesh.data, stage=mesh.stage, tensor=mesh.tensor, expert=mesh.expert)
        | ({'context': mesh.context} if mesh.get('context', 1) > 1 else {}),
        repeats=config.pipeline.repeats,
        global_batch=config.train.global_batch,
        micro_batch=config.train.micro_batch,
        micro_steps=config.train.micro_steps,
        compute_dtype=config.model.compute_dtype,
        remat=config.model.remat,
    )


def add_compiled(plan, config, compiled, info, notes=(), target=None, profile=None):
    """plan['compiled']: memory_analysis, collectives, FLOPs and times of a compiled step
    (from plan.compile), and the plan of what XLA:CPU compiled (`cpu_equivalent`) to compare
    them with when the device is a CPU. target: the GPU target name of a GPU compile
    (plan/gpu_target.py): adds the fused attention kernels and the overlap replay; profile: a
    path where the replay's costs are written as XLA's latency profile (plan/pgle.py)."""
    from mtnlg_jax.plan import compile as compile_lib  # noqa: PLC0415 (imports train/)

    memory = compile_lib.memory(compiled)
    text = compiled.as_text()
    weights = branch_weights(config)
    inventory = hlo.collective_inventory(text, info['mesh'], weights)
    devices = info['mesh'].devices.size
    by_dtype = hlo_module.matmul_flops_by_dtype(text, weights)
    flops = sum(by_dtype.values())
    plan['compiled'] = dict(
        memory,
        flops=flops,
        matmul_flops_by_dtype=by_dtype,
        not_fp8=fp8_left(text, config, weights),
        flops_vs_model=flops * devices / arithmetic.model_flops_per_step(config),
        flops_vs_hardware=flops * devices / arithmetic.hardware_flops_per_step(config),
        cost_analysis_flops=compile_lib.flops(compiled),
        compile_s=info['compile_s'],
        devices=int(devices),
        collectives=[
            dict(
                kind=op['kind'],
                axes=list(op['axes']),
                bytes=op['bytes'],
                count=op['count'],
                in_loop=op['in_loop'],
                wire_bytes=op['wire_bytes'],
                name=op['name'],
            )
            for op in inventory
        ],
        comm_bytes_per_device=compiled_comm(inventory),
        largest_buffers=[
            dict(bytes=size, shape=shape, op=op)
            for size, shape, op, _ in hlo_module.largest_buffers(text, top=5)
        ],
        notes=list(notes),
        config=config_summary(config),
        per_iteration_arrays=per_iteration_arrays(text, config),
        platform='cpu' if target is None else 'cuda',
        target=target,
    )
    if target is not None:
        add_gpu_figures(plan['compiled'], config, text, info['mesh'], target, weights, profile)
        predict_with_overlap(plan, config, target)
    else:
        reference = make_plan(cpu_equivalent(config))
        plan['compiled']['planned_as_compiled'] = dict(
            compute_dtype='float32',
            per_device_bytes=reference['per_device_bytes'],
            comm_bytes_per_device=reference['comm_bytes_per_device'],
        )
    return plan


def fp8_left(text, config, weights):
    """With model.fp8: {site: {flops, why}} of the matmuls left in the compute dtype
    (plan/matmul_sites.py); None without."""
    recipe = config.model.get('fp8', 'none')
    if recipe == 'none':
        return None
    left = matmul_sites.stayed(text, config.model, config.mesh.tensor, weights)
    return {site: dict(flops=f, why=matmul_sites.reason(site, recipe)) for site, f in left.items()}


def add_gpu_figures(compiled, config, text, mesh, target, weights, profile=None):
    """What only a GPU compile shows: the attention kernels, and the overlap replay of its
    schedule on the target's figures (plan/overlap.py), its costs written to `profile` if
    given (plan/pgle.py)."""
    cluster = clusters.CLUSTERS[target]
    fused = hlo_module.attention_kernel_counts(text)
    compiled['attention'] = dict(fused=bool(fused), kernels=fused)
    found = loop_copies.copies_and_fills(text, branch_weights=weights)  # one reading
    for key, copies in zip(('loop_copies', 'loop_fills'), found):
        compiled[key] = dict(
            count=len(copies),
            bytes_per_step=loop_copies.bytes_per_step(copies),
            largest=[dict(type=c['type'], runs=c['runs']) for c in copies[:4]],
        )
    target_figures = overlap.Target.of_cluster(cluster, config.model.compute_dtype)
    replay = overlap.collective_overlap(text, mesh, target_figures, weights)
    if profile is not None:
        pgle.write(replay['replay'], profile)
    table = arithmetic.engine_table(config)
    ticks = table and lockstep.lockstep(
        replay['replay'],
        table,
        lambda where: branch_weights(config, where=where),
        slot_columns(config, table),
        gathering_ticks(config, table),
    )
    compiled['overlap'] = dict(
        table=replay['table'],
        step_s=replay['step_s'],
        lockstep=ticks and dict(ticks, step_s=replay['step_s'] + ticks['bubble_s']),
        compute_s=replay['compute_s'],
        exposed_s=replay['exposed_s'],
        exposed_vs_compute=replay['exposed_s'] / replay['compute_s'],
        time_by_kind=replay['time_by_kind'],
        heaviest=replay['heaviest'],
        host=replay['host'],
        links=dict(
            nvlink_bytes_per_s=cluster.nvlink_bandwidth,
            network_bytes_per_s=cluster.internode_bandwidth,
            host_bytes_per_s=cluster.host_bandwidth,
            gpus_per_node=cluster.gpus_per_node,
            peak_flops=cluster.peak_tflops[config.model.compute_dtype] * 1e12,
            fp8_peak_flops=cluster.peak_tflops.get('float8', 0.0) * 1e12,
            hbm_bytes_per_s=cluster.hbm_bandwidth,
        ),
    )


def overlap_shares(table):
    """{(kind, axis): share of its wire time hidden} of an overlap table, links merged."""
    wire, hidden = {}, {}
    for row in table:
        key = (row['kind'], row['axes'])
        wire[key] = wire.get(key, 0.0) + row['wire_s']
        hidden[key] = hidden.get(key, 0.0) + row['wire_s'] - row['exposed_s']
    return {key: hidden[key] / wire[key] for key in wire if wire[key] > 0}


def predict_with_overlap(plan, config, target):
    """The cluster's predicted step again, what each collective hides taken from the GPU
    compile's overlap table instead of the documented rule (nothing hidden), and what its
    replay waits for the host link charged."""
    if plan.get('cluster', {}).get('cluster') != target:
        return
    over = plan['compiled']['overlap']
    host_s = over.get('host', {}).get('exposed_s', 0.0)  # the offloaded activations' wait
    step = predict.step_time(
        config, clusters.CLUSTERS[target], overlap=overlap_shares(over['table']), host_s=host_s
    )
    plan['cluster'].update(
        predicted_step_s_rule=plan['cluster']['predicted_step_s'],
        predicted_step_s=step['predicted_step_s'],
        predicted_tflops_per_gpu=step['tflops_per_gpu'],
        predicted_mfu=step['mfu'],
        prediction=step,
        exposure='the GPU compile\'s overlap table',
        not_charged=not_charged(plan['compiled']['overlap']),
    )


# What a compiled step spends beyond the model's work (the replay's time_by_kind) that the
# analytic prediction has no term for: the kernels' padding and reruns hide inside 'attention
# kernels' and 'matmuls' and are not split out.
NOT_CHARGED = ('copies', 'slicing and slot writes', 'transposes')


def not_charged(over):
    """{kind: replayed seconds} of the compiled step's work the predicted step does not
    charge (NOT_CHARGED), and the replayed step for comparison."""
    kinds = {k: over['time_by_kind'].get(k, 0.0) for k in NOT_CHARGED}
    return dict(kinds, total_s=sum(kinds.values()), replayed_step_s=over['step_s'])


def branch_weights(config, micro_steps=None, where=None):
    """How often the 1F1B engine's conditionals take each branch, from its table (mean over
    stages; where: over those slots alone, a (ticks, stages) mask), for the HLO inventory;
    None without one (no pipeline, or GPipe's scan). Under pipeline.overlap_param_gather the
    first ticks are a loop of their own (parallel/gathering_tick.py): the other loop's
    conditionals are weighed over the rest."""
    table = arithmetic.engine_table(config, micro_steps)
    if table is None:
        return None
    gather = _gather_plan(config, table)
    if gather is not None:
        rest = np.zeros(table.fwd_micro.shape, bool)
        rest[gather.branch.shape[0] :] = True
        # slots of the first ticks alone (plan/lockstep.py's): the other loop's are moot
        main = rest if where is None or not (where & rest).any() else where & rest
        where, warm = main, where
    weights = branches.branch_fractions(table, where)
    if config.pipeline.get('overlap_grad_reduce', False):  # its switch (grad_reduce.py)
        weights = grad_reduce.fractions(table, _reduce_plan(config, table), weights, where)
    if gather is not None:
        weights = grad_reduce.gather_fractions(table, gather, weights, warm)
    return weights


def _reduce_plan(config, table):
    """pipeline.overlap_grad_reduce's placement of the reduce-scatters in the table."""
    return grad_reduce.plan(table, stage_order.of_config(config).slots)  # a chunk's places


def _gather_plan(config, table):
    """pipeline.overlap_param_gather's placement of the all-gathers in the table's first
    ticks (parallel/gathering_tick.py), or None where the engine runs none."""
    if not config.pipeline.get('overlap_param_gather', False) or table.repeats == 1:
        return None
    return grad_reduce.gather_plan(table, stage_order.of_config(config).slots)


def slot_columns(config, table):
    """(ticks, stages) arrays beyond the table's kinds that tell slots apart: the backward's
    reduce-scatter variant under pipeline.overlap_grad_reduce, the first ticks' all-gather
    variant under pipeline.overlap_param_gather (plan/lockstep.py)."""
    columns = []
    if config.pipeline.get('overlap_grad_reduce', False):
        columns.append(_reduce_plan(config, table).branch)
    gather = _gather_plan(config, table)
    if gather is not None:
        padded = np.full(table.fwd_micro.shape, -1, np.int32)
        padded[: gather.branch.shape[0]] = gather.branch
        columns.append(padded)
    return columns


def gathering_ticks(config, table):
    """How many first ticks run in a loop of their own (pipeline.overlap_param_gather): 0 if
    none do."""
    gather = _gather_plan(config, table)
    return 0 if gather is None else gather.branch.shape[0]


def per_iteration_arrays(hlo_text, config, top=3):
    """The largest distinct arrays whose leading dimension is the pipeline's iteration count
    (v m + p - 1): what the differentiated pipeline scan stacks once per iteration, as
    [{'shape', 'bytes'}], largest first ([] without a pipeline). Distinct shapes need not be
    alive together: this names the big ones, it does not add them up."""
    if config.mesh.stage == 1:
        return []
    iterations = config.pipeline.repeats * config.train.micro_steps + config.mesh.stage - 1
    found = []
    for dtype, dims in hlo_module.array_shapes(hlo_text):
        if len(dims) > 1 and dims[0] == iterations:
            shape = f'{dtype}[{",".join(map(str, dims))}]'
            found.append(dict(shape=shape, bytes=hlo_module.shape_bytes(shape)))
    return sorted(found, key=lambda a: -a['bytes'])[:top]


def compiled_comm(inventory):
    """{kind: {axes key: bytes one device sends per step}} of an inventory, the plan's form."""
    out = {}
    for (kind, axes), total in sorted(hlo.totals(inventory).items()):
        out.setdefault(kind, {})[hlo.axes_key(axes)] = total['wire_bytes']
    return out
