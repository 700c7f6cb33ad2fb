"""How much of each collective's time XLA:GPU's schedule hides behind compute: a replay of the
compiled module on a target's figures.

A GPU compile is scheduled: each computation's instructions are printed in the order they run,
and an asynchronous collective is a pair, `X-start` where its bytes begin to move and `X-done`
where the compute that needs them waits. The replay walks that order:

    compute stream   a1 --- f1 ------ f2 ------- [wait] d1 - f3 --
    NVLink stream        s1 ===========================+
                         (all-gather over 'tensor': start s1 ... done d1)

- every other instruction runs on one compute stream, one after another, at its roofline time
  max(matmul FLOPs / peak, bytes read and written / HBM bandwidth): at peak (FP8's for a
  matmul of FP8 operands, hlo_module.matmul_flops_by_dtype's reading), so that what the
  replay calls exposed is a lower bound on what a real run waits;
- a collective sends on its link's stream from its start, queued behind the earlier ones on
  that link: NVLink when every group stays inside a node, the network otherwise (the target's
  per-GPU bandwidths, plan/clusters.py), taking wire bytes / bandwidth (ring algorithms,
  hlo.wire_bytes; no latency term);
- at a collective's done, the compute stream waits until its bytes have arrived: that wait is
  the collective's exposed time. A synchronous collective is exposed whole.
- a transfer between device memory and pinned host memory (an operand or result whose layout
  is in memory space S(5): the pipeline's offloaded activations) runs on a stream of its
  own at the target's host_bandwidth (the GPU's PCIe link, one way), queued behind the
  earlier ones in its direction as collectives on a link: PCIe is full duplex, so the copies
  to the host and those back each have a stream. An async pair (fusion-start / fusion-done of a
  dynamic-slice or dynamic-update-slice, copy-start / copy-done) takes what crosses the link,
  the slice read or the update written (Replay.traffic), not the host buffer around it; at its
  done the compute stream waits for it ('exposed host transfers'). A synchronous one (a copy or
  fusion touching S(5)) is exposed whole. A target without host_bandwidth prices them as
  compute;
- a while loop, a conditional or a call runs as one block of compute whose time is its
  callee's replay (x trip count; a conditional's branches weighted as the inventory weighs
  them); the collectives inside are replayed with their own computation, and everything is
  multiplied by the runs per step (hlo_module.execution_counts).

It times nothing that ran: it says what the schedule lets overlap on the target's figures.
`time_by_kind` splits the replayed step by what each instruction is (KINDS): matmuls
(dots, GEMM calls, fusions with a dot), attention kernels (fused attention calls), copies,
slicing and slot writes (dynamic-slice / dynamic-update-slice, slices, gathers, scatters,
concatenations, pads), transposes, everything else as elementwise, the exposed
communication and the exposed host transfers, so a user sees what to fix before renting the
cluster.
"""

import collections
import math
import re

from mtnlg_jax.plan import hlo, hlo_module

_FREE = frozenset(
    ('parameter', 'get-tuple-element', 'tuple', 'bitcast', 'constant', 'after-all',
     'partition-id', 'replica-id', 'opt-barrier', 'add-dependency')
)  # fmt: skip
_CALLS = frozenset(('while', 'conditional', 'call', 'async-start'))
_OPERANDS = re.compile(r'%([\w.\-]+)')
KINDS = ('matmuls', 'attention kernels', 'copies', 'slicing and slot writes', 'transposes',
         'elementwise', 'exposed communication', 'exposed host transfers')  # fmt: skip
HEAVIEST = 6
_SLICING = frozenset(('dynamic-slice', 'dynamic-update-slice', 'slice', 'gather', 'scatter',
                      'concatenate', 'pad'))  # fmt: skip
_LAYOUT = frozenset(('parameter', 'bitcast', 'reshape', 'constant', 'tuple', 'get-tuple-element'))
_HOST_MEMORY = re.compile(r'\{[^{}]*:[^{}]*\bS\(5\)')  # a layout in pinned host memory
_ALLOCATION = 'custom_call_target="AllocateBuffer"'  # memory, nothing written to it


class Target:
    """The figures a replay needs (from a plan/clusters.Cluster and a compute dtype): a matmul
    of FP8 by FP8 runs at `fp8_peak_flops` where the GPU has FP8 tensor cores, any other at
    `peak_flops` (the compute dtype's). `host_bandwidth`: bytes/s one way between a GPU and
    pinned host memory; None prices a transfer to or from host memory as any other
    instruction."""

    def __init__(self, peak_flops, hbm_bandwidth, nvlink_bandwidth, network_bandwidth,
                 gpus_per_node, fp8_peak_flops=None, host_bandwidth=None):  # fmt: skip
        self.peak_flops, self.hbm_bandwidth = peak_flops, hbm_bandwidth
        self.nvlink_bandwidth, self.network_bandwidth = nvlink_bandwidth, network_bandwidth
        self.gpus_per_node, self.fp8_peak_flops = gpus_per_node, fp8_peak_flops
        self.host_bandwidth = host_bandwidth

    @classmethod
    def of_cluster(cls, cluster, compute_dtype):
        fp8 = cluster.peak_tflops.get('float8')
        return cls(
            cluster.peak_tflops[compute_dtype] * 1e12,
            cluster.hbm_bandwidth,
            cluster.nvlink_bandwidth,
            cluster.internode_bandwidth,
            cluster.gpus_per_node,
            fp8 and fp8 * 1e12,
            cluster.host_bandwidth,
        )

    def peak_for(self, dtypes):
        """FLOP/s of a matmul of `dtypes` (a hlo_module.matmul_flops_by_dtype key)."""
        if self.fp8_peak_flops and hlo_module.is_fp8(dtypes):
            return self.fp8_peak_flops
        return self.peak_flops


def _elements(type_text):
    """Elements of an array type (the largest array of a tuple), None if none is given."""
    counts = [
        math.prod(int(d) for d in re.findall(r'\d+', dims) or [1])
        for _, dims in hlo_module.ARRAY.findall(re.sub(r'/\*.*?\*/', '', type_text))
    ]
    return max(counts) if counts else None


def _element_bytes(type_text):
    """Bytes of one element of an array type; None for a tuple or an unknown type."""
    arrays = hlo_module.ARRAY.findall(re.sub(r'/\*.*?\*/', '', type_text))
    if len(arrays) != 1:
        return None
    return hlo_module.DTYPE_BYTES.get(arrays[0][0])


def _source_of_bitcasts(name, by_name):
    """The instruction a chain of bitcasts starts from (XLA:GPU writes a dynamic-update-slice
    in place when its buffer is a fusion parameter seen through bitcasts, and the buffer
    assignment shares the parameter's allocation with the fusion's output)."""
    while name in by_name and by_name[name].opcode == 'bitcast':
        name = _operand_names(by_name[name])[0]
    return name


def _uses_through_bitcasts(name, users):
    """The instructions that read `name`, looking through bitcasts of it."""
    uses = []
    for user in users.get(name, []):
        if user.opcode == 'bitcast':
            uses += _uses_through_bitcasts(user.name, users) or [user]
        else:
            uses.append(user)
    return uses


def _operand_names(instruction):
    """Names of the operands: the %names inside the opcode's parentheses."""
    end = hlo_module.matching_bracket(instruction.rest, 0)
    return _OPERANDS.findall(instruction.rest[:end])


class Replay:
    def __init__(self, computations, entry, inventory, target, branch_weights):
        self.computations, self.entry, self.target = computations, entry, target
        self.counts, _ = hlo_module.execution_counts(computations, entry, branch_weights)
        self.operand_types = hlo_module.OperandTypes(computations)
        self.branch_weights = branch_weights
        self.scopes = {name for path in (branch_weights or {}) for name in path}
        self.collectives = {(op['computation'], op['name']): op for op in inventory}
        self.num_devices = None
        self.durations = {}  # computation -> seconds of one run
        self.by_kind = {}  # computation -> {kind: seconds of one run}
        self.exposed = collections.defaultdict(float)  # (computation, name) -> s per run
        self.transfers = {}  # (computation, name) -> (bytes to host, from host, s) per run
        self.spent = []  # (computation, instruction, kind, seconds of one run)

    def reweigh(self, branch_weights):
        """Replay under other branch weights (plan/lockstep.py: one kind of slot at a time):
        the durations of computations without a conditional inside are kept, the rest
        forgotten."""
        self.branch_weights = branch_weights
        self.scopes = {name for path in (branch_weights or {}) for name in path}
        steady = self.weightless()
        self.durations = {name: s for name, s in self.durations.items() if name in steady}

    def weightless(self):
        """The computations no conditional runs inside (their replay ignores the weights)."""
        if not hasattr(self, '_weightless'):
            memo = {}

            def free(name):
                if name not in memo:
                    memo[name] = True  # recursion guard; HLO has none
                    instructions = self.computations.get(name, [])
                    memo[name] = all(
                        i.opcode != 'conditional' and all(free(c) for _, c in i.callees())
                        for i in instructions
                    )
                return memo[name]

            self._weightless = {name for name in self.computations if free(name)}
        return self._weightless

    def link(self, op, instruction):
        """'nvlink' if every replica group (or permute pair) stays inside a node."""
        groups = hlo.replica_groups(instruction, self.num_devices)
        per_node = self.target.gpus_per_node
        inside = all(len({device // per_node for device in group}) <= 1 for group in groups)
        return 'nvlink' if inside else 'network'

    def wire_seconds(self, op, link):
        bandwidth = (
            self.target.nvlink_bandwidth if link == 'nvlink' else self.target.network_bandwidth
        )
        return op['wire_bytes'] / bandwidth

    def instruction_seconds(self, instruction, types, computation):
        """Roofline time of one non-collective instruction, callees included."""
        if instruction.opcode in _FREE or _ALLOCATION in instruction.rest:
            return 0.0
        callees = instruction.callees()
        if instruction.opcode in _CALLS:
            return self.called_seconds(instruction, callees)
        matmul_s = self.matmul_seconds(instruction, types, computation)
        fused = [callee for attr, callee in callees if attr == 'calls']
        for callee in fused:  # a fusion's dots live in its fused computation
            matmul_s += self.fused_matmul_seconds(callee)
        moved = self.bytes_moved(instruction, types, fused[0] if fused else None)
        return max(matmul_s, moved / self.target.hbm_bandwidth)

    def matmul_seconds(self, instruction, types, computation):
        """The instruction's own matmul FLOPs at the peak of what it multiplies."""
        flops = hlo_module.instruction_flops(instruction, types)
        if not flops:
            return 0.0
        return flops / self.target.peak_for(self.operand_types(instruction, computation))

    def bytes_moved(self, instruction, types, fused=None):
        """Bytes read and written: operands and result, except where a buffer is sliced or
        updated in place (a stash slot): a dynamic-slice reads only its slice, a
        dynamic-update-slice writes only its update (also inside a fusion)."""
        written, read = self.traffic(instruction, types, fused)
        return written + sum(read)

    def traffic(self, instruction, types, fused=None, result_type=None):
        """(bytes written, [bytes read of each operand]) as bytes_moved counts them;
        result_type: the type written, if not the instruction's (an async start's output)."""
        operands = _operand_names(instruction)
        sizes = [hlo_module.shape_bytes(types[name]) if name in types else 0 for name in operands]
        result_type = instruction.type_text if result_type is None else result_type
        result = hlo_module.shape_bytes(result_type)
        if instruction.opcode == 'dynamic-slice':
            return result, [result] + [0] * (len(sizes) - 1)
        if instruction.opcode == 'dynamic-update-slice':
            update = sizes[1] if len(sizes) > 1 else result
            return update, [0, update] + [0] * (len(sizes) - 2)
        if fused is None:
            return result, sizes
        body = self.computations.get(fused, [])
        params = {i.name: hlo_module.ints(i.rest)[0] for i in body if i.opcode == 'parameter'}
        by_name = {i.name: i for i in body}
        users = collections.defaultdict(list)
        for i in body:
            for name in _operand_names(i) if i.opcode != 'parameter' else ():
                users[name].append(i)
        for name, index in params.items():
            uses = _uses_through_bitcasts(name, users)
            if uses and index < len(sizes) and all(u.opcode == 'dynamic-slice' for u in uses):
                sizes[index] = sum(hlo_module.shape_bytes(u.type_text) for u in uses)
        root = next((i for i in body if i.is_root), None)
        root = root and by_name[_source_of_bitcasts(root.name, by_name)]
        if root is not None and root.opcode == 'dynamic-update-slice':
            buffer, update = (_operand_names(root) + [None, None])[:2]
            buffer = _source_of_bitcasts(buffer, by_name)
            if buffer in params and params[buffer] < len(sizes):
                small = hlo_module.shape_bytes(
                    by_name[update].type_text if update in by_name else ''
                )
                # the update is written; the buffer is read only where the fusion slices
                # it (an accumulator's slot, read, added to and written back in place)
                reads = [u for u in _uses_through_bitcasts(buffer, users) if u is not root]
                sizes[params[buffer]] = sum(
                    hlo_module.shape_bytes(u.type_text)
                    if u.opcode == 'dynamic-slice'
                    else sizes[params[buffer]]
                    for u in reads
                )
                result = small
        if 'kind=kLoop' in instruction.rest:  # each output element reads one of each operand
            elements = _elements(result_type)
            for index, name in enumerate(operands):
                if name in types and elements is not None:
                    width = _element_bytes(types[name])
                    sizes[index] = min(sizes[index], elements * width) if width else sizes[index]
        return result, sizes

    def host_transfer(self, instruction, types):
        """(bytes to host memory, bytes from it) that an instruction moves over the host link,
        None where it moves none (no operand or result in pinned host memory, S(5)) or the
        target has no host link figure. An async start's output is its result (a
        fusion-start's type is ((operands), output, context), a copy-start's (output, operand,
        context)); the bytes are what crosses the link: a slice read from a host buffer, an
        update written into one, a whole array copied, not the host buffer around them."""
        if self.target is None or not self.target.host_bandwidth:
            return None
        if instruction.opcode in _FREE | _CALLS or instruction.opcode.endswith('-done'):
            return None
        if _ALLOCATION in instruction.rest:  # a buffer allocated in host memory: no bytes
            return None
        operand_types = [types.get(name, '') for name in _operand_names(instruction)]
        result_type = instruction.type_text
        if instruction.opcode.endswith('-start') and result_type.startswith('('):
            parts = hlo_module.split_top(result_type[1:-1])
            result_type = parts[1] if parts[0].startswith('(') else parts[0]
        to_host = bool(_HOST_MEMORY.search(result_type))
        from_host = [bool(_HOST_MEMORY.search(t)) for t in operand_types]
        if not to_host and not any(from_host):
            return None
        fused = [c for a, c in instruction.callees() if a == 'calls']
        written, read = self.traffic(instruction, types, fused[0] if fused else None, result_type)
        return written if to_host else 0, sum(r for r, host in zip(read, from_host) if host)

    def host_seconds(self, moved):
        """Time on the host link of host_transfer's (bytes to host, bytes from host)."""
        return sum(moved) / self.target.host_bandwidth

    def bytes_of(self, name):
        """Device-memory bytes one run of a computation reads and writes, as the replay prices
        each kernel (bytes_moved), callees x their runs; collectives left out."""
        instructions = self.computations.get(name, [])
        types = {instruction.name: instruction.type_text for instruction in instructions}
        total = 0.0
        for instruction in instructions:
            opcode = instruction.opcode
            if opcode in _CALLS:
                called = self.called(instruction, instruction.callees())
                total += sum(runs * self.bytes_of(callee) for runs, callee in called)
            elif opcode not in _FREE and opcode.split('-start')[0] not in hlo.COLLECTIVES:
                if not opcode.endswith('-done'):
                    fused = [c for a, c in instruction.callees() if a == 'calls']
                    total += self.bytes_moved(instruction, types, fused[0] if fused else None)
        return total

    def fused_matmul_seconds(self, name):
        instructions = self.computations.get(name, [])
        types = {instruction.name: instruction.type_text for instruction in instructions}
        seconds = 0.0
        for instruction in instructions:
            seconds += self.matmul_seconds(instruction, types, name)
            seconds += sum(
                self.fused_matmul_seconds(c) for a, c in instruction.callees() if a == 'calls'
            )
        return seconds

    def called(self, instruction, callees):
        """[(runs per run of the instruction, computation)] of a while, conditional or call."""
        if instruction.opcode == 'while':
            trips = hlo_module.trip_count(instruction, self.computations) or 1
            return [(trips, dict(callees)['body'])]
        return [
            (hlo_module.branch_factor(instruction, attr, callee, self.branch_weights, self.scopes),
             callee)
            for attr, callee in callees
        ]  # fmt: skip

    def called_seconds(self, instruction, callees):
        return sum(runs * self.duration(c) for runs, c in self.called(instruction, callees))

    def kind(self, instruction, types):
        """Which of KINDS a non-control-flow instruction's time counts as."""
        if hlo_module.attention_kernel(instruction):
            return 'attention kernels'
        fused = [c for a, c in instruction.callees() if a == 'calls']
        body = self.computations.get(fused[0], []) if fused else [instruction]
        ops = {i.opcode for i in body} - _LAYOUT
        if ops & {'dot', 'convolution'} or hlo_module.instruction_flops(instruction, types) > 0:
            return 'matmuls'
        if ops <= {'copy', 'copy-start', 'copy-done'} and ops:
            return 'copies'
        root = next((i.opcode for i in body if i.is_root), instruction.opcode)
        if root in _SLICING or (ops and ops <= _SLICING | {'copy', 'select', 'compare'}):
            return 'slicing and slot writes'
        if root == 'transpose' or ops == {'transpose'}:
            return 'transposes'
        return 'elementwise'

    def duration(self, name):
        """Seconds of one run of a computation, replayed (memoised)."""
        if name not in self.durations:
            self.durations[name] = 0.0  # recursion guard; HLO has none
            self.durations[name] = self.replay(name)
        return self.durations[name]

    def replay(self, name):
        instructions = self.computations.get(name, [])
        types = {instruction.name: instruction.type_text for instruction in instructions}
        kinds = self.by_kind[name] = collections.defaultdict(float)
        now = 0.0
        link_free = collections.defaultdict(float)  # link -> when its stream is idle
        arrives = {}  # start name -> (op key, when its bytes have arrived, kind of its wait)
        for instruction in instructions:
            op = self.collective(name, instruction)
            moved = None if op is not None else self.host_transfer(instruction, types)
            if op is not None:
                link, kind = self.link(op, instruction), 'exposed communication'
                key, seconds = (op['computation'], op['name']), self.wire_seconds(op, link)
            elif moved is not None:  # to or from host memory: a stream each way
                link, kind = 'to host' if moved[0] else 'from host', 'exposed host transfers'
                key, seconds = (name, instruction.name), self.host_seconds(moved)
                self.transfers[key] = (*moved, seconds)
            if op is not None or moved is not None:
                begin = max(now, link_free[link])
                end = begin + seconds
                link_free[link] = end
                if instruction.opcode.endswith('-start'):
                    arrives[instruction.name] = (key, end, kind)
                else:  # synchronous: the compute stream waits for it
                    self.exposed[name, instruction.name] += end - now
                    kinds[kind] += end - now
                    now = end
                continue
            if instruction.opcode.endswith('-done'):
                started = [n for n in _operand_names(instruction) if n in arrives]
                for start in started:
                    key, end, kind = arrives.pop(start)
                    if end > now:
                        self.exposed[key] += end - now
                        kinds[kind] += end - now
                        now = end
                continue
            seconds = self.instruction_seconds(instruction, types, name)
            now += seconds
            if instruction.opcode in _CALLS:
                for runs, callee in self.called(instruction, instruction.callees()):
                    for kind, t in self.by_kind.get(callee, {}).items():
                        kinds[kind] += runs * t
            elif seconds:
                kind = self.kind(instruction, types)
                kinds[kind] += seconds
                self.spent.append((name, instruction, kind, seconds))
        return now

    def heaviest(self, top):
        """The `top` largest shares of the replayed step outside matmuls and attention, each
        instructions of one kind, result type and JAX operation (the last two parts of its
        op_name) summed over the step: [{kind, type, op, seconds, runs}]."""
        groups = collections.defaultdict(lambda: dict(seconds=0.0, runs=0.0))
        for computation, instruction, kind, seconds in self.spent:
            if kind in ('matmuls', 'attention kernels'):
                continue
            runs = self.counts.get(computation, (0, False))[0]
            op = '/'.join(instruction.op_name().split('/')[-2:])
            group = groups[kind, instruction.type_text.split('{')[0], op]
            group['seconds'] += runs * seconds
            group['runs'] += runs
        rows = [dict(kind=k, type=t, op=o, **g) for (k, t, o), g in groups.items()]
        return sorted(rows, key=lambda row: -row['seconds'])[:top]

    def host_figures(self):
        """The step's transfers to and from host memory, per step (x runs per step):
        {'bytes', 'to_host_bytes', 'from_host_bytes', 'transfer_s': their time on the host
        link, 'exposed_s': the compute stream's wait for them, 'count': transfers run}."""
        host = dict.fromkeys(
            ('bytes', 'to_host_bytes', 'from_host_bytes', 'transfer_s', 'exposed_s', 'count'), 0.0
        )
        for key, (to_host, from_host, seconds) in self.transfers.items():
            runs = self.counts.get(key[0], (0, False))[0]
            host['to_host_bytes'] += runs * to_host
            host['from_host_bytes'] += runs * from_host
            host['bytes'] += runs * (to_host + from_host)
            host['transfer_s'] += runs * seconds
            host['exposed_s'] += runs * self.exposed.get(key, 0.0)
            host['count'] += runs
        return host

    def collective(self, computation, instruction):
        """The inventory's entry for a collective instruction (an async-start: the collective
        of the computation it wraps), or None."""
        op = self.collectives.get((computation, instruction.name))
        if op is None and instruction.opcode == 'async-start':
            for attr, callee in instruction.callees():
                for inner in self.computations.get(callee, []) if attr == 'calls' else ():
                    op = op or self.collectives.get((callee, inner.name))
        return op

    def run(self, num_devices):
        """Replay every computation that runs as control flow (the entry, loop bodies,
        branches, calls); fused computations count inside their fusion's roofline."""
        self.num_devices = num_devices
        self.duration(self.entry)


def hbm_bytes(hlo_text):
    """Bytes one run of a compiled module reads and writes in device memory, as the replay
    prices its kernels (Replay.bytes_moved: operands and result, a slot at its slice; fused
    computations inside their fusion; a loop's body x its trips), collectives left out: the
    traffic a memory-bound program waits on, which XLA:GPU's compile-only cost analysis does
    not give."""
    computations, entry = hlo_module.parse_module(hlo_text)
    return Replay(computations, entry, [], None, None).bytes_of(entry)


def collective_overlap(hlo_text, mesh, target, branch_weights=None):
    """The replay of a compiled step on `target` (a Target):

        {'collectives': [{kind, axes, link, wire_bytes, count, wire_s, exposed_s, name}]
                        (per step: x runs per step),
         'table': [{kind, axes, link, wire_bytes, wire_s, exposed_s, overlapped}] by kind,
                  axes and link, 'overlapped' = 1 - exposed / wire time,
         'step_s': the replayed step (compute at peak + exposed), 'exposed_s' (collectives'),
         'compute_s',
         'host': {bytes, to_host_bytes, from_host_bytes, transfer_s, exposed_s, count} per step
                 of the transfers between device and host memory (Replay.host_figures),
         'time_by_kind': {kind: seconds of the replayed step} (KINDS),
         'heaviest': the largest shares of the step beyond matmuls and attention (HEAVIEST
                     rows of Replay.heaviest: what to fix first),
         'replay': the Replay itself, its durations memoised (plan/lockstep.py reweighs it)}

    mesh: the compiled step's mesh (positions in its device array are the HLO's device ids;
    consecutive gpus_per_node positions share a node, as parallel/mesh.py lays devices out)."""
    computations, entry = hlo_module.parse_module(hlo_text)
    inventory = hlo.collective_inventory(hlo_text, mesh, branch_weights)
    replay = Replay(computations, entry, inventory, target, branch_weights)
    _, sizes = hlo._mesh_shape(mesh)
    num_devices = 1
    for size in sizes:
        num_devices *= size
    replay.run(num_devices)
    rows = []
    for op in inventory:
        key = (op['computation'], op['name'])
        instruction = next(i for i in computations[op['computation']] if i.name == op['name'])
        link = replay.link(op, instruction)
        rows.append(
            dict(
                kind=op['kind'],
                axes=list(op['axes']),
                link=link,
                name=op['name'],
                count=op['count'],
                wire_bytes=op['wire_bytes'] * op['count'],
                wire_s=replay.wire_seconds(op, link) * op['count'],
                exposed_s=replay.exposed.get(key, 0.0) * op['count'],
            )
        )
    table = collections.defaultdict(lambda: dict(wire_bytes=0.0, wire_s=0.0, exposed_s=0.0))
    for row in rows:
        total = table[row['kind'], hlo.axes_key(row['axes']), row['link']]
        for field in ('wire_bytes', 'wire_s', 'exposed_s'):
            total[field] += row[field]
    summary = [
        dict(
            kind=kind,
            axes=axes,
            link=link,
            **total,
            overlapped=max(0.0, 1.0 - total['exposed_s'] / total['wire_s'])
            if total['wire_s']
            else 1.0,
        )
        for (kind, axes, link), total in sorted(table.items())
    ]
    step_s = replay.duration(entry)
    exposed_s = sum(row['exposed_s'] for row in rows)
    host = replay.host_figures()
    return dict(
        collectives=rows,
        table=summary,
        step_s=step_s,
        compute_s=step_s - exposed_s - host['exposed_s'],
        exposed_s=exposed_s,
        host=host,
        time_by_kind={k: replay.by_kind[entry].get(k, 0.0) for k in KINDS},
        heaviest=replay.heaviest(HEAVIEST),
        replay=replay,
    )
