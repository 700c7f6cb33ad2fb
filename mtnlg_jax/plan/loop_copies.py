"""Copies the compiled step makes inside its loops: buffers XLA could not update in place.

A `copy` in a while body, or in a conditional or call the body runs, moves its whole buffer
on every run: the pipeline engine's 868 ticks (530 B) turn one copy of its fp32 accumulators
into terabytes a step. Read from the optimized HLO with the plan's own parser
(plan/hlo_module.py): an instruction `copy` (or `copy-start`), or a fusion whose fused
computation is only a copy (XLA wraps a lone copy so), in a computation that runs inside a
loop; bytes are the copy's result, runs per step from hlo_module.execution_counts (a
conditional's branches counted as taken unless branch_weights weighs them).
"""

from mtnlg_jax.plan import hlo_module

_COPIES = ('copy', 'copy-start')


def loop_copies(hlo_text, min_bytes=1 << 20, branch_weights=None):
    """[{computation, name, type, bytes, runs}] of every copy of min_bytes or more inside a
    loop, largest first; runs: per step."""
    computations, entry = hlo_module.parse_module(hlo_text)
    counts, _ = hlo_module.execution_counts(computations, entry, branch_weights)
    fused = {
        callee
        for instructions in computations.values()
        for instruction in instructions
        if instruction.opcode == 'fusion'
        for attr, callee in instruction.callees()
        if attr == 'calls'
    }
    found = []
    for name, instructions in computations.items():
        runs, in_loop = counts.get(name, (0, False))
        if name in fused or not in_loop or not runs:
            continue
        for instruction in instructions:
            if not _is_copy(instruction, computations):
                continue
            size = hlo_module.shape_bytes(instruction.type_text)
            if size >= min_bytes:
                found.append(
                    dict(computation=name, name=instruction.name,
                         type=instruction.type_text, bytes=size, runs=runs)
                )  # fmt: skip
    return sorted(found, key=lambda c: -c['bytes'])


def _is_copy(instruction, computations):
    if instruction.opcode in _COPIES:
        return True
    if instruction.opcode != 'fusion':
        return False
    body = [computations.get(c, []) for a, c in instruction.callees() if a == 'calls']
    ops = [i.opcode for i in (body[0] if body else []) if i.opcode != 'parameter']
    return ops == ['copy']


def bytes_per_step(copies):
    """Bytes the copies move per step (each copy's result x its runs)."""
    return sum(c['bytes'] * c['runs'] for c in copies)
