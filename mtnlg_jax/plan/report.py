"""The plan of a resolved config as one JSON-ready dict, the compiled step's figures next to it,
and the readable table launch/plan.py prints.

    plan = make_plan(config, cluster='a100-80gb')     arithmetic only, no devices
    add_compiled(plan, compiled, info)                 + memory_analysis, collectives, FLOPs
    print('\\n'.join(lines(plan)))
"""

from mtnlg_jax.parallel import branches
from mtnlg_jax.parallel import footprint
from mtnlg_jax.parallel import stage_order
from mtnlg_jax.plan import (
    arithmetic,
    clusters,
    comm,
    hlo,
    hlo_module,
    loop_copies,
    overlap,
    predict,
)

# Keys other tools read (README, bench/scale.py, the pipeline and communication tests).
PER_DEVICE_KEYS = ('params', 'grads', 'optimizer', 'update', 'activations', 'total')


def make_plan(config, cluster=None):
    """Everything the arithmetic says about a resolved config; cluster: a CLUSTERS name."""
    state = arithmetic.state_bytes(config)
    activations = arithmetic.activation_bytes(config)
    # update: the optimizer step's new master weights and moments, held beside the old ones
    # until the non-finite check picks one (train/step.py's `where`).
    per_device = dict(state, update=state['optimizer'], activations=sum(activations.values()))
    per_device['total'] = sum(per_device.values())
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
    if cluster is not None:
        plan['cluster'] = clusters.estimate(
            clusters.CLUSTERS[cluster], config, per_device['total'], hardware, communication
        )
    return plan


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
        mesh=dict(data=mesh.data, stage=mesh.stage, tensor=mesh.tensor),
        repeats=config.pipeline.repeats,
        global_batch=config.train.global_batch,
        micro_batch=config.train.micro_batch,
        micro_steps=config.train.micro_steps,
        compute_dtype=config.model.compute_dtype,
        remat=config.model.remat,
    )


def add_compiled(plan, config, compiled, info, notes=(), target=None):
    """plan['compiled']: memory_analysis, collectives, FLOPs and times of a compiled step
    (from plan.compile), and the plan of what XLA:CPU compiled (`cpu_equivalent`) to compare
    them with when the device is a CPU. target: the GPU target name of a GPU compile
    (plan/gpu_target.py): adds the fused attention kernels and the overlap replay."""
    from mtnlg_jax.plan import compile as compile_lib  # noqa: PLC0415 (imports train/)

    memory = compile_lib.memory(compiled)
    text = compiled.as_text()
    weights = branch_weights(config)
    inventory = hlo.collective_inventory(text, info['mesh'], weights)
    devices = info['mesh'].devices.size
    flops = hlo_module.dot_flops(text, weights)
    plan['compiled'] = dict(
        memory,
        flops=flops,
        flops_vs_model=flops * devices / arithmetic.model_flops_per_step(config),
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
        add_gpu_figures(plan['compiled'], config, text, info['mesh'], target, weights)
        predict_with_overlap(plan, config, target)
    else:
        reference = make_plan(cpu_equivalent(config))
        plan['compiled']['planned_as_compiled'] = dict(
            compute_dtype='float32',
            per_device_bytes=reference['per_device_bytes'],
            comm_bytes_per_device=reference['comm_bytes_per_device'],
        )
    return plan


def add_gpu_figures(compiled, config, text, mesh, target, weights):
    """What only a GPU compile shows: the attention kernels, and the overlap replay of its
    schedule on the target's figures (plan/overlap.py)."""
    cluster = clusters.CLUSTERS[target]
    fused = hlo_module.attention_kernel_counts(text)
    compiled['attention'] = dict(fused=bool(fused), kernels=fused)
    copies = loop_copies.loop_copies(text, branch_weights=weights)
    compiled['loop_copies'] = dict(
        count=len(copies),
        bytes_per_step=loop_copies.bytes_per_step(copies),
        largest=[dict(type=c['type'], runs=c['runs']) for c in copies[:4]],
    )
    replay = overlap.collective_overlap(
        text, mesh, overlap.Target.of_cluster(cluster, config.model.compute_dtype), weights
    )
    compiled['overlap'] = dict(
        table=replay['table'],
        step_s=replay['step_s'],
        compute_s=replay['compute_s'],
        exposed_s=replay['exposed_s'],
        exposed_vs_compute=replay['exposed_s'] / replay['compute_s'],
        time_by_kind=replay['time_by_kind'],
        heaviest=replay['heaviest'],
        links=dict(
            nvlink_bytes_per_s=cluster.nvlink_bandwidth,
            network_bytes_per_s=cluster.internode_bandwidth,
            gpus_per_node=cluster.gpus_per_node,
            peak_flops=cluster.peak_tflops[config.model.compute_dtype] * 1e12,
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
    compile's overlap table instead of the documented rule (nothing hidden)."""
    if plan.get('cluster', {}).get('cluster') != target:
        return
    shares = overlap_shares(plan['compiled']['overlap']['table'])
    step = predict.step_time(config, clusters.CLUSTERS[target], overlap=shares)
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


def branch_weights(config, micro_steps=None):
    """How often the 1F1B engine's conditionals take each branch, from its table (mean over
    stages), for the HLO inventory; None without one (no pipeline, or GPipe's scan)."""
    table = arithmetic.engine_table(config, micro_steps)
    if table is None:
        return None
    weights = branches.branch_fractions(table)
    layers = stage_order.of_config(config)
    if layers.padded:  # cond(slot < used, block, pass through): the layers' share of slots
        share = layers.num_layers / layers.stored_layers
        weights[(branches.LAYER_SLOT,)] = [1.0 - share, share]
    return weights


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


def _gib(n):
    if n is None:
        return 'n/a'
    return ('-' if n < 0 else '') + footprint.format_bytes(abs(n))


def predicted_line(step):
    """One line of plan/predict.py's step: the total and its parts."""
    return (
        f'  predicted  {step["predicted_step_s"]:.3f} s per step = compute '
        f'{step["compute_s"]:.3f} + recompute {step["recompute_s"]:.3f} + tensor '
        f'{step["tensor_comm_s"]:.3f} + accumulate {step["accumulate_s"]:.3f} + pipeline '
        f'{step["pipeline_comm_s"]:.3f} + bubble {step["bubble_s"]:.3f} + data '
        f'{step["data_comm_s"] + step["stage_comm_s"]:.3f} + optimizer '
        f'{step["optimizer_s"]:.3f}; {step["tflops_per_gpu"]:.1f} TFLOP/s per GPU, MFU '
        f'{100 * step["mfu"]:.1f} % ({step["efficiency"]["source"]}; docs/planner.md)'
    )


def lines(plan):
    """The readable table of a plan (and its compiled figures, if any)."""
    c = plan['config']
    mesh = c['mesh']
    per_device = plan['per_device_bytes']
    out = [
        f'model        {plan["params"] / 1e9:.3f} B parameters, {c["compute_dtype"]} compute, '
        f'remat {c["remat"]}',
        f'mesh         data {mesh["data"]} x stage {mesh["stage"]} x tensor {mesh["tensor"]}, '
        f'pipeline repeats {c["repeats"]}; global batch {c["global_batch"]} = micro_batch '
        f'{c["micro_batch"]} x data {mesh["data"]} x {c["micro_steps"]} micro-steps',
        'per device   ' + ', '.join(f'{k} {_gib(per_device[k])}' for k in PER_DEVICE_KEYS),
        '  activations ' + ', '.join(f'{k} {_gib(v)}' for k, v in plan['activation_bytes'].items()),
        f'FLOPs        model {plan["model_flops_per_step"]:.4g} per step (6N + 12LHQT per '
        f'token); Megatron hardware {plan["hardware_flops_per_step"]:.4g}',
    ]
    compiled = plan.get('compiled')
    reference = (compiled or {}).get('planned_as_compiled') or plan
    columns = [('planned', plan['comm_bytes_per_device'])]
    if compiled:
        if reference is not plan:
            columns.append(('planned as compiled', reference['comm_bytes_per_device']))
        columns.append(('compiled', compiled['comm_bytes_per_device']))
    out.append(
        'comm         bytes one device sends per step: ' + ' | '.join(name for name, _ in columns)
    )
    if compiled and reference is not plan:
        cc = compiled['config']
        dtype = reference.get('compute_dtype', cc['compute_dtype'])
        out.append(
            f'             (compiled: data {cc["mesh"]["data"]} x stage {cc["mesh"]["stage"]} x '
            f'tensor {cc["mesh"]["tensor"]}, global batch {cc["global_batch"]}; planned as '
            f'compiled: that layout, computed in {dtype} as XLA:CPU runs it)'
        )
    pairs = sorted({(k, a) for _, comm_ in columns for k, per in comm_.items() for a in per})
    for kind, axis in pairs:
        cells = [_gib(comm_.get(kind, {}).get(axis)) for _, comm_ in columns]
        out.append(f'  {kind:<19}{axis:<14}' + ' | '.join(f'{c:>11}' for c in cells))
    if 'cluster' in plan:
        est = plan['cluster']
        out += [
            f'cluster      {est["description"]}: {est["devices"]} GPUs on {est["nodes"]} nodes',
            f'  fits       {"yes" if est["fits"] else "NO"}: {_gib(per_device["total"])} '
            f'planned per device of {est["hbm_bytes"] / 1e9:.0f} GB',
            f'  time       >= {est["iteration_s_lower_bound"]:.3f} s per step = compute '
            f'{est["compute_s"]:.3f} + tensor {est["tensor_comm_s"]:.3f} + pipeline '
            f'{est["pipeline_comm_s"]:.3f} + bubble {est["bubble_s"]:.3f} (data '
            f'{est["data_comm_s"]:.3f} s taken as overlapped); <= '
            f'{est["tflops_per_gpu_upper_bound"]:.1f} TFLOP/s per GPU',
            predicted_line(est['prediction'])
            + (
                f'; exposure from the GPU compile\'s overlap table (the rule: '
                f'{est["predicted_step_s_rule"]:.3f} s)'
                if 'predicted_step_s_rule' in est
                else ''
            ),
        ]
        if 'not_charged' in est:
            extra = est['not_charged']
            out.append(
                '  not charged  the predicted step is analytic: it does not charge the compiled '
                f'step\'s copies {extra["copies"]:.2f} s, slicing and slot writes '
                f'{extra["slicing and slot writes"]:.2f} s, transposes {extra["transposes"]:.2f} s '
                f'(replayed step {extra["replayed_step_s"]:.2f} s)'
            )
    if compiled:
        planned_total = reference['per_device_bytes']['total']
        stacked = compiled.get('per_iteration_arrays', [])
        where = (
            'CPU devices'
            if compiled.get('target') is None
            else f'compile-only {compiled["target"]} GPUs (XLA:GPU)'
        )
        out += [
            f'compiled     on {compiled["devices"]} {where} in {compiled["compile_s"]:.1f} s'
            f' (memory per device from memory_analysis):',
            f'  arguments {_gib(compiled["argument_bytes"])}, outputs '
            f'{_gib(compiled["output_bytes"])} (aliased {_gib(compiled["alias_bytes"])}), '
            f'temporaries {_gib(compiled["temp_bytes"])}: peak {_gib(compiled["peak_bytes"])} '
            f'against {_gib(planned_total)} planned as compiled '
            f'({compiled["peak_bytes"] / planned_total:.2f} x)',
            f'  difference compiled - planned = {_gib(compiled["peak_bytes"] - planned_total)}'
            + (
                '; largest arrays stacked per pipeline iteration (leading dimension v m + p - 1; '
                'the plan keeps only the stage inputs per iteration): '
                + ', '.join(f'{a["shape"]} {_gib(a["bytes"])}' for a in stacked)
                if stacked
                else ''
            ),
            '  largest    '
            + ', '.join(
                f'{b["shape"]} {b["op"]} {_gib(b["bytes"])}' for b in compiled['largest_buffers']
            ),
        ]
        raw = compiled['cost_analysis_flops']
        out.append(
            f'  FLOPs      {compiled["flops"]:.4g} per device per step in matmuls (loops x trip '
            f'counts): {compiled["flops_vs_model"]:.2f} x model FLOPs / devices '
            f'(cost_analysis: {"n/a" if raw is None else format(raw, ".4g")}, loop bodies once)'
        )
        out += gpu_lines(compiled)
        out += [f'  note       {note}' for note in compiled['notes']]
    return out


def gpu_lines(compiled):
    """The attention kernels and the overlap table of a GPU compile ([] for a CPU one)."""
    if compiled.get('target') is None:
        return []
    attention = compiled['attention']
    kernels = ', '.join(f'{k} x {n}' for k, n in sorted(attention['kernels'].items()))
    over = compiled['overlap']
    links = over['links']
    out = [
        '  attention  '
        + (
            f'fused: {kernels}'
            if attention['fused']
            else 'NOT fused: einsums around a materialised (seq x seq) score matrix'
        ),
        f'  overlap    replayed step {over["step_s"]:.3f} s = compute at peak '
        f'{over["compute_s"]:.3f} + exposed communication {over["exposed_s"]:.3f} '
        f'({100 * over["exposed_vs_compute"]:.1f} % of compute); links per GPU: NVLink '
        f'{links["nvlink_bytes_per_s"] / 1e9:.0f} GB/s inside a node of '
        f'{links["gpus_per_node"]}, network {links["network_bytes_per_s"] / 1e9:.0f} GB/s',
        '  time by kind (replayed s): '
        + ', '.join(f'{k} {v:.2f}' for k, v in over['time_by_kind'].items()),
        *(
            f'  {"heaviest" if i == 0 else "":<10} {row["seconds"]:.2f} s {row["kind"]}: '
            f'{row["type"]} {row["op"]}, {row["runs"]:.0f} runs'
            for i, row in enumerate(over.get('heaviest', []))
        ),
        f'  copies inside loops (over 1 MiB): {compiled["loop_copies"]["count"]}, '
        f'{compiled["loop_copies"]["bytes_per_step"] / 2**30:.1f} GiB a step',
        f'  {"kind":<19}{"axes":<19}{"link":<9}{"GB/step":>10}{"overlapped":>12}{"exposed s":>11}',
    ]
    for row in over['table']:
        out.append(
            f'  {row["kind"]:<19}{row["axes"]:<19}{row["link"]:<9}'
            f'{row["wire_bytes"] / 1e9:>10.3g}{100 * row["overlapped"]:>11.0f}%'
            f'{row["exposed_s"]:>11.3g}'
        )
    return out
