"""The plan (plan/report.py's dict) as the readable table launch/plan.py prints.

print('\\n'.join(lines(plan)))
"""

from mtnlg_jax.parallel import footprint
from mtnlg_jax.plan.report import PER_DEVICE_KEYS


def _gib(n):
    if n is None:
        return 'n/a'
    return ('-' if n < 0 else '') + footprint.format_bytes(abs(n))


def host_part(step):
    """The predicted line's wait for host memory (offloaded activations), where there is one."""
    return f' + host {step["host_s"]:.3f}' if step.get('host_s') else ''


def predicted_line(step):
    """One line of plan/predict.py's step: the total and its parts."""
    return (
        f'  predicted  {step["predicted_step_s"]:.3f} s per step = compute '
        f'{step["compute_s"]:.3f} + recompute {step["recompute_s"]:.3f} + tensor '
        f'{step["tensor_comm_s"]:.3f} + {moe_part(step)}{context_part(step)}accumulate '
        f'{step["accumulate_s"]:.3f} '
        f'+ pipeline '
        f'{step["pipeline_comm_s"]:.3f} + bubble {step["bubble_s"]:.3f} + data '
        f'{step["data_comm_s"] + step["stage_comm_s"]:.3f} + optimizer '
        f'{step["optimizer_s"]:.3f}{host_part(step)}; {step["tflops_per_gpu"]:.1f} TFLOP/s '
        f'executed per GPU, {step["model_tflops_per_gpu"]:.1f} by the model\'s count: MFU '
        f'{100 * step["mfu"]:.1f} % ({step["efficiency"]["source"]}; docs/planner.md)'
    )


def context_part(step):
    """The context-parallel term of the predicted line: the keys' and values' gathers, their
    gradients' reduce-scatters and the gradients' sum over 'context' waited for ('' without)."""
    if not step.get('context_comm_s'):
        return ''
    return f'context {step["context_comm_s"]:.3f} + '


def moe_part(step):
    """A mixture of experts' term of the predicted line: the all-to-all waited for, and the
    exchange's padding charged ('' for a dense model)."""
    if step.get('expert_padding') is None:
        return ''
    return (
        f'all-to-all {step["expert_comm_s"]:.3f} (the experts\' rows padded '
        f'{step["expert_padding"]:.3g} x by the exchange) + '
    )


def moe_lines(plan):
    """The plan's mixture-of-experts lines ([] for a dense model)."""
    moe = plan.get('moe')
    if moe is None:
        return []
    held = moe['expert_bytes_per_device']
    sent = ', '.join(f'{axis} {_gib(n)}' for axis, n in moe['all_to_all_bytes_per_device'].items())
    out = [
        f'experts      {moe["experts"]} routed, top {moe["top_k"]}, over {moe["expert_ranks"]} '
        f'expert rank(s){" (folded: expert x tensor)" if moe.get("folded") else ""}: '
        f'{moe["active_params"] / 1e9:.4f} B active of {moe["params"] / 1e9:.4f} '
        f'B parameters ({moe["routed_expert_params"] / 1e9:.4f} B in routed experts)',
        f'  per device routed experts: params {_gib(held["params"])}, grads '
        f'{_gib(held["grads"])}, optimizer {_gib(held["optimizer"])}; all-to-all per step: '
        f'{sent or "none (one expert rank)"}; rows per choice {moe["expert_padding"]:.3g} '
        f'({moe["expert_padding_source"]})',
    ]
    if moe.get('uncounted_copies'):
        out.append(
            f'  note       one expert rank, the experts split over tensor '
            f'{plan["config"]["mesh"]["tensor"]} unfolded: model/moe.py\'s batched path gathers '
            'a copy of each tile\'s expert weights that this plan does not count (Mixtral 8x22B '
            'so: 108.1 GiB compiled, 73.9 GiB planned); fold (model.moe.fold_tensor=True), '
            'split the experts over mesh.expert, or compile it (--target)'
        )
    return out


def fits_word(plan):
    """'yes' or 'NO' by the plan's memory; 'not known' where it fits without the copies the
    plan knowingly leaves out (moe_lines' note)."""
    if not plan['cluster']['fits']:
        return 'NO'
    return 'not known (note above)' if plan.get('moe', {}).get('uncounted_copies') else 'yes'


def lines(plan):
    """The readable table of a plan (and its compiled figures, if any)."""
    c = plan['config']
    mesh = c['mesh']
    per_device = plan['per_device_bytes']
    out = [
        f'model        {plan["params"] / 1e9:.3f} B parameters, {c["compute_dtype"]} compute, '
        f'remat {c["remat"]}',
        f'mesh         data {mesh["data"]} x stage {mesh["stage"]} x '
        + (f'context {mesh["context"]} x ' if 'context' in mesh else '')
        + f'tensor {mesh["tensor"]}'
        + (f' x expert {mesh["expert"]}' if mesh.get('expert', 1) > 1 else '')
        + ', '
        f'pipeline repeats {c["repeats"]}; global batch {c["global_batch"]} = micro_batch '
        f'{c["micro_batch"]} x data {mesh["data"]}'
        + (f' x expert {mesh["expert"]}' if mesh.get('expert', 1) > 1 else '')
        + f' x {c["micro_steps"]} micro-steps',
        'per device   ' + ', '.join(f'{k} {_gib(per_device[k])}' for k in PER_DEVICE_KEYS),
        '  activations ' + ', '.join(f'{k} {_gib(v)}' for k, v in plan['activation_bytes'].items()),
        f'FLOPs        model {plan["model_flops_per_step"]:.4g} per step (6N + 12LHQT per '
        f'token); Megatron hardware {plan["hardware_flops_per_step"]:.4g}',
        *moe_lines(plan),
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
            f'  fits       {fits_word(plan)}: {_gib(per_device["total"])} '
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
            f'counts): {compiled["flops_vs_model"]:.2f} x model FLOPs / devices, '
            f'{compiled["flops_vs_hardware"]:.2f} x Megatron\'s hardware FLOPs / devices '
            f'(cost_analysis: {"n/a" if raw is None else format(raw, ".4g")}, loop bodies once)'
        )
        out.append(_by_dtype_line(compiled))
        out += _not_fp8_lines(compiled)
        out += gpu_lines(compiled)
        out += [f'  note       {note}' for note in compiled['notes']]
    return out


def _by_dtype_line(compiled):
    """The matmul FLOPs' shares by what they multiply, largest first ('f8e4m3fn 0.42, ...')."""
    by_dtype, total = compiled['matmul_flops_by_dtype'], compiled['flops'] or 1
    shares = sorted(by_dtype.items(), key=lambda item: -item[1])
    return '  by dtype   ' + ', '.join(f'{dtypes} {flops / total:.2f}' for dtypes, flops in shares)


def _not_fp8_lines(compiled):
    """With model.fp8: the matmuls left in the compute dtype, by site, each share and why."""
    left, total = compiled.get('not_fp8') or {}, compiled['flops'] or 1
    return [
        f'  not FP8    {site} {part["flops"] / total:.2f}: {part["why"]}'
        for site, part in sorted(left.items(), key=lambda item: -item[1]['flops'])
    ]


def gpu_lines(compiled):
    """The attention kernels and the overlap table of a GPU compile ([] for a CPU one)."""
    if compiled.get('target') is None:
        return []
    attention = compiled['attention']
    kernels = ', '.join(f'{k} x {n}' for k, n in sorted(attention['kernels'].items()))
    over = compiled['overlap']
    links = over['links']
    host = over.get('host') or dict(bytes=0)  # a plan's JSON without host figures
    out = [
        '  attention  '
        + (
            f'fused: {kernels}'
            if attention['fused']
            else 'NOT fused: einsums around a materialised (seq x seq) score matrix'
        ),
        f'  overlap    replayed step {over["step_s"]:.3f} s = compute at peak '
        f'{over["compute_s"]:.3f} + exposed communication {over["exposed_s"]:.3f} '
        + (f'+ exposed host transfers {host["exposed_s"]:.3f} ' if host['bytes'] else '')
        + f'({100 * over["exposed_vs_compute"]:.1f} % of compute); links per GPU: NVLink '
        f'{links["nvlink_bytes_per_s"] / 1e9:.0f} GB/s inside a node of '
        f'{links["gpus_per_node"]}, network {links["network_bytes_per_s"] / 1e9:.0f} GB/s',
        *host_lines(host, links),
        *lockstep_lines(over.get('lockstep')),
        '  time by kind (replayed s): '
        + ', '.join(
            f'{k} {v:.2f}'
            for k, v in over['time_by_kind'].items()
            if v or k != 'exposed host transfers'
        ),
        *(
            f'  {"heaviest" if i == 0 else "":<10} {row["seconds"]:.2f} s {row["kind"]}: '
            f'{row["type"]} {row["op"]}, {row["runs"]:.0f} runs'
            for i, row in enumerate(over.get('heaviest', []))
        ),
        f'  copies inside loops (over 1 MiB): {compiled["loop_copies"]["count"]}, '
        f'{compiled["loop_copies"]["bytes_per_step"] / 2**30:.1f} GiB a step; zero fills '
        f'copied from a broadcast: {compiled["loop_fills"]["count"]}, '
        f'{compiled["loop_fills"]["bytes_per_step"] / 2**30:.1f} GiB',
        f'  {"kind":<19}{"axes":<19}{"link":<9}{"GB/step":>10}{"overlapped":>12}{"exposed s":>11}',
    ]
    for row in over['table']:
        out.append(
            f'  {row["kind"]:<19}{row["axes"]:<19}{row["link"]:<9}'
            f'{row["wire_bytes"] / 1e9:>10.3g}{100 * row["overlapped"]:>11.0f}%'
            f'{row["exposed_s"]:>11.3g}'
        )
    return out


def host_lines(host, links):
    """The step's transfers to and from pinned host memory (offloaded activations)."""
    if not host['bytes']:
        return []
    return [
        f'  host       offloaded activations: {host["to_host_bytes"] / 1e9:.1f} GB a step to '
        f'host memory and {host["from_host_bytes"] / 1e9:.1f} GB back over the host link '
        f'({links["host_bytes_per_s"] / 1e9:.0f} GB/s each way), '
        f'{host["transfer_s"]:.2f} s of transfers, {host["exposed_s"]:.3f} s exposed'
    ]


def lockstep_lines(ticks):
    """The replayed step with each pipeline tick at its slowest stage (plan/lockstep.py)."""
    if not ticks:
        return []
    return [
        f'  lockstep   replayed step with each of the {ticks["ticks"]} ticks at its slowest '
        f'stage: {ticks["step_s"]:.3f} s (+{ticks["bubble_s"]:.3f} s: the bubble and the '
        f'stages\' imbalance; {ticks["slot_kinds"]} kinds of slot)'
    ]
