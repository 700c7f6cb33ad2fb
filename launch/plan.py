"""What a run costs before it runs: memory per device, FLOPs, communication and, on a named
cluster, whether it fits and how fast it can go; with --compile, the real train step compiled
on CPU devices and measured.

    python launch/plan.py --config configs/mtnlg_530b.py --devices 2240 --cluster a100-80gb
    python launch/plan.py --config configs/tiny.py --compile --json plan.json
    python launch/plan.py --config configs/mtnlg_530b.py --devices 2240 --target a100-80gb \\
        --compile --json plan.json
        [--config.KEY=VALUE ...] (the overrides launch/train.py takes)
    python launch/plan.py --config configs/mtnlg_530b.py --search --cluster a100-80gb \\
        --nodes 280 [--json best.json]     the ten fastest layouts that fit (plan/search.py)

--target a100-80gb | h100-80gb | h200-141gb compiles the step with XLA:GPU for that GPU on
compile-only devices, the whole layout in one process and on a machine without a GPU (after `make
gpu-compile`: mtnlg_jax/xla/gpu_compile.py), with the recommended XLA:GPU flags
(mtnlg_jax/xla/flags.py; your own XLA_FLAGS win). It adds what only a GPU compile shows: the
fused attention kernels, and the overlap of each collective with compute, replayed on the
target's figures. It times nothing: no GPU runs, and XLA skips autotuning without one.

--devices N: the device count the config is resolved against (a mesh axis of -1 takes what the
others leave); default: the product of the mesh axes, a -1 axis counted as 1 (one replica).
Without --compile or --target (which compiles) this is arithmetic: no devices needed.
--compile lowers and compiles the train step launch/train.py runs, on N forced CPU devices
(this tool sets XLA_FLAGS and JAX_PLATFORMS=cpu itself, before JAX starts), with abstract
state: nothing is allocated. XLA:CPU allows 2,048 devices in one process: a larger layout
is compiled as one replica (data 1, the global batch cut to keep the micro-batch count of a
replica) and the output says so, unless it runs as several processes, each with its share of
the devices (jax.distributed, as launch/train.py; process 0 prints):

    python launch/spawn.py --processes 2 --devices_per_process 1120 -- \\
        launch/plan.py --config configs/mtnlg_530b.py --devices 2240 --compile

Bad input prints one line `error: ...` and exits 2 before anything is compiled or written.
"""

import os
import sys
import tempfile

from mtnlg_jax.config import keys
from mtnlg_jax.run import cli, distributed
from mtnlg_jax.xla import gpu_compile
from mtnlg_jax.run.cli import fail

MAX_CPU_DEVICES = 2048  # XLA:CPU's limit per process


def parse_args(argv):
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_config()
    parser.add_argument(
        '--compile', action='store_true', help='compile the train step on CPU and measure it'
    )
    parser.add_argument('--devices', type=int, help='devices the layout is resolved against')
    parser.add_argument('--cluster', help='named cluster: does it fit, how fast at best')
    parser.add_argument(
        '--target', help='compile for this GPU with XLA:GPU, no GPU needed (a cluster name)'
    )
    parser.add_argument('--json', help='also write the plan as one JSON object to this path')
    parser.add_argument(
        '--pgle', action='store_true',
        help='--target: compile twice, the second time XLA scheduling by the first replay\'s '
        'costs (plan/pgle.py); a config with train.pgle_profile_steps does without it',
    )  # fmt: skip
    parser.add_argument(
        '--search', action='store_true',
        help='the fastest layouts that fit on --cluster (keys set by --config.KEY stay fixed)',
    )  # fmt: skip
    parser.add_argument('--nodes', type=int, help='--search: nodes of the cluster to use')
    distributed.add_arguments(parser)
    return parser.parse_args(argv)


def device_count(mesh, devices=None):
    """--devices, else the product of the mesh axes with a -1 axis counted as 1."""
    if devices is not None:
        if devices <= 0:
            fail(f'--devices must be a positive integer, got {devices}')
        return devices
    return keys.mesh_devices(mesh)


def one_replica(config):
    """The config's layout at data 1, each replica's micro-batch count kept."""
    import ml_collections  # noqa: PLC0415

    from mtnlg_jax import config as config_lib  # noqa: PLC0415

    replica = ml_collections.ConfigDict(config.to_dict())
    replica.train.global_batch = config.train.global_batch // config.mesh.data
    replica.train.rampup.start = 0
    replica.mesh.data = 1
    return config_lib.resolve(replica, keys.mesh_devices(replica.mesh))


def set_cpu_flags(devices):
    """What the CPU compile needs, set before JAX is imported (only in this process)."""
    os.environ['JAX_PLATFORMS'] = 'cpu'
    os.environ['XLA_FLAGS'] = ' '.join(
        [
            os.environ.get('XLA_FLAGS', ''),
            f'--xla_force_host_platform_device_count={devices}',
            # XLA:CPU aborts on a bf16 all-reduce inside the pipeline without this.
            '--xla_disable_hlo_passes=all-reduce-promotion',
        ]
    ).strip()


def write_json(path, plan):
    """Write atomically: an existing file is replaced only by a complete one."""
    cli.write_json(path, plan, '--json')


def main(argv):
    args = parse_args(argv)
    # The planner runs on the CPU, whatever compiles it targets (with the gpu-compile extra
    # installed, JAX would otherwise look for a CUDA driver first).
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
    if args.target is not None:
        check_target(args)
    elif args.pgle:
        fail('--pgle schedules an XLA:GPU compile by its replay: give --target too')
    from mtnlg_jax import config as config_lib  # noqa: PLC0415 (no JAX yet)
    from mtnlg_jax.plan.clusters import CLUSTERS  # noqa: PLC0415

    if args.cluster is not None and args.cluster not in CLUSTERS:
        fail(f'--cluster {args.cluster!r} is not one of {", ".join(CLUSTERS)}')
    if args.json is not None:
        cli.check_output(args.json, '--json', make=True)
    if args.search:
        from mtnlg_jax.plan import search  # noqa: PLC0415

        fixed = {key for key, _ in cli.split_overrides(argv)[0]}
        return search.run(args, fixed, write_json)
    devices = device_count(args.config.mesh, args.devices)
    try:
        config = config_lib.resolve(args.config, devices)
    except config_lib.ConfigError as e:
        fail(f'{e} (resolved against --devices {devices})')

    if args.target is not None:
        return plan_for_gpu(args, config)
    compiled_config, notes = config, []
    processes = distributed.requested_process_count(args)
    if args.compile and devices > MAX_CPU_DEVICES * processes:
        compiled_config = one_replica(config)
        notes.append(
            f'compiled one replica (data 1 x stage {config.mesh.stage} x tensor '
            f'{config.mesh.tensor} = {config.mesh.stage * config.mesh.tensor} devices, global '
            f'batch {compiled_config.train.global_batch}, {compiled_config.train.micro_steps} '
            f'micro-batches as each of the {config.mesh.data} replicas has): XLA:CPU allows '
            f'{MAX_CPU_DEVICES} devices per process, the layout needs {devices} (run as '
            f'several processes with launch/spawn.py to compile it all); over data the '
            f'plan\'s figures stand'
        )
    total = keys.mesh_devices(compiled_config.mesh)
    if total % processes:
        fail(f'--num_processes {processes} does not divide the {total} devices of the layout')
    # the arithmetic needs no devices, and thousands of forced CPU devices take minutes to
    # tear down at exit: only a compile gets them
    set_cpu_flags(total // processes if args.compile else 1)
    distributed.initialize_for_config(config, args)  # before JAX starts
    if args.compile:
        check_xla_options(compiled_config)

    from mtnlg_jax.plan import report  # noqa: PLC0415 (imports JAX)

    plan = report.make_plan(config, args.cluster)
    if args.compile:
        from mtnlg_jax.plan import compile as compile_lib  # noqa: PLC0415

        print(
            f'compiling the train step on {compiled_config.mesh.data} x '
            f'{compiled_config.mesh.stage} x {compiled_config.mesh.context} x '
            f'{compiled_config.mesh.tensor} CPU devices (data x stage x context x tensor) '
            f'(minutes for the largest configs) ...',
            file=sys.stderr,
            flush=True,
        )
        compiled, _, info = compile_lib.compile_train_step(compiled_config)
        notes += list(compile_lib.CPU_COMPILE_NOTES)
        report.add_compiled(plan, compiled_config, compiled, info, notes)
    if distributed.is_primary():
        show(plan, args.json)


def show(plan, json_path):
    from mtnlg_jax.plan import printout  # noqa: PLC0415 (imports JAX)

    print('\n'.join(printout.lines(plan)))
    if json_path is not None:
        write_json(json_path, plan)
        print(f'wrote {json_path}')


def check_target(args):
    """--target: a known GPU, one process; --cluster defaults to it. Whether the compiler is
    installed is checked once the layout is (plan_for_gpu), so bad input is named first."""
    if args.target not in gpu_compile.TARGETS:
        fail(f'--target {args.target!r} is not one of {", ".join(gpu_compile.TARGETS)}')
    if distributed.requested_process_count(args) > 1:
        fail('--target compiles the whole layout in one process: leave out --num_processes')
    args.compile = True
    args.cluster = args.cluster or args.target
    args.xla_flags = gpu_compile.prepare_environment()  # before JAX starts
    gpu_compile.start_jax()


def plan_for_gpu(args, config):
    """The plan, and the train step compiled by XLA:GPU for args.target's compile-only GPUs."""
    from mtnlg_jax.plan.clusters import CLUSTERS  # noqa: PLC0415

    per_node = CLUSTERS[args.target].gpus_per_node
    fp8, capability = config.model.fp8, CLUSTERS[args.target].compute_capability
    if fp8 != 'none' and int(capability.split('.')[0]) < 9:
        fail(
            f'config key model.fp8: {fp8} FP8 needs FP8 tensor cores (Hopper, compute capability '
            f'9.0 and later); {args.target} is {capability}'
        )
    mesh = config.mesh
    total = keys.mesh_devices(mesh)
    if per_node % mesh.tensor or (total > per_node and total % per_node):
        fail(
            f'mesh.tensor {mesh.tensor} with {total} devices: {args.target} nodes hold '
            f'{per_node} GPUs; tensor groups must stay inside a node and the devices fill nodes'
        )
    missing = gpu_compile.missing()
    if missing:
        fail(f'--target {args.target}: {missing}')
    check_xla_options(config)
    from mtnlg_jax.plan import compile as compile_lib  # noqa: PLC0415 (imports JAX)
    from mtnlg_jax.plan import report  # noqa: PLC0415

    plan = report.make_plan(config, args.cluster)
    print(
        f'compiling the train step with XLA:GPU for {total} x {args.target} (data '
        f'{mesh.data} x stage {mesh.stage} x context {mesh.context} x tensor {mesh.tensor}'
        + (f' x expert {mesh.expert}' if mesh.expert > 1 else '')
        + '; minutes for the largest configs) ...',
        file=sys.stderr,
        flush=True,
    )
    notes = list(compile_lib.gpu_compile_notes(args.target, args.xla_flags))
    if config.train.xla_options:
        notes.append(f'XLA options of the config (train.xla_options): {config.train.xla_options}')
    # a config whose run schedules by a profile (train.pgle_profile_steps) compiles as it runs
    pgle = args.pgle or config.train.pgle_profile_steps > 0
    options = scheduled_by_replay(args, config, per_node, notes) if pgle else None
    compiled, info = compile_for_gpu(args, config, per_node, options)
    report.add_compiled(plan, config, compiled, info, notes, target=args.target)
    show(plan, args.json)


def check_xla_options(config):
    """Exit 2 naming train.xla_options if XLA does not take them: before the step's compile."""
    from mtnlg_jax import config as config_lib  # noqa: PLC0415
    from mtnlg_jax.xla import options  # noqa: PLC0415 (imports JAX)

    why = options.refused(config_lib.xla_options(config.train))
    if why:
        fail(why)


def compile_for_gpu(args, config, per_node, compiler_options=None):
    """(compiled, info) of the train step for args.target, or exit 1 with XLA's one line."""
    import jax  # noqa: PLC0415

    from mtnlg_jax.plan import gpu_target  # noqa: PLC0415 (imports JAX)

    with gpu_compile.without_driver_noise():
        try:
            return gpu_target.compile_train_step(config, args.target, per_node, compiler_options)
        except jax.errors.JaxRuntimeError as e:  # XLA's own limits (no input of the user's)
            print(
                f'error: XLA:GPU could not compile this step for {args.target}: '
                f'{str(e).splitlines()[0][:300]}',
                file=sys.stderr,
            )
            sys.exit(1)


def scheduled_by_replay(args, config, per_node, notes):
    """--pgle: the first compile's replayed costs as XLA's latency profile (plan/pgle.py), in
    a file beside --json (else a temporary one); the compiler options that read it. Notes
    the first compile's figures."""
    from mtnlg_jax.plan import pgle, report  # noqa: PLC0415

    if args.json:
        path = f'{args.json}.pgle.pbtxt'
    else:
        handle, path = tempfile.mkstemp(suffix='.pgle.pbtxt')
        os.close(handle)
    first = report.make_plan(config, args.cluster)
    compiled, info = compile_for_gpu(args, config, per_node)
    report.add_compiled(first, config, compiled, info, target=args.target, profile=path)
    o = first['compiled']['overlap']
    lockstep = o['lockstep']['step_s'] if o['lockstep'] else o['step_s']
    why = '' if args.pgle else ' (train.pgle_profile_steps: the run does it with measured costs)'
    line = (
        f'pgle: compiled again with the first compile\'s replayed costs as XLA\'s latency '
        f'profile{why} ({path}); the first: exposed {o["exposed_s"]:.3f} s '
        f'({100 * o["exposed_vs_compute"]:.1f} % of compute), replayed {o["step_s"]:.3f} s, '
        f'lockstep {lockstep:.3f} s'
    )
    print(line, file=sys.stderr, flush=True)
    notes.append(line)
    return {pgle.OPTION: path}


if __name__ == '__main__':
    main(sys.argv[1:])
