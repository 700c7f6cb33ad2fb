"""The fastest layouts of a model on a cluster that fit: enumerate, predict, check memory.

    result = search(inputs, devices, cluster, fixed={'model.remat'})
    print('\\n'.join(lines(result)))

Every layout the config can take on `devices` GPUs: tensor t inside a node (dividing the
heads, the MLP and the node's GPUs), stages p over which the config's stage layers go (p
dividing the layers, or with pipeline.first_stage_layers / last_stage_layers set, p whose
middle stages share the rest evenly: config/stage_layers.py), expert ranks x dividing a
mixture of experts' routed experts (1 for a dense model; a mixture of experts at x = 1 only
with t = 1 or folded: split over tensor, its experts take model/moe.py's batched path, whose
gathered weight copies the plan does not count; docs/benchmarks.md, "Mixtral 8x22B on 256
H100s"), parallel folding (model.moe.fold_tensor, t > 1, x t dividing the experts, no
context) or not, context ranks c (mesh.context) for a sequence longer than WHOLE_SEQUENCE,
each c keeping a rank MIN_CONTEXT_TOKENS of it where the model's checks take its 2 c chunks
(x t under sequence parallelism; config/checks.py), data d = devices / (t c p x), the
replicas d x dividing the global batch, micro-batch b
dividing the replica's batch, repeats v the stages' layers take (dividing an even stage's
layers; at most the shortest unequal stage's), the schedule (1f1b or zbh1 at v = 1,
interleaved or zbv at v = 2, interleaved beyond), remat none / selective / full (under
selective, the recompute names of RECOMPUTES), sequence parallelism (t > 1, where the
model's checks take it at t and c), max_in_flight:
none or p, and for interleaved 1F1B the bounds above p up to the first whose table is the
unbounded one (stage 0's chunk inputs, parallel/schedule.py), each only where its table
differs from the bound before it (a bound whose table is another's is that layout again).
Keys in `fixed` (the user's --config.KEY=VALUE) keep the config's value; the others vary.

Each layout is resolved (config.resolve: what it refuses is skipped), its step predicted
(plan/predict.py, the 'ours' semantics), and the layouts are ranked by that; memory per device
(plan/report.make_plan, the planner's arithmetic) is then checked from the fastest down until
`top` fit in the GPU's memory with FIT_MARGIN to spare, so the top is the same as checking
every one; a layout with recompute names is predicted (and ranked) once the same layout
without them is checked and holds over NEAR_FULL of the memory (search's docstring). `confirm`
takes a compile callback (the GPU compile) to check the first few with XLA's own memory and
FLOPs.
"""

import functools
import heapq
import itertools
import json
import sys

import ml_collections
from tqdm import tqdm

from mtnlg_jax import config as config_lib
from mtnlg_jax.config import stage_layers
from mtnlg_jax.parallel import footprint
from mtnlg_jax.parallel import schedule as schedule_lib
from mtnlg_jax.plan import arithmetic, predict, report

FREE_KEYS = (
    'mesh.tensor',
    'mesh.context',
    'mesh.stage',
    'mesh.data',
    'mesh.expert',
    'pipeline.repeats',
    'pipeline.schedule',
    'pipeline.max_in_flight',
    'train.micro_batch',
    'model.remat',
    'model.remat_recompute',
    'model.sequence_parallel',
    'model.moe.fold_tensor',
)
REMATS = ('none', 'selective', 'full')
# model.remat_recompute under selective recompute: a named matmul's output frees about e / h
# bytes a FLOP made again, so the short list holds the fewest FLOPs: the attention's input
# projection, then attention-out's (as many FLOPs and its tensor sum again: the 405B's 0.24
# and 0.48 s for 5.0 and 4.5 GiB at 18 in flight). mlp_in (29 GiB for 1.39 s there) costs more
# than the whole bubble the bounds buy back (1.15 s from 16 to none), mlp_out's input is the
# MLP's width (h / f the bytes a FLOP), 'context' frees nothing under a fused kernel
# (docs/benchmarks.md, "The search over the bounds above p and the recompute names").
RECOMPUTES = ('', 'qkv', 'qkv,attn_out')
# A layout fits where its plan times this does: the compiled peaks of the configs on record
# are 1.00 to 1.06 x their plans (Llama 3 405B's 65.9 GiB against 62.1; docs/planner.md).
FIT_MARGIN = 1.06
# The names are tried where the layout without them holds more than this share of the GPU's
# memory (a plan that fits by a few percent may not once compiled).
NEAR_FULL = 0.9
# The schedules tried at each repeats v: 1F1B or ZB-H1 at one chunk a stage, interleaved 1F1B
# or ZB-V (its V) at two, interleaved beyond (key 0: any other v)
SCHEDULES = {1: ('1f1b', 'zbh1'), 2: ('interleaved', 'zbv'), 0: ('interleaved',)}
# Context ranks c (mesh.context) are drawn for sequences longer than WHOLE_SEQUENCE, down to
# MIN_CONTEXT_TOKENS of each sequence a rank. A search cost, not the plan's verdict: at 8192
# the plan ranks t8 c2 p16 d32 4.9 % faster than the best whole-sequence layout (the bubble
# halves at twice the micro-batches), but drawing c in 1..8 makes the Llama 3 405B 8K search
# 7 x the layouts (23200 against 3240); published runs train sequences up to 8192 whole
# (Llama 3's pre-training), and --config.mesh.context=N searches one c at any length. At
# 131072 the plan's step grows past c32 (c64 0.9 s slower; c128, 1024 tokens a rank, below
# the 30 fastest), so a rank keeps no fewer than 1024 tokens (docs/benchmarks.md, "The
# search over context").
WHOLE_SEQUENCE = 8192
MIN_CONTEXT_TOKENS = 1024
MESH_KEYS = ('mesh.tensor', 'mesh.context', 'mesh.stage', 'mesh.data', 'mesh.expert')


class SearchError(ValueError):
    """Bad input to the search (the message names the flag or key)."""


def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def _get(config, key):
    """A dotted key's value (False for model.moe.* of a config without the section)."""
    *sections, name = key.split('.')
    for section in sections:
        if section not in config:
            return False
        config = config[section]
    return config[name]


def layouts(inputs, devices, gpus_per_node, fixed=()):
    """Every {key: value} of FREE_KEYS the search tries (keys in `fixed` keep `inputs`')."""
    model, batch = inputs.model, inputs.train.global_batch
    ffn = model.ffn_hidden or config_lib.default_ffn_hidden(model)
    kv_heads = model.get('kv_heads', 0) or model.heads

    def choices(key, values):
        value = _get(inputs, key)
        return [value] if key in fixed and value != -1 else values

    tensors = [
        t
        for t in _divisors(gpus_per_node)
        if model.heads % t == 0 and kv_heads % t == 0 and ffn % t == 0
    ]
    experts = model.moe.experts if 'moe' in model else 0
    stages = [p for p in range(1, model.num_layers + 1) if _stage_repeats(inputs, p, 1)]
    splits = _SequenceSplits(inputs)
    meshes = itertools.product(
        choices('mesh.tensor', tensors),
        choices('mesh.context', contexts(inputs, devices)),
        choices('mesh.stage', stages),
        choices('mesh.expert', _divisors(experts) if experts else [1]),
    )
    for t, c, p, x in meshes:
        if devices % (t * c * p * x) or not splits(t, c):
            continue
        d = devices // (t * c * p * x)
        wanted = _get(inputs, 'mesh.data')
        if 'mesh.data' in fixed and wanted != -1 and d != wanted:
            continue
        if batch % (d * x):
            continue
        # folding splits each sequence's rows over tensor: whole sequences, no context
        foldable = experts and t > 1 and c == 1 and experts % (x * t) == 0
        folds = [False, True] if foldable else [False]
        for fold in choices('model.moe.fold_tensor', folds):
            if experts and x == 1 and t > 1 and not fold:
                continue  # one expert rank over tensor: the batched path's weight copies
            if experts and fold and t > 1 and experts % (x * t):
                continue  # folding fixed on: the experts do not divide over expert x tensor
            mesh = dict(zip(MESH_KEYS, (t, c, p, d, x)))
            mesh.update({'model.moe.fold_tensor': fold} if experts else {})
            repeats = [v for v in range(1, model.num_layers + 1) if _stage_repeats(inputs, p, v)]
            yield from _schedules(choices, mesh, splits(t, c), batch // (d * x), repeats)


def contexts(inputs, devices):
    """The context ranks c the search draws on `devices` GPUs: 1, and for a sequence longer
    than WHOLE_SEQUENCE each c dividing them that leaves a rank MIN_CONTEXT_TOKENS of it (the
    model's own checks then say which resolve: _SequenceSplits)."""
    seq = inputs.model.seq_len
    if seq <= WHOLE_SEQUENCE:
        return [1]
    return [c for c in _divisors(devices) if seq // c >= MIN_CONTEXT_TOKENS]


class _SequenceSplits:
    """splits(t, c): the sequence parallelism (False, True) the model's own checks accept at
    tensor t and context c (config.resolve_model on the mesh t x c), [] where neither."""

    def __init__(self, inputs):
        self.inputs, self.found = inputs, {}

    def __call__(self, t, c):
        if (t, c) not in self.found:
            self.found[t, c] = [sp for sp in (False, True)[: 1 + (t > 1)] if self._runs(t, c, sp)]
        return self.found[t, c]

    def _runs(self, t, c, sp):
        config = ml_collections.ConfigDict(self.inputs.to_dict())
        config.mesh.update(dict(tensor=t, context=c, stage=1, data=1, expert=1))
        config.model.sequence_parallel = sp
        pipeline = dict(repeats=1, first_stage_layers=0, last_stage_layers=0)  # one stage
        config.pipeline.update({k: v for k, v in pipeline.items() if k in config.pipeline})
        if 'moe' in config.model:
            config.model.moe.fold_tensor = False
        try:
            config_lib.resolve_model(config, t * c)
        except config_lib.ConfigError:
            return False
        return True


def _stage_repeats(inputs, stages, repeats):
    """Whether the block stack's layers go over `stages` stages of `repeats` chunks as the
    config's pipeline.first_stage_layers / last_stage_layers say (config/stage_layers.py)."""
    pipeline = inputs.pipeline
    first, last = pipeline.get('first_stage_layers', 0), pipeline.get('last_stage_layers', 0)
    layers = config_lib.block_stack_layers(inputs.model)
    try:
        stage_layers.per_stage(layers, stages, repeats, first, last)
    except ValueError:
        return False
    return stages > 1 or repeats == 1


def _schedules(choices, mesh, sp, replica_batch, repeats):
    """layouts' entries of one mesh: repeats (those the stages' layers take), the schedule
    (SCHEDULES of the repeats), micro-batch, recompute (RECOMPUTES under selective), sequence
    parallelism (of `sp`) and the in-flight bound (_bounds), each as `choices` allows."""
    p = mesh['mesh.stage']
    for v, b, remat, seq in itertools.product(
        choices('pipeline.repeats', repeats),
        choices('train.micro_batch', _divisors(replica_batch)),
        choices('model.remat', list(REMATS)),
        choices('model.sequence_parallel', sp),
    ):
        names = list(RECOMPUTES) if remat == 'selective' else ['']
        schedules = SCHEDULES.get(v, SCHEDULES[0]) if p > 1 else SCHEDULES[1][:1]
        for schedule, recompute in itertools.product(
            choices('pipeline.schedule', schedules), choices('model.remat_recompute', names)
        ):
            bounds = _bounds(p, v, replica_batch // b, schedule)
            for in_flight in choices('pipeline.max_in_flight', list(bounds)):
                yield {
                    **mesh,
                    'pipeline.repeats': v,
                    'pipeline.schedule': schedule,
                    'pipeline.max_in_flight': in_flight,
                    'train.micro_batch': b,
                    'model.remat': remat,
                    'model.remat_recompute': recompute,
                    'model.sequence_parallel': seq,
                }


@functools.cache
def _bounds(p, v, m, schedule):
    """The in-flight bounds tried on p stages of v chunks with m micro-batches: none (0), p,
    and for interleaved 1F1B p + 1 on (stage 0's chunk inputs) until the table is the
    unbounded one; 1f1b and interleaved keep a bound only where its table differs from the
    unbounded one and from the bound's before it (zbh1's and zbv's tables: none and p)."""
    if p == 1:
        return (0,)
    if schedule not in ('1f1b', 'interleaved'):
        return (0, p)
    unbounded = schedule_lib.build(p, v, m)
    last = -(-int(unbounded.in_flight()[:, 0].max()) // v) if v > 1 else p
    bounds, before = [0], unbounded
    for bound in range(p, max(last, p) + 1):
        table = schedule_lib.build(p, v, m, bound)
        if _same_table(table, unbounded):
            break
        if not _same_table(table, before):
            bounds.append(bound)
        before = table
    return tuple(bounds)


def _same_table(a, b):
    """Whether two tables run the same slots in the same ticks."""
    columns = ('fwd_micro', 'fwd_repeat', 'bwd_micro', 'bwd_repeat')
    return a.ticks == b.ticks and all((getattr(a, c) == getattr(b, c)).all() for c in columns)


def with_layout(inputs, layout, devices, fixed=()):
    """`inputs` with `layout` set, resolved (config.ConfigError if it cannot run); the
    schedule the layout's, else the user's, else following the repeats (1f1b, interleaved)."""
    config = ml_collections.ConfigDict(inputs.to_dict())
    for key, value in layout.items():
        *sections, name = key.split('.')
        node = config
        for section in sections:
            node = node[section]
        node[name] = value
    if 'pipeline.schedule' not in fixed and 'pipeline.schedule' not in layout:
        config.pipeline.schedule = 'interleaved' if config.pipeline.repeats > 1 else '1f1b'
    config.train.rampup.start = 0  # the step of the full batch is the one that counts
    return config_lib.resolve(config, devices)


def describe(config):
    """The layout of a resolved config in one short string."""
    mesh, train, pipe, model = config.mesh, config.train, config.pipeline, config.model
    text = f't{mesh.tensor}' + (f' c{mesh.context}' if mesh.context > 1 else '')
    text += f' p{mesh.stage} d{mesh.data}'
    if mesh.expert > 1:
        text += f' x{mesh.expert}'
    if 'moe' in model and model.moe.fold_tensor and mesh.tensor > 1:
        text += ' fold'
    if mesh.stage > 1:
        text += f' v{pipe.repeats}'
        if pipe.schedule in ('zbh1', 'zbv'):
            text += f' {pipe.schedule}'
        if pipe.max_in_flight:
            text += f' inflight{pipe.max_in_flight}'
    text += f' b{train.micro_batch} m{train.micro_steps} remat {model.remat}'
    if config_lib.recomputed(model):
        text += f' recompute {",".join(config_lib.recomputed(model))}'
    return text + (' SP' if model.sequence_parallel else '')


def _entry(config, step, per_device):
    return dict(
        layout=describe(config),
        keys={key: _get(config, key) for key in FREE_KEYS},
        config=report.config_summary(config),
        sequence_parallel=bool(config.model.sequence_parallel),
        max_in_flight=config.pipeline.max_in_flight,
        per_device_bytes=per_device,
        step=step,
    )


def fits(per_device, cluster):
    """Whether a plan's bytes per device fit the GPU with the compile's margin (FIT_MARGIN)."""
    return per_device['total'] * FIT_MARGIN <= cluster.hbm_bytes


def search(inputs, devices, cluster, fixed=(), top=10, progress=True, figures=None):
    """{'best': [entries, fastest first], 'baseline': the config as given, counts} of the
    layouts that fit (module docstring). inputs: the unresolved config (overrides applied);
    cluster: a clusters.Cluster; figures: predict.Efficiency (default: the cluster's).
    SearchError if no layout can use `devices` GPUs. A layout with recompute names (unless
    the user fixed them) is predicted only where the same layout without them holds more than
    NEAR_FULL of the GPU's memory: the names add recompute to the step, so they are no faster
    where it fits, and near the limit the plan's few percent decide (docs/benchmarks.md)."""
    out = sys.stderr if progress else None
    candidates = list(layouts(inputs, devices, cluster.gpus_per_node, set(fixed)))
    if not candidates:  # before any progress is printed: bad input is one line
        raise SearchError(_no_layout(inputs, devices, fixed))
    named = 'model.remat_recompute' not in fixed
    deferred = {}  # the layout without names -> those with
    for layout in candidates:
        if named and layout.get('model.remat_recompute'):
            deferred.setdefault(_unnamed(layout), []).append(layout)
    first = [k for k in candidates if not (named and k.get('model.remat_recompute'))]
    predictor = _Predictor(inputs, devices, fixed, cluster, figures)
    for layout in tqdm(first, desc='predicting layouts', file=out, disable=not progress):
        predictor.push(layout)
    if not predictor.ranked:
        raise SearchError(_no_layout(inputs, devices, fixed))
    best, checked = [], 0
    bar = tqdm(total=top, desc='checking memory', file=out, disable=not progress)
    while predictor.ranked and len(best) < top:
        _, _, layout, config, step = heapq.heappop(predictor.ranked)
        checked += 1
        per_device, _ = report.memory(config, cluster)
        if fits(per_device, cluster):
            best.append(_entry(config, step, per_device))
            bar.update()
        if per_device['total'] > NEAR_FULL * cluster.hbm_bytes:  # what the names free may fit
            for other in deferred.pop(_unnamed(layout), ()):
                predictor.push(other)
    bar.close()
    best.sort(key=lambda entry: entry['step']['predicted_step_s'])
    return dict(
        devices=devices,
        cluster=cluster.name,
        fixed=sorted(fixed),
        layouts=len(candidates),
        predicted=predictor.predicted,
        refused=predictor.refused,
        memory_checked=checked,
        best=best,
        baseline=baseline(inputs, devices, cluster, figures),
    )


def _unnamed(layout):
    return tuple(sorted({**layout, 'model.remat_recompute': ''}.items()))


class _Predictor:
    """search's heap of (predicted step, order, layout, config, step) and its counts."""

    def __init__(self, inputs, devices, fixed, cluster, figures):
        self.inputs, self.devices, self.fixed = inputs, devices, fixed
        self.cluster, self.figures = cluster, figures
        self.ranked, self.counts, self.predicted, self.refused = [], {}, 0, 0

    def push(self, layout):
        """Resolve and predict `layout` onto the heap (counted refused if it cannot run)."""
        self.predicted += 1
        try:
            config = with_layout(self.inputs, layout, self.devices, self.fixed)
        except config_lib.ConfigError:
            self.refused += 1
            return
        key = tuple(layout.get(k) for k in (*MESH_KEYS, 'model.moe.fold_tensor'))
        if key not in self.counts:  # data and stage traffic depend on the mesh alone
            self.counts[key] = predict.traffic(config)
        step = predict.step_time(config, self.cluster, self.figures, counts=self.counts[key])
        item = (step['predicted_step_s'], self.predicted, layout, config, step)
        heapq.heappush(self.ranked, item)


def _no_layout(inputs, devices, fixed):
    return (
        f'no layout of {inputs.model.num_layers} layers, {inputs.model.heads} heads and '
        f'global batch {inputs.train.global_batch} uses {devices} GPUs (data x stage x '
        f'expert x context x tensor must be {devices}, data x expert must divide the global batch)'
        + (f'; fixed: {", ".join(sorted(fixed))}' if fixed else '')
    )


def baseline(inputs, devices, cluster, figures=None):
    """The config as given, on `devices` GPUs, predicted the same way (None if it cannot
    run there)."""
    try:
        config = config_lib.resolve(ml_collections.ConfigDict(inputs.to_dict()), devices)
    except config_lib.ConfigError:
        return None
    per_device, _ = report.memory(config, cluster)
    entry = _entry(config, predict.step_time(config, cluster, figures), per_device)
    entry['fits'] = fits(per_device, cluster)
    entry['uncounted_copies'] = arithmetic.uncounted_expert_copies(config)
    return entry


def confirm(result, inputs, compile_fn, top=3):
    """Compile the first `top` layouts of a search with `compile_fn(resolved config) ->
    JSON-ready dict` (the GPU compile: memory per device, FLOPs) and store what it returns as
    entry['compiled']. Returns the result."""
    for entry in result['best'][:top]:
        config = with_layout(inputs, entry['keys'], result['devices'], result['fixed'])
        entry['compiled'] = compile_fn(config)
    return result


def _gib(n):
    return footprint.format_bytes(n)


def _row(rank, entry, width):
    s = entry['step']
    comm = (
        s['tensor_comm_s']
        + s.get('expert_comm_s', 0.0)
        + s['pipeline_comm_s']
        + s['data_comm_s']
        + s['stage_comm_s']
    )
    return (
        f'{rank:>4}  {entry["layout"]:<{width}} {_gib(entry["per_device_bytes"]["total"]):>9} '
        f'{s["predicted_step_s"]:>8.2f} {s["tflops_per_gpu"]:>6.1f} {100 * s["mfu"]:>5.1f} '
        f'{s["bubble_s"]:>7.2f} {comm:>6.2f} {s["recompute_s"]:>6.2f}'
    )


def _as_given_fits(base):
    """The note after the config's own row: it does not fit, or the plan cannot say (a layout
    the search leaves out: the batched path's weight copies, arithmetic.uncounted_expert_copies)."""
    if not base['fits']:
        return '  (does NOT fit)'
    return (
        "  (fits not known: the batched path's weight copies not counted)"
        if base.get('uncounted_copies')
        else ''
    )


def lines(result):
    """The readable table of a search."""
    base = result['baseline']
    shown = [*result['best'], *([base] if base else [])]
    width = max([len('layout')] + [len(entry['layout']) for entry in shown])
    head = (
        f'{"rank":>4}  {"layout":<{width}} {"memory":>9} {"step s":>8} {"TF/s":>6} {"MFU%":>5} '
        f'{"bubble":>7} {"comm":>6} {"recomp":>6}'
    )
    out = [
        f'search       {result["layouts"]} layouts on {result["devices"]} GPUs of '
        f'{result["cluster"]}, {result["predicted"]} predicted (recompute names where the '
        f'layout without them is near full), {result["refused"]} refused by the config '
        f'checks; memory checked for the {result["memory_checked"]} fastest until '
        f'{len(result["best"])} fit'
        + (f'; fixed: {", ".join(result["fixed"])}' if result['fixed'] else ''),
        '             step: predicted seconds (plan/predict.py); TF/s executed per GPU; MFU: '
        'model FLOPs; bubble, comm (exposed), recomp: seconds of the step',
        head,
    ]
    out += [_row(rank, entry, width) for rank, entry in enumerate(result['best'], 1)]
    if base is not None:
        out.append(_row('as', base, width) + _as_given_fits(base))
        if result['best']:
            gain = base['step']['predicted_step_s'] / result['best'][0]['step']['predicted_step_s']
            faster = 100 * (1 - 1 / gain)
            out.append(f'             best is {faster:.1f} % faster than the config as given')
    if result['best']:
        out.append(f'             rank 1 as flags: {flags(result["best"][0], base) or "as given"}')
    return out


def flags(entry, base=None):
    """The --config.KEY=VALUE flags that give `entry`'s layout (those keys where it differs
    from `base`, the config as given, if there is one)."""
    keys = entry['keys']
    differ = [k for k in FREE_KEYS if base is None or _named(base['keys'][k]) != _named(keys[k])]
    return ' '.join(f'--config.{key}={keys[key]}' for key in differ)


def _named(value):
    return 'interleaved' if value == '1f1b' else value  # one engine: the table of the repeats


def run(args, fixed, write_json):
    """launch/plan.py --search: check the flags, search, print the table, write --json.
    args: plan.py's parsed arguments (config not yet resolved); fixed: the keys the command
    line set; write_json(path, obj): the tool's atomic writer."""
    from mtnlg_jax.run.cli import fail  # noqa: PLC0415
    from mtnlg_jax.plan.clusters import CLUSTERS  # noqa: PLC0415

    if args.cluster is None:
        fail(f'--search needs --cluster (one of {", ".join(CLUSTERS)})')
    if args.compile:
        fail('--search --compile needs the GPU compile (--target); without it, drop --compile')
    cluster = CLUSTERS[args.cluster]
    if (args.devices is None) == (args.nodes is None):
        fail('--search needs one of --devices N or --nodes N (GPUs to lay the model out on)')
    count = args.devices if args.devices is not None else args.nodes * cluster.gpus_per_node
    if count <= 0:
        fail(f'--{"devices" if args.devices is not None else "nodes"} must be positive')
    try:
        result = search(args.config, count, cluster, fixed)
    except SearchError as e:
        fail(f'--devices {count}: {e}')
    print('\n'.join(lines(result)))
    if args.json is not None:
        write_json(args.json, json.loads(json.dumps(result, default=float)))
        print(f'wrote {args.json}')
