"""Reading an optimized HLO module's text (`compiled.as_text()`): its computations and
instructions, how many times each computation runs per step, array shapes and sizes, and the
matmul FLOPs. The collective inventory (hlo.py) is built on it.

Written by hand: neither JAX nor XLA's Python bindings expose the optimized module's
instructions, and the text is what XLA guarantees to print (`HloModule::ToString`).

Runs per step multiply the trip counts of every enclosing while loop (`known_trip_count`
backend config, else the constant its condition compares the induction variable with); a
computation reached from several call sites sums them. Conditional branches count as if taken,
unless `branch_weights` says how often each is: {scope path: [fraction per branch]}, the path
being the named scopes of the weights' keys found in the conditional's op_name, outermost
first (`parallel/branches.py`'s `branch_fractions`: which slots of its table run a chunk, the
embedding, the head); a path they do not name takes its innermost scope's weights.
"""

import collections
import math
import re
from typing import NamedTuple

from mtnlg_jax.model import flash_attention, grouped_matmul

DTYPE_BYTES = {
    'pred': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1, 'f8e4m3': 1, 'f8e5m2fnuz': 1,
    'f8e4m3fnuz': 1, 'f8e4m3b11fnuz': 1, 'f8e3m4': 1, 'f8e8m0fnu': 1,
    's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2,
    's32': 4, 'u32': 4, 'f32': 4,
    's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16,
    's4': 0.5, 'u4': 0.5, 's2': 0.25, 'u2': 0.25, 's1': 0.125, 'u1': 0.125, 'f4e2m1fn': 0.5,
    'token': 0,
}  # fmt: skip
_COMPUTATION = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')
ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([^\]]*)\]')
_CALLEES = re.compile(
    r'\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)'
)
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def matching_bracket(text, start, open_char='(', close_char=')'):
    """Index just after the bracket closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_char:
            depth += 1
        elif text[i] == close_char:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f'unbalanced {open_char!r} in HLO: {text[start : start + 80]!r}')


def split_top(text):
    """Top-level comma-separated parts of a tuple type's inside."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in '([{':
            depth += 1
        elif char in ')]}':
            depth -= 1
        elif char == ',' and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def shape_bytes(type_text):
    """Bytes of an HLO type: an array `f32[4,32]{1,0}` or a tuple of them, summed."""
    type_text = re.sub(r'/\*.*?\*/', '', type_text)
    total = 0
    for dtype, dims in ARRAY.findall(type_text):
        if dtype not in DTYPE_BYTES:
            continue
        sizes = [int(re.sub(r'\D', '', d)) for d in dims.split(',') if re.sub(r'\D', '', d)]
        total += math.prod(sizes) * DTYPE_BYTES[dtype]
    return int(total)


class Instruction:
    """One HLO instruction: name, result type text, opcode, the text after the opcode."""

    def __init__(self, name, type_text, opcode, rest, is_root=False):
        self.name, self.type_text, self.opcode, self.rest = name, type_text, opcode, rest
        self.is_root = is_root

    def callees(self):
        """(attribute, computation) pairs this instruction runs; a conditional's branches as
        ('branch', name) in branch-index order (true/false computations: index 1 / 0)."""
        found = [(attr, name) for attr, name in _CALLEES.findall(self.rest)]
        for branches in _BRANCHES.findall(self.rest):
            found += [('branch', b.strip().lstrip('%')) for b in branches.split(',') if b.strip()]
        return found

    def branch_index(self, attr, callee):
        if attr == 'true_computation':
            return 1
        if attr == 'false_computation':
            return 0
        branches = [name for a, name in self.callees() if a == 'branch']
        return branches.index(callee) if attr == 'branch' else None

    def op_name(self):
        match = _OP_NAME.search(self.rest)
        return match.group(1) if match else ''


def scope_path(op_name, scopes):
    """The names of `scopes` in an op_name, in order, each once in a row: a conditional's
    enclosing named scopes ('jvp(pipeline_first)' counts as pipeline_first)."""
    if not scopes:
        return ()
    found = re.findall('|'.join(sorted(map(re.escape, scopes), key=len, reverse=True)), op_name)
    return tuple(name for i, name in enumerate(found) if i == 0 or found[i - 1] != name)


def branch_factor(instruction, attr, callee, branch_weights, scopes):
    """How often a conditional's branch runs per run of the conditional: its weight, or 1
    (counted as taken) when the weights do not name this conditional."""
    index = instruction.branch_index(attr, callee)
    if index is None or not branch_weights:
        return 1
    path = scope_path(instruction.op_name(), scopes)
    # a path the weights do not name takes its innermost scope's weights, if they name it
    weights = branch_weights.get(path) or branch_weights.get(path[-1:])
    return weights[index] if weights and index < len(weights) else 1


def _parse_instruction(line):
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    name, rest = match.groups()
    if rest.startswith('('):
        end = matching_bracket(rest, 0)
    else:
        end = rest.find(' ')
        if end < 0:
            return None
    type_text, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r'([\w\-]+)\(', rest)
    if not op:
        return None
    is_root = line.lstrip().startswith('ROOT ')
    return Instruction(name, type_text, op.group(1), rest[op.end() - 1 :], is_root)


def parse_module(hlo_text):
    """{computation name: [Instruction]} and the ENTRY computation's name."""
    computations, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match:
                current = match.group(2)
                computations[current] = []
                if match.group(1):
                    entry = current
            continue
        if line.strip() == '}':
            current = None
            continue
        instruction = _parse_instruction(line)
        if instruction is not None:
            computations[current].append(instruction)
    if entry is None:
        raise ValueError('no ENTRY computation in the HLO text')
    return computations, entry


def trip_count(while_instruction, computations):
    """Iterations of a while loop: XLA's known_trip_count, else the constant its condition
    compares with (a `lax.scan`'s `i < n`; XLA:GPU may fuse the compare, the constant with it,
    into a fusion the condition calls); None if neither is there."""
    known = _TRIP.search(while_instruction.rest)
    if known:
        return int(known.group(1))
    constants, pending = [], [dict(while_instruction.callees()).get('condition')]
    while pending:
        for instruction in computations.get(pending.pop(), []):
            pending += [callee for attr, callee in instruction.callees() if attr == 'calls']
            scalar = re.match(r's(32|64)\[\]', instruction.type_text)
            if instruction.opcode == 'constant' and scalar:
                constants.append(int(re.match(r'\((-?\d+)\)', instruction.rest).group(1)))
    return max(constants) if constants else None


def execution_counts(computations, entry, branch_weights=None):
    """{computation: (runs per execution of the module, inside a while loop?)}.

    A while body runs trip-count times per run of the instruction; a loop of unknown trip
    count counts once (the inventory marks it with trip_count_known False); a conditional's
    branch once per run, or its weight in `branch_weights` (see the module docstring)."""
    callers = collections.defaultdict(list)  # callee -> [(caller, factor, loops)]
    unknown_trips = set()
    scopes = {name for path in (branch_weights or {}) for name in path}
    for caller, instructions in computations.items():
        for instruction in instructions:
            if instruction.opcode in ('async-done', 'async-update'):
                continue  # the same wrapped computation as its async-start: count it once
            for attr, callee in instruction.callees():
                factor, loop = 1, False
                if instruction.opcode == 'while' and attr in ('body', 'condition'):
                    trips = trip_count(instruction, computations)
                    if trips is None:
                        unknown_trips.add(callee)
                        trips = 1
                    factor, loop = trips + (attr == 'condition'), True
                elif instruction.opcode == 'conditional':
                    factor = branch_factor(instruction, attr, callee, branch_weights, scopes)
                callers[callee].append((caller, factor, loop))

    memo = {entry: (1, False)}

    def resolve(name, visiting=()):
        if name in memo:
            return memo[name]
        if name in visiting:  # recursion does not occur in HLO; stay safe
            return 0, False
        total, in_loop = 0, False
        for caller, factor, loop in callers.get(name, []):
            runs, caller_loop = resolve(caller, visiting + (name,))
            total += runs * factor
            in_loop = in_loop or (runs > 0 and (loop or caller_loop))
        memo[name] = (total, in_loop)
        return memo[name]

    counts = {name: resolve(name) for name in computations}
    return counts, unknown_trips


def ints(text):
    return [int(x) for x in re.findall(r'-?\d+', text)]


def largest_buffers(hlo_text, top=10):
    """The largest array results of any instruction in the module: [(bytes, type, opcode,
    name)], biggest first (for checks such as 'no full logits anywhere')."""
    computations, _ = parse_module(hlo_text)
    found = []
    for instructions in computations.values():
        for instruction in instructions:
            for dtype, dims in ARRAY.findall(instruction.type_text):
                found.append((shape_bytes(f'{dtype}[{dims}]'), f'{dtype}[{dims}]',
                              instruction.opcode, instruction.name))  # fmt: skip
    return sorted(found, reverse=True)[:top]


def array_shapes(hlo_text):
    """Every array shape (dtype, dims tuple) any instruction of the module produces."""
    computations, _ = parse_module(hlo_text)
    shapes = set()
    for instructions in computations.values():
        for instruction in instructions:
            text = re.sub(r'/\*.*?\*/', '', instruction.type_text)
            for dtype, dims in ARRAY.findall(text):
                sizes = tuple(int(re.sub(r'\D', '', d)) for d in dims.split(',') if d.strip())
                shapes.add((dtype, sizes))
    return shapes


def _dims(type_text):
    match = ARRAY.search(type_text)
    return [int(re.sub(r'\D', '', d)) for d in match.group(2).split(',') if d.strip()]


# Fused attention kernels and the matmuls each runs over the (batch, heads, q, k) scores:
# cuDNN's (forward 2; backward 5: flash attention recomputes the scores, then dV, dP, dQ, dK),
# named by their custom call targets, with a bias where a mask is given (JAX makes packed
# documents' segment mask a (rows, 1, seq, seq) bias: data.reset_attention_mask), and the
# Pallas flash kernels of model/flash_attention.py (forward 2; dK/dV 4 and dQ 3: each
# backward kernel recomputes the scores and their gradient), Triton custom calls named by
# their op_name (`jvp(name)/pallas_call` and kin).
FUSED_ATTENTION_MATMULS = {
    '__cudnn$fmhaSoftmax': 2,
    '__cudnn$fmhaSoftmaxBackward': 5,
    '__cudnn$fmhaScaleBiasSoftmax': 2,
    '__cudnn$fmhaScaleBiasSoftmaxBackward': 5,
    **flash_attention.KERNEL_MATMULS,
}
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_SCORES_SHAPE = re.compile(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]')
_PALLAS_KERNEL = re.compile(r'op_name="[^"]*?(\w+)\)*/pallas_call')
_FIRST_OPERAND = re.compile(r'operand_layout_constraints=\{\s*\w+\[([^\]]*)\]')
_OPERANDS = re.compile(
    r'operand_layout_constraints=\{\s*\w+\[([^\]]*)\](?:\{[^}]*\})?,\s*\w+\[([^\]]*)\]'
)


def custom_call_target(instruction):
    match = _CUSTOM_TARGET.search(instruction.rest)
    return match.group(1) if match else None


def attention_kernel(instruction):
    """The FUSED_ATTENTION_MATMULS name of a fused attention call, else None."""
    target = custom_call_target(instruction)
    if target == '__gpu$xla.gpu.triton':
        pallas = _PALLAS_KERNEL.search(instruction.rest)
        target = pallas.group(1) if pallas else None
    return target if target in FUSED_ATTENTION_MATMULS else None


def attention_kernel_counts(hlo_text):
    """{fused attention kernel: calls in the module} (cuDNN's or the Pallas flash kernels); reads
    only the custom-call lines, not the whole module again."""
    calls = (_parse_instruction(line) for line in hlo_text.splitlines() if ' custom-call(' in line)
    kernels = (attention_kernel(call) for call in calls if call is not None)
    return dict(collections.Counter(k for k in kernels if k))


def pallas_kernel(instruction):
    """The name a Pallas kernel's Triton custom call was given (its op_name), else None."""
    if custom_call_target(instruction) != '__gpu$xla.gpu.triton':
        return None
    match = _PALLAS_KERNEL.search(instruction.rest)
    return match.group(1) if match else None


def grouped_matmul_flops(instruction):
    """FLOPs of one call of model/grouped_matmul.py's kernels: 2 x its tiles' rows x K x N,
    every tile counted (the tiles it skips as unused included: an upper bound by at most one
    tile an expert and the unused ones); 0 for any other instruction."""
    kernel = pallas_kernel(instruction)
    if kernel not in grouped_matmul.KERNELS:
        return 0
    first, second = (ints(dims) for dims in _OPERANDS.search(instruction.rest).groups())
    width = second[-1] if kernel == grouped_matmul.WEIGHTS else _dims(instruction.type_text)[-1]
    return 2 * math.prod(first) * width


def fused_attention_flops(instruction):
    """FLOPs of one fused-attention call: the Pallas flash kernels' by the score blocks they
    compute (flash_attention.score_area), cuDNN's counted dense (2 x scores x head_dim per
    matmul, as the model's 12 L H Q T counts attention; its causal tiles are not ours to
    know, and it skips most of the masked ones, so the hardware does less); 0 for any other
    instruction."""
    kernel = attention_kernel(instruction)
    if kernel is None:
        return 0
    matmuls = FUSED_ATTENTION_MATMULS[kernel]
    if kernel in flash_attention.KERNEL_MATMULS:  # q: (batch, seq, heads, head_dim), k
        first, second = (ints(dims) for dims in _OPERANDS.search(instruction.rest).groups())
        batch, seq, heads, head_dim = first
        lanes = flash_attention.lane_width(head_dim)  # what its tiles multiply, padding too
        keys = second[1]
        block = flash_tile(kernel, seq, keys, head_dim, _GRID.findall(instruction.rest))
        return 2 * matmuls * batch * heads * lanes * flash_attention.score_area(seq, keys, block)
    scores = _SCORES_SHAPE.search(instruction.rest)
    if not scores:
        return 0
    head_dim = _dims(split_top(instruction.type_text.strip()[1:-1])[0])[-1]
    return 2 * matmuls * math.prod(ints(scores.group(1))) * head_dim


_GRID = re.compile(r'"?grid_([xyz])"?\s*[:=]\s*"?(\d+)')


def flash_tile(kernel, seq, keys, head_dim, grid):
    """The tile of a flash kernel's call that rounds its causal work (the forward's query
    block, the backward's block), from its Triton grid where the call has one ([(axis,
    size)]: the forward's x is seq / block, dK dV's z keys / block, dQ's z seq / block), else
    as flash_attention.blocks chooses it for an A100 (whose backward block is half Hopper's:
    seq x 16 fewer of the seq^2 / 2 elements). The forward's key block divides its query
    block (flash_attention._BLOCKS), so the keys it walks for a query block end at the
    block's last query: the key block does not count."""
    sizes = {axis: int(size) for axis, size in grid}
    along, length = {
        flash_attention.FORWARD: ('x', seq),
        flash_attention.KEY_VALUE: ('z', keys),
        flash_attention.QUERY: ('z', seq),
    }[kernel]
    if sizes.get(along):
        return length // sizes[along]
    chosen = flash_attention.blocks(seq, head_dim)
    return chosen.forward_q if kernel == flash_attention.FORWARD else chosen.backward


_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]')


def instruction_flops(instruction, types):
    """Matmul FLOPs of one run of one instruction (not of what it calls): a dot's 2 x result
    elements x contracted elements, a ragged dot's by the rows it multiplies (`_ragged_groups`),
    the same for a cuBLAS GEMM call (XLA:GPU's, e.g. with
    --xla_gpu_enable_triton_gemm=false), or a fused attention call's; types: {name: type
    text} of its computation (for the operand)."""
    if instruction.opcode == 'custom-call':
        target = custom_call_target(instruction) or ''
        if not target.startswith('__cublas$'):
            return fused_attention_flops(instruction) + grouped_matmul_flops(instruction)
        contracting = _GEMM_CONTRACTING.search(instruction.rest)
        result = split_top(instruction.type_text.strip()[1:-1])[0]
        if instruction.type_text.strip()[:1] != '(':
            result = instruction.type_text
    elif instruction.opcode in ('dot', 'ragged-dot'):
        contracting = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', instruction.rest)
        result = instruction.type_text
    else:
        return 0
    lhs = re.match(r'\(\s*%?([\w.\-]+)', instruction.rest).group(1)
    lhs_dims = _dims(types[lhs])
    contracted = math.prod(lhs_dims[i] for i in ints(contracting.group(1)))
    return 2 * math.prod(_dims(result)) * contracted // _ragged_groups(instruction, contracting)


def _ragged_groups(instruction, contracting):
    """A ragged dot's groups that its result counts apart but its rows do not share: 1
    unless its ragged dimension is contracted (a grouped matmul's weight gradient, whose
    result (groups, ...) has each group summed over its own rows only); 1 for a dot. A ragged
    dot over its rows (the forward, the input gradient) multiplies each row by one group's
    weights: a dot's count of its result, not groups x it, as XLA's dense lowering does."""
    ragged = re.search(r'lhs_ragged_dims=\{([\d,]*)\}', instruction.rest)
    if instruction.opcode != 'ragged-dot' or not ragged:
        return 1
    if set(ints(ragged.group(1))) & set(ints(contracting.group(1))):
        return _dims(instruction.type_text)[0]
    return 1


def computation_flops(instructions):
    """Matmul FLOPs of one run of a computation's own instructions (callees not included)."""
    types = {instruction.name: instruction.type_text for instruction in instructions}
    return sum(instruction_flops(instruction, types) for instruction in instructions)


def dot_flops(hlo_text, branch_weights=None):
    """Matmul FLOPs one device runs per step: every dot (2 x result elements x contracted
    elements) and fused attention call (`fused_attention_flops`), times the runs of its
    computation (inside fusions and loop bodies alike; conditional branches weighted as in
    `collective_inventory`). XLA's cost_analysis() counts a while body once, whatever its trip
    count, and gives nothing for a GPU compile."""
    return sum(matmul_flops_by_dtype(hlo_text, branch_weights).values())


def matmul_flops_by_dtype(hlo_text, branch_weights=None):
    """dot_flops split by what the matmuls multiply: {'bf16': ..., 'f8e4m3fn': ...,
    'f8e5m2 x f8e4m3fn': ...}, keyed by the element types of the two operands (one name when
    they agree): a dot's, a cuBLAS GEMM call's (`__cublas$lt$matmul$f8` multiplies FP8
    operands into an f32 or bf16 result: its result's type would read it as f32), each
    operand followed back through layout-only instructions (bitcast, copy, transpose,
    reshape) and a fusion's parameters to the value it multiplies; a convert is not followed:
    a dot of converted FP8 values multiplies the wider type. Any other kernel call (fused
    attention, the grouped matmul) by its result's type."""
    by_dtype = collections.Counter()
    for matmul in matmuls(hlo_text, branch_weights):
        by_dtype[matmul.dtypes] += matmul.flops
    return dict(by_dtype)


class Matmul(NamedTuple):
    """One matmul instruction of a module: its FLOPs a step (times its runs), what it
    multiplies (a matmul_flops_by_dtype key), and {name: type text} of its computation."""

    instruction: Instruction
    flops: float
    dtypes: str
    types: dict

    def shapes(self):
        """The dimensions of its result and of its first two operands."""
        names = [n for n in _operand_names(self.instruction)[:2] if n in self.types]
        return [_dims(self.instruction.type_text)] + [_dims(self.types[n]) for n in names]


def matmuls(hlo_text, branch_weights=None):
    """Every matmul instruction that runs (a dot, a cuBLAS GEMM, a kernel call), as Matmuls."""
    computations, entry = parse_module(hlo_text)
    counts, _ = execution_counts(computations, entry, branch_weights)
    operand_types = OperandTypes(computations)
    for name, instructions in computations.items():
        runs = counts[name][0]
        if not runs:
            continue
        types = {instruction.name: instruction.type_text for instruction in instructions}
        for instruction in instructions:
            flops = instruction_flops(instruction, types)
            if flops:
                yield Matmul(instruction, flops * runs, operand_types(instruction, name), types)


class OperandTypes:
    """operand_types(instruction, computation): what a matmul of the parsed module multiplies,
    as `matmul_flops_by_dtype` keys it ('bf16', 'f8e5m2 x f8e4m3fn', ...)."""

    def __init__(self, computations):
        self.callers = _fusion_operands(computations)
        self.named = {name: {i.name: i for i in body} for name, body in computations.items()}

    def __call__(self, instruction, computation):
        return _operand_dtypes(instruction, computation, self.named, self.callers)


def is_fp8(dtypes):
    """Whether a `matmul_flops_by_dtype` key multiplies FP8 by FP8 (an FP8 tensor-core GEMM)."""
    return all(part.startswith('f8') for part in dtypes.split(' x '))


_LAYOUT_ONLY = ('bitcast', 'copy', 'transpose', 'reshape')
_PARAMETER = re.compile(r'^\s*\(?\s*(\d+)\s*\)')


def _operand_names(instruction):
    """The names of an instruction's operands, in order."""
    end = matching_bracket(instruction.rest, instruction.rest.index('('))
    return re.findall(r'%([\w.\-]+)', instruction.rest[:end])


def _fusion_operands(computations):
    """{fused computation: the operand names of the one fusion that calls it, and the
    computation holding that fusion}: how a fusion's parameter is followed to its caller."""
    callers = {}
    for name, instructions in computations.items():
        for instruction in instructions:
            if instruction.opcode != 'fusion':
                continue
            for attr, callee in instruction.callees():
                if attr == 'calls':
                    callers[callee] = (name, _operand_names(instruction))
    return callers


def _operand_dtypes(instruction, computation, named, callers):
    """'a' or 'a x b': the element types a dot or a cuBLAS GEMM multiplies (any other call:
    its result's). An FP8 GEMM call (its target ends in `$f8`) whose operands are not read
    back to FP8 values (another XLA's HLO around them: the H200's jaxlib 0.11.2 read as f32)
    is 'f8' by its target: cuBLASLt takes FP8 operands there and nothing else."""
    target = custom_call_target(instruction) or ''
    if instruction.opcode != 'dot' and not target.startswith('__cublas$'):
        return ARRAY.search(instruction.type_text).group(1)
    dtypes = [
        _source_dtype(operand, computation, named, callers)
        for operand in _operand_names(instruction)[:2]
    ]
    if target.endswith('$f8') and not is_fp8(' x '.join(dtypes)):
        return 'f8'
    return dtypes[0] if dtypes[0] == dtypes[-1] else ' x '.join(dtypes)


def _source_dtype(name, computation, named, callers, depth=0):
    """The element type of the value `name` (in `computation`) holds before layout-only
    instructions and fusion parameters: what a matmul reading it multiplies; named:
    {computation: {instruction name: Instruction}}."""
    instruction = named[computation][name]
    dtype = ARRAY.search(instruction.type_text).group(1)
    if depth > 64:
        return dtype
    if instruction.opcode in _LAYOUT_ONLY:
        source = _operand_names(instruction)[0]
        return _source_dtype(source, computation, named, callers, depth + 1)
    if instruction.opcode == 'parameter' and computation in callers:
        caller, operands = callers[computation]
        index = int(_PARAMETER.match(instruction.rest).group(1))
        if index < len(operands):
            return _source_dtype(operands[index], caller, named, callers, depth + 1)
    return dtype
