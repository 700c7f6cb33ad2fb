"""One program, several processes: `jax.distributed` before any other JAX call.

Every launch script calls `initialize` first. It decides, in this order, whether this process
is one of several:

    --coordinator HOST:PORT --num_processes N --process_id I     flags, all three
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID    environment (launch/spawn.py)
    SLURM (SLURM_NTASKS > 1) or Open MPI (OMPI_COMM_WORLD_SIZE > 1): jax.distributed reads
                                                                  the scheduler's variables
    none of these                                                 one process: nothing to do

Several processes then see one another's devices (on CPU, process k's device ids start at
k x 2048) and run collectives through NCCL (GPU) or gloo (CPU). A process that stops sending
heartbeats for `heartbeat_timeout_s` (default 30 s; JAX's own default is 100 s) ends every
other process: the coordination service aborts them with a fatal log naming the lost task, so
no survivor hangs in a collective waiting for it (nothing after that abort runs, not even a
Python `finally`). A lost process 0 (the coordinator) ends the others within seconds.

Bad values (a malformed or unresolvable coordinator, a process id outside 0 .. N-1, only some
of the three flags) are one `error:` line and exit status 2, before JAX starts.

The node of each process (its host name, exchanged through the coordinator's key-value
store) is what parallel/mesh.py needs to keep `tensor` groups inside one node.
"""

import os
import socket
import sys
import traceback

from mtnlg_jax.run.cli import fail

HEARTBEAT_TIMEOUT_S = 30
INITIALIZATION_TIMEOUT_S = 300  # process 0 of a large job may start minutes after the others
ENV = dict(
    coordinator='JAX_COORDINATOR_ADDRESS',
    num_processes='JAX_NUM_PROCESSES',
    process_id='JAX_PROCESS_ID',
)
FLAG_HELP = dict(
    coordinator='HOST:PORT of process 0 (several processes; default $JAX_COORDINATOR_ADDRESS)',
    num_processes='number of processes (default $JAX_NUM_PROCESSES, or SLURM / Open MPI)',
    process_id='this process, 0 .. num_processes - 1 (default $JAX_PROCESS_ID)',
)

_node_of_process = {}  # process index -> node index, filled by initialize


def add_arguments(parser):
    """--coordinator, --num_processes, --process_id on an argparse parser."""
    group = parser.add_argument_group('several processes (see launch/spawn.py, launch/slurm/)')
    group.add_argument('--coordinator', help=FLAG_HELP['coordinator'])
    group.add_argument('--num_processes', type=int, help=FLAG_HELP['num_processes'])
    group.add_argument('--process_id', type=int, help=FLAG_HELP['process_id'])


def _scheduler():
    """'SLURM' or 'Open MPI' when a scheduler started this process as one of several."""
    if int(os.environ.get('SLURM_NTASKS', '1')) > 1 and 'SLURM_PROCID' in os.environ:
        return 'SLURM'
    if int(os.environ.get('OMPI_COMM_WORLD_SIZE', '1')) > 1:
        return 'Open MPI'
    return None


def _from_environment(name, value):
    if value is not None:
        return value, f'--{name}'
    text = os.environ.get(ENV[name])
    if text is None or name == 'coordinator':
        return text, ENV[name]
    try:
        return int(text), ENV[name]
    except ValueError:
        fail(f'{ENV[name]}={text!r} is not an integer')


def check_coordinator(address, source='--coordinator'):
    """HOST:PORT with a port in 1..65535 and a host that resolves, else the error line."""
    host, _, port = address.rpartition(':')
    host = host.strip('[]')
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        fail(f'{source} {address!r}: expected HOST:PORT, e.g. localhost:12355')
    try:
        socket.getaddrinfo(host, int(port))
    except (socket.gaierror, UnicodeError) as e:
        fail(f'{source} {address!r}: cannot resolve host {host!r} ({e})')


def initialize(
    coordinator=None,
    num_processes=None,
    process_id=None,
    heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    initialization_timeout_s=INITIALIZATION_TIMEOUT_S,
):
    """Join the other processes if there are any (see the module docstring); returns the
    process count. Must run before anything initialises a JAX backend."""
    values, sources = {}, {}
    for name, given in (
        ('coordinator', coordinator),
        ('num_processes', num_processes),
        ('process_id', process_id),
    ):
        values[name], sources[name] = _from_environment(name, given)
    scheduler = _scheduler()
    if all(v is None for v in values.values()) and scheduler is None:
        return 1
    if scheduler is None:
        missing = [f'--{n} (or {ENV[n]})' for n, v in values.items() if v is None]
        if missing:
            given = ', '.join(sources[n] for n, v in values.items() if v is not None)
            fail(f'{given} given without {" and ".join(missing)}: several processes need all three')
    n, i = values['num_processes'], values['process_id']
    if n is not None and n < 1:
        fail(f'{sources["num_processes"]} must be a positive integer, got {n}')
    if n is not None and i is not None and not 0 <= i < n:
        fail(f'{sources["process_id"]} must be in 0 .. {n - 1}, got {i}')
    if values['coordinator'] is not None:
        check_coordinator(values['coordinator'], sources['coordinator'])
    if n == 1:
        return 1

    import jax

    try:
        jax.distributed.initialize(
            values['coordinator'],
            n,
            i,
            initialization_timeout=initialization_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            # A process that exits waits this long at the shutdown barrier for the others.
            shutdown_timeout_seconds=heartbeat_timeout_s,
        )
    except Exception as e:  # the coordinator's answer (or its absence), as one line
        where = values['coordinator'] or f'the {scheduler} job'
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fail(f'cannot join {where} as process {i} of {n}: {first[:300]}')
    _exchange_nodes()
    return jax.process_count()


def requested_process_count(args):
    """How many processes this one will join (args: the parsed flags of add_arguments; the
    environment, SLURM or Open MPI), known before JAX starts; 1 when none says."""
    size = {'SLURM': 'SLURM_NTASKS', 'Open MPI': 'OMPI_COMM_WORLD_SIZE'}.get(_scheduler())
    for text in (
        getattr(args, 'num_processes', None),
        os.environ.get(ENV['num_processes']),
        size and os.environ.get(size),
    ):
        if text is not None and str(text).isdigit() and int(text) > 0:
            return int(text)
    return 1


def initialize_for_config(config, args):
    """`initialize` with the parsed flags of add_arguments (args) and the timeouts of
    config.distributed (a workdir's older config.json may lack them: the defaults)."""
    section = config.get('distributed') or {}
    timeouts = {}
    for key, default in (
        ('heartbeat_timeout_s', HEARTBEAT_TIMEOUT_S),
        ('initialization_timeout_s', INITIALIZATION_TIMEOUT_S),
    ):
        value = section.get(key, default)
        if not isinstance(value, int) or value < 1:
            fail(f'config key distributed.{key}: must be a positive integer, got {value!r}')
        timeouts[key] = value
    return initialize(**{name: getattr(args, name, None) for name in ENV}, **timeouts)


def _exchange_nodes():
    """Node index of every process from the host names, in order of first appearance.
    jax.distributed has no public key-value API; its client (which multihost_utils uses too)
    shares the names without compiling anything."""
    import jax
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    me = jax.process_index()
    client.key_value_set(f'mtnlg_jax/host/{me}', socket.gethostname())
    hosts = [
        client.blocking_key_value_get(f'mtnlg_jax/host/{p}', INITIALIZATION_TIMEOUT_S * 1000)
        for p in range(jax.process_count())
    ]
    order = list(dict.fromkeys(hosts))
    _node_of_process.update({p: order.index(host) for p, host in enumerate(hosts)})


def exit_after_runtime_error(error):
    """In a run of several processes, a JAX runtime error (most often a collective that lost
    its peer: gloo's "Connection reset by peer") ends this process at once, its last line
    `error: ...`: a normal exit would wait at jax.distributed's shutdown barrier for the lost
    process and end in the coordination service's fatal abort. One process: returns."""
    import jax

    if jax.process_count() == 1:
        return
    traceback.print_exception(error, file=sys.stderr)
    text = str(error).strip().splitlines()
    print(
        f'error: process {jax.process_index()} of {jax.process_count()} stops: '
        f'{text[0][:300] if text else type(error).__name__} (a failed collective means another '
        f'process was lost; the others stop within distributed.heartbeat_timeout_s)',
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def node_of(device):
    """The node (host) index of a device: 0 for every device of a single process."""
    return _node_of_process.get(device.process_index, 0)


def is_primary():
    """True on the process that prints, logs and writes the run's outputs (process 0)."""
    import jax

    return jax.process_index() == 0


def wait_for_peers(name):
    """Every process waits here for the others (a collective over all devices; nothing with
    one process). The heartbeat ends a wait for a peer that is gone."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
