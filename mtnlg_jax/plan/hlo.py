"""The collective inventory of an optimized HLO module: what each device sends, over which mesh
axes, how many times per step.

    compiled.as_text()  ->  computations  ->  call graph from ENTRY (while bodies x trip count)
                        ->  every all-reduce / all-gather / reduce-scatter / collective-permute
                            / all-to-all: result shape, replica groups -> mesh axes, runs/step

Written by hand: neither JAX nor XLA's Python bindings expose the optimized module's
instructions, and the text is what XLA guarantees to print (`HloModule::ToString`).

Device ids in replica groups are the executable's logical ids: position i in the mesh's
flattened device array, so id -> np.unravel_index(id, mesh shape) gives its coordinates
(whatever the physical Device.id; also inside shard_map). Replica groups come in four forms:

    {{0,2},{1,3}}                               explicit lists ({} = all devices, one group)
    [4,2]<=[2,2,2]T(1,0,2)                      iota: arange(8).reshape(2,2,2).transpose(1,0,2)
                                                .reshape(4,2), one group per row
    mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}
                                                XLA's mesh form: ids laid out over its own mesh,
                                                groups vary along the named axes ('a:(1)2' is a
                                                sub-axis: `size` after `pre_size` major part)
    source_target_pairs={{0,2},{2,0}}           collective-permute

Async pairs (all-gather-start / -done, async-start wrapping a reduce-scatter, ...) count once, at
the start. `count` multiplies the trip counts of every enclosing while loop (`known_trip_count`
backend config, else the constant its condition compares the induction variable with); a
computation reached from several call sites sums them. Conditional branches count as if taken,
unless `branch_weights` says how often each is: {scope path: [fraction per branch]}, the path
being the named scopes of the weights' keys found in the conditional's op_name, outermost
first (the pipeline engine's `branch_fractions`: which slots of its table run a chunk, the
embedding, the head).
"""

import collections
import math
import re

import numpy as np

COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute', 'all-to-all')
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
_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([^\]]*)\]')
_CALLEES = re.compile(
    r'\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)'
)
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_IOTA_GROUPS = re.compile(r'replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?')


def _matching(text, start, open_char='(', close_char=')'):
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


def _split_top(text):
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
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype not in DTYPE_BYTES:
            continue
        sizes = [int(re.sub(r'\D', '', d)) for d in dims.split(',') if re.sub(r'\D', '', d)]
        total += math.prod(sizes) * DTYPE_BYTES[dtype]
    return int(total)


class Instruction:
    """One HLO instruction: name, result type text, opcode, the text after the opcode."""

    def __init__(self, name, type_text, opcode, rest):
        self.name, self.type_text, self.opcode, self.rest = name, type_text, opcode, rest

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


def _branch_factor(instruction, attr, callee, branch_weights, scopes):
    """How often a conditional's branch runs per run of the conditional: its weight, or 1
    (counted as taken) when the weights do not name this conditional."""
    index = instruction.branch_index(attr, callee)
    if index is None or not branch_weights:
        return 1
    weights = branch_weights.get(scope_path(instruction.op_name(), scopes))
    return weights[index] if weights and index < len(weights) else 1


def _parse_instruction(line):
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    name, rest = match.groups()
    if rest.startswith('('):
        end = _matching(rest, 0)
    else:
        end = rest.find(' ')
        if end < 0:
            return None
    type_text, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r'([\w\-]+)\(', rest)
    if not op:
        return None
    return Instruction(name, type_text, op.group(1), rest[op.end() - 1 :])


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


def _trip_count(while_instruction, computations):
    """Iterations of a while loop: XLA's known_trip_count, else the constant its condition
    compares with (a `lax.scan`'s `i < n`); None if neither is there."""
    known = _TRIP.search(while_instruction.rest)
    if known:
        return int(known.group(1))
    condition = dict(while_instruction.callees()).get('condition')
    constants = []
    for instruction in computations.get(condition, []):
        if instruction.opcode == 'constant' and re.match(r's(32|64)\[\]', instruction.type_text):
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
                    trips = _trip_count(instruction, computations)
                    if trips is None:
                        unknown_trips.add(callee)
                        trips = 1
                    factor, loop = trips + (attr == 'condition'), True
                elif instruction.opcode == 'conditional':
                    factor = _branch_factor(instruction, attr, callee, branch_weights, scopes)
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


def _ints(text):
    return [int(x) for x in re.findall(r'-?\d+', text)]


def _iota(reshape, transpose):
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return ids.transpose(transpose) if transpose else ids


def _mesh_form_groups(axes_text, device_ids_text, grouped_text):
    """Groups of XLA's mesh form: mesh['a'=2,'b'=4], device_ids=(...) {'a'}."""
    names, sizes = [], []
    for part in _split_top(axes_text):
        name, size = part.rsplit('=', 1)
        names.append(name.strip().strip('\'"'))
        sizes.append(int(size))
    if device_ids_text:
        iota = re.match(r'\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*$', device_ids_text)
        if iota:
            ids = _iota(_ints(iota.group(1)), _ints(iota.group(2) or ''))
        else:
            ids = np.array(_ints(device_ids_text))
    else:
        ids = np.arange(math.prod(sizes))
    ids = ids.reshape(sizes)
    # Split every mesh axis that a sub-axis refers to into (major, size, minor) dimensions.
    grouped = []
    for ref in _split_top(grouped_text):
        match = re.match(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?$", ref.strip())
        axis = names.index(match.group(1))
        if match.group(2):
            pre, size = int(match.group(2)), int(match.group(3))
            grouped.append((axis, pre, size))
        else:
            grouped.append((axis, None, None))
    flat_dims, keep = [], []
    for axis, size in enumerate(sizes):
        subs = sorted((pre, sz) for a, pre, sz in grouped if a == axis and pre is not None)
        whole = any(a == axis and pre is None for a, pre, _ in grouped)
        if whole or not subs:
            flat_dims.append(size)
            keep.append(whole)
            continue
        covered = 1
        for pre, sz in subs:
            if pre > covered:
                flat_dims.append(pre // covered)
                keep.append(False)
            flat_dims.append(sz)
            keep.append(True)
            covered = pre * sz
        if size > covered:
            flat_dims.append(size // covered)
            keep.append(False)
    ids = ids.reshape(flat_dims)
    group_axes = [i for i, k in enumerate(keep) if k]
    other_axes = [i for i, k in enumerate(keep) if not k]
    ids = ids.transpose(other_axes + group_axes)
    return ids.reshape(-1, math.prod(flat_dims[i] for i in group_axes)).tolist()


def _mesh_form_parts(text, start):
    """(axes text, device ids text or None, grouped axes text) of a mesh form at text[start]."""
    end = _matching(text, start, '[', ']')
    axes = text[start + 1 : end - 1]
    device_ids = None
    ids = re.match(r',\s*device_ids=\(', text[end:])
    if ids:
        open_at = end + ids.end() - 1
        close = _matching(text, open_at)
        device_ids, end = text[open_at + 1 : close - 1], close
    grouped = re.match(r'\s*\{([^}]*)\}', text[end:])
    return axes, device_ids, grouped.group(1)


def replica_groups(instruction, num_devices):
    """Device-id groups of a collective (a list of lists), or pairs for a collective-permute."""
    rest = instruction.rest
    pairs = re.search(r'source_target_pairs=\{(.*?)\}\}', rest)
    if pairs:
        return [_ints(p) for p in re.findall(r'\{([\d,\s]+)\}', pairs.group(1) + '}')]
    if 'source_target_pairs={}' in rest:
        return []
    iota = _IOTA_GROUPS.search(rest)
    if iota:
        groups, size = int(iota.group(1)), int(iota.group(2))
        ids = _iota(_ints(iota.group(3)), _ints(iota.group(4) or ''))
        return ids.reshape(groups, size).tolist()
    mesh = rest.find('replica_groups=mesh[')
    if mesh >= 0:
        return _mesh_form_groups(*_mesh_form_parts(rest, mesh + len('replica_groups=mesh')))
    explicit = re.search(r'replica_groups=\{(.*?)\}(?:,|$)', rest + ',')
    if explicit:
        inner = re.findall(r'\{([\d,\s]*)\}', explicit.group(1) + '}')
        groups = [_ints(g) for g in inner if g.strip()]
        if groups:
            return groups
    return [list(range(num_devices))]  # replica_groups={} or none: every device, one group


def _mesh_shape(mesh):
    """(axis names, sizes) of a jax Mesh, or of a {name: size} mapping."""
    if hasattr(mesh, 'axis_names') and hasattr(mesh, 'devices'):
        return tuple(mesh.axis_names), tuple(np.shape(mesh.devices))
    return tuple(mesh), tuple(mesh.values())


def spanned_axes(groups, axis_names, sizes, pairs=False):
    """Mesh axes along which members of a group (or a source and its target) differ, in mesh
    order."""
    varying = set()
    for group in groups:
        if len(group) < 2:
            continue
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T
        varying.update(np.nonzero((coords != coords[0]).any(axis=0))[0].tolist())
    return tuple(axis_names[i] for i in sorted(varying))


def _collective_kind(opcode):
    base = opcode[: -len('-start')] if opcode.endswith('-start') else opcode
    return base if base in COLLECTIVES else None


def _payload_type(instruction, kind):
    """Type text of the data a collective produces. An -start form returns a tuple (operands,
    results[, contexts]); its results are the second element (all-reduce-start: the type)."""
    if not instruction.opcode.endswith('-start') or kind == 'all-reduce':
        return instruction.type_text
    text = instruction.type_text.strip()
    if text.startswith('('):
        parts = _split_top(text[1:-1])
        if len(parts) >= 2:
            return parts[1]
    return text


def wire_bytes(kind, full_bytes, group_size, self_fraction=0.0):
    """Bytes one device sends for one run of a collective, ring algorithms (S = full buffer):
    all-reduce 2 (n-1)/n S; all-gather, reduce-scatter, all-to-all (n-1)/n S; permute S."""
    if kind == 'collective-permute':
        return full_bytes * (1.0 - self_fraction)
    if group_size <= 1:
        return 0.0
    share = (group_size - 1) / group_size
    return (2 * share if kind == 'all-reduce' else share) * full_bytes


def collective_inventory(hlo_text, mesh, branch_weights=None):
    """Every collective of an optimized HLO module (`compiled.as_text()`), one dict each:

        kind         'all-reduce' | 'all-gather' | 'reduce-scatter' | 'collective-permute'
                     | 'all-to-all' (async -start/-done pairs count once, as the start)
        axes         tuple of mesh axis names the replica groups (or permute pairs) span, in
                     mesh order; () when every group is a single device
        bytes        bytes per device of the full buffer: the result of an all-reduce,
                     all-gather, permute or all-to-all, the operand of a reduce-scatter
        count        runs per step: product of the enclosing while loops' trip counts
        in_loop      True if some enclosing computation is a while body
        wire_bytes   bytes one device sends per run (ring algorithms, see `wire_bytes`)
        group_size   devices per replica group (2 for a permute)
        name, computation, trip_count_known

    mesh: a jax Mesh (or {axis name: size}) whose flattened device array the executable runs
    on, e.g. the train step's `setup.mesh`. branch_weights: see the module docstring (count
    is then a mean over the devices that run different branches, and may be fractional).
    """
    axis_names, sizes = _mesh_shape(mesh)
    num_devices = math.prod(sizes)
    computations, entry = parse_module(hlo_text)
    counts, unknown_trips = execution_counts(computations, entry, branch_weights)
    inventory = []
    for computation, instructions in computations.items():
        runs, in_loop = counts[computation]
        for instruction in instructions:
            kind = _collective_kind(instruction.opcode)
            if kind is None or runs == 0:  # an async-start's wrapped computation holds its own
                continue
            groups = replica_groups(instruction, num_devices)
            payload = shape_bytes(_payload_type(instruction, kind))
            if kind == 'collective-permute':
                group_size = 2
                moving = [p for p in groups if len(p) == 2 and p[0] != p[1]]
                self_fraction = 1.0 - len(moving) / len(groups) if groups else 1.0
                axes = spanned_axes(moving, axis_names, sizes)
            else:
                group_size = max((len(g) for g in groups), default=1)
                self_fraction = 0.0
                axes = spanned_axes(groups, axis_names, sizes)
            full = payload * group_size if kind == 'reduce-scatter' else payload
            inventory.append(
                dict(
                    kind=kind,
                    axes=axes,
                    bytes=int(full),
                    count=int(runs) if float(runs).is_integer() else float(runs),
                    in_loop=bool(in_loop),
                    wire_bytes=float(wire_bytes(kind, full, group_size, self_fraction)),
                    group_size=int(group_size),
                    name=instruction.name,
                    computation=computation,
                    trip_count_known=computation not in unknown_trips
                    and not _under_unknown(computation, unknown_trips, computations),
                )
            )
    return inventory


def _under_unknown(computation, unknown_trips, computations):
    """Whether a loop of unknown trip count encloses the computation (rare: XLA annotates the
    loops it makes from scans)."""
    if not unknown_trips:
        return False
    reached, frontier = set(unknown_trips), list(unknown_trips)
    while frontier:
        for instruction in computations.get(frontier.pop(), []):
            for _, callee in instruction.callees():
                if callee not in reached:
                    reached.add(callee)
                    frontier.append(callee)
    return computation in reached


def totals(inventory):
    """{(kind, axes): {'ops', 'count', 'bytes', 'wire_bytes'}}: per step (x count), summed."""
    out = collections.defaultdict(lambda: dict(ops=0, count=0, bytes=0, wire_bytes=0.0))
    for entry in inventory:
        total = out[entry['kind'], entry['axes']]
        total['ops'] += 1
        total['count'] += entry['count']
        total['bytes'] += entry['bytes'] * entry['count']
        total['wire_bytes'] += entry['wire_bytes'] * entry['count']
    return dict(out)


def axes_key(axes):
    """'tensor', 'data+stage', or 'none' for a tuple of mesh axes: a JSON-friendly key."""
    return '+'.join(axes) if axes else 'none'


def totals_json(inventory):
    """totals() as {kind: {axes_key: {...}}}, JSON-serialisable."""
    nested = collections.defaultdict(dict)
    for (kind, axes), total in sorted(totals(inventory).items()):
        nested[kind][axes_key(axes)] = total
    return dict(nested)


def wire_bytes_by_axis(inventory):
    """{axes_key: bytes one device sends per step over those axes}, all kinds summed."""
    out = collections.defaultdict(float)
    for entry in inventory:
        out[axes_key(entry['axes'])] += entry['wire_bytes'] * entry['count']
    return dict(out)


def largest_buffers(hlo_text, top=10):
    """The largest array results of any instruction in the module: [(bytes, type, opcode,
    name)], biggest first (for checks such as 'no full logits anywhere')."""
    computations, _ = parse_module(hlo_text)
    found = []
    for instructions in computations.values():
        for instruction in instructions:
            for dtype, dims in _ARRAY.findall(instruction.type_text):
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
            for dtype, dims in _ARRAY.findall(text):
                sizes = tuple(int(re.sub(r'\D', '', d)) for d in dims.split(',') if d.strip())
                shapes.add((dtype, sizes))
    return shapes


def _dims(type_text):
    match = _ARRAY.search(type_text)
    return [int(re.sub(r'\D', '', d)) for d in match.group(2).split(',') if d.strip()]


def dot_flops(hlo_text, branch_weights=None):
    """Matmul FLOPs one device runs per step: 2 x result elements x contracted elements for
    every dot, times the runs of its computation (inside fusions and loop bodies alike;
    conditional branches weighted as in `collective_inventory`). XLA's cost_analysis() counts
    a while body once, whatever its trip count."""
    computations, entry = parse_module(hlo_text)
    counts, _ = execution_counts(computations, entry, branch_weights)
    total = 0
    for name, instructions in computations.items():
        runs = counts[name][0]
        if not runs:
            continue
        types = {instruction.name: instruction.type_text for instruction in instructions}
        for instruction in instructions:
            if instruction.opcode != 'dot':
                continue
            lhs = re.match(r'\(\s*%?([\w.\-]+)', instruction.rest).group(1)
            contracting = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', instruction.rest)
            lhs_dims = _dims(types[lhs])
            contracted = math.prod(lhs_dims[i] for i in _ints(contracting.group(1)))
            total += 2 * math.prod(_dims(instruction.type_text)) * contracted * runs
    return total
