"""Copies the compiled step makes inside its loops: buffers XLA could not update in place.

A `copy` in a while body, or in a conditional or call the body runs, moves its whole buffer
on every run: the pipeline engine's 868 ticks (530 B) turn one copy of its fp32 accumulators
into terabytes a step. Read from the optimized HLO with the plan's own parser
(plan/hlo_module.py): an instruction `copy` (or `copy-start`), or a fusion whose fused
computation is only a copy (XLA wraps a lone copy so), in a computation that runs inside a
loop; bytes are the copy's result, runs per step from hlo_module.execution_counts (a
conditional's branches counted as taken unless branch_weights weighs them).

A copy of a broadcast constant is a fill, not a copy: XLA writes one zero buffer and copies
it into each further output of the same shape (a scan's stacked gradients of two weights of
one shape, a skipped layer's zero residuals). It costs one write of its bytes, as the
broadcast it stands for would; `loop_fills` lists them apart, `loop_copies` leaves them out.
"""

import re

from mtnlg_jax.plan import hlo_module

_COPIES = ('copy', 'copy-start')
_CONSTANT = ('broadcast', 'constant', 'parameter', 'bitcast', 'reshape')


def loop_copies(hlo_text, min_bytes=1 << 20, branch_weights=None):
    """[{computation, name, type, bytes, runs}] of every copy of a live buffer, min_bytes or
    more, inside a loop, largest first; runs: per step."""
    return copies_and_fills(hlo_text, min_bytes, branch_weights)[0]


def loop_fills(hlo_text, min_bytes=1 << 20, branch_weights=None):
    """The same of the copies of a broadcast constant (the module docstring)."""
    return copies_and_fills(hlo_text, min_bytes, branch_weights)[1]


def copies_and_fills(hlo_text, min_bytes=1 << 20, branch_weights=None):
    """(loop_copies, loop_fills) from one reading of the module."""
    found = _in_loops(hlo_text, min_bytes, branch_weights)
    return [c for c in found if not c['fill']], [c for c in found if c['fill']]


def _in_loops(hlo_text, min_bytes, branch_weights):
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
        by_name = {i.name: i for i in instructions}
        for instruction in instructions:
            if not _is_copy(instruction, computations):
                continue
            size = hlo_module.shape_bytes(instruction.type_text)
            if size >= min_bytes:
                fill = _of_a_constant(instruction, by_name, computations)
                found.append(
                    dict(computation=name, name=instruction.name, type=instruction.type_text,
                         bytes=size, runs=runs, fill=fill)
                )  # fmt: skip
    return sorted(found, key=lambda c: -c['bytes'])


def _is_copy(instruction, computations):
    if instruction.opcode in _COPIES:
        return True
    if instruction.opcode != 'fusion':
        return False
    return _fused_ops(instruction, computations) == ['copy']


def _fused_ops(instruction, computations):
    body = [computations.get(c, []) for a, c in instruction.callees() if a == 'calls']
    return [i.opcode for i in (body[0] if body else []) if i.opcode != 'parameter']


def _of_a_constant(copy, by_name, computations):
    """Whether the copy's operand is a broadcast constant (or a fusion of nothing else)."""
    first = re.match(r'\(\s*%?([\w.\-]+)', copy.rest)
    operand = by_name.get(first.group(1)) if first else None
    if operand is None:
        return False
    if operand.opcode in ('broadcast', 'constant'):
        return True
    ops = _fused_ops(operand, computations) if operand.opcode == 'fusion' else None
    return bool(ops) and 'broadcast' in ops and all(op in _CONSTANT for op in ops)


def bytes_per_step(copies):
    """Bytes the copies move per step (each copy's result x its runs)."""
    return sum(c['bytes'] * c['runs'] for c in copies)
