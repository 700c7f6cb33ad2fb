"""The collective inventory of an optimized HLO module: what each device sends, over which mesh
axes, how many times per step.

    compiled.as_text()  ->  computations  ->  call graph from ENTRY (while bodies x trip count)
                        ->  every all-reduce / all-gather / reduce-scatter / collective-permute
                            / all-to-all / ragged-all-to-all: result shape, replica groups ->
                            mesh axes, runs/step

The module's text is read by hlo_module.py (computations, runs per step, weighted conditional
branches); this file maps replica groups to mesh axes and sizes what each collective sends.

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
the start. `count` is the runs per step of its computation (hlo_module.execution_counts).
"""

import collections
import math
import re

import numpy as np

from mtnlg_jax.plan.hlo_module import (
    ints,
    matching_bracket,
    split_top,
    execution_counts,
    parse_module,
    shape_bytes,
)

COLLECTIVES = (
    'all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute', 'all-to-all',
    'ragged-all-to-all',
)  # fmt: skip
_IOTA_GROUPS = re.compile(r'replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?')


def _iota(reshape, transpose):
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return ids.transpose(transpose) if transpose else ids


def _mesh_form_groups(axes_text, device_ids_text, grouped_text):
    """Groups of XLA's mesh form: mesh['a'=2,'b'=4], device_ids=(...) {'a'}."""
    names, sizes = [], []
    for part in split_top(axes_text):
        name, size = part.rsplit('=', 1)
        names.append(name.strip().strip('\'"'))
        sizes.append(int(size))
    if device_ids_text:
        iota = re.match(r'\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*$', device_ids_text)
        if iota:
            ids = _iota(ints(iota.group(1)), ints(iota.group(2) or ''))
        else:
            ids = np.array(ints(device_ids_text))
    else:
        ids = np.arange(math.prod(sizes))
    ids = ids.reshape(sizes)
    # Split every mesh axis that a sub-axis refers to into (major, size, minor) dimensions.
    grouped = []
    for ref in split_top(grouped_text):
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
    end = matching_bracket(text, start, '[', ']')
    axes = text[start + 1 : end - 1]
    device_ids = None
    ids = re.match(r',\s*device_ids=\(', text[end:])
    if ids:
        open_at = end + ids.end() - 1
        close = matching_bracket(text, open_at)
        device_ids, end = text[open_at + 1 : close - 1], close
    grouped = re.match(r'\s*\{([^}]*)\}', text[end:])
    return axes, device_ids, grouped.group(1)


def replica_groups(instruction, num_devices):
    """Device-id groups of a collective (a list of lists), or pairs for a collective-permute."""
    rest = instruction.rest
    pairs = re.search(r'source_target_pairs=\{(.*?)\}\}', rest)
    if pairs:
        return [ints(p) for p in re.findall(r'\{([\d,\s]+)\}', pairs.group(1) + '}')]
    if 'source_target_pairs={}' in rest:
        return []
    iota = _IOTA_GROUPS.search(rest)
    if iota:
        groups, size = int(iota.group(1)), int(iota.group(2))
        ids = _iota(ints(iota.group(3)), ints(iota.group(4) or ''))
        return ids.reshape(groups, size).tolist()
    mesh = rest.find('replica_groups=mesh[')
    if mesh >= 0:
        return _mesh_form_groups(*_mesh_form_parts(rest, mesh + len('replica_groups=mesh')))
    explicit = re.search(r'replica_groups=\{(.*?)\}(?:,|$)', rest + ',')
    if explicit:
        inner = re.findall(r'\{([\d,\s]*)\}', explicit.group(1) + '}')
        groups = [ints(g) for g in inner if g.strip()]
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
        parts = split_top(text[1:-1])
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
                     | 'all-to-all' | 'ragged-all-to-all' (async -start/-done pairs count
                     once, as the start)
        axes         tuple of mesh axis names the replica groups (or permute pairs) span, in
                     mesh order; () when every group is a single device
        bytes        bytes per device of the full buffer: the result of an all-reduce,
                     all-gather, permute or all-to-all, the operand of a reduce-scatter; a
                     ragged all-to-all's output buffer, as if full (what it sends is known
                     only when it runs: an upper bound)
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
