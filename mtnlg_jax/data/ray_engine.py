"""The Ray cluster that curation and preprocessing run on: embedded, or joined by address.

    started(workers)                 ray.init(address='local'): a Ray of `workers` CPUs inside
                                     this process's session, on 127.0.0.1 only, no dashboard;
                                     nothing to start, gone when the tool ends
    started(workers, 'HOST:PORT')    joins the running cluster whose GCS listens there (its
                                     token, when it requires one, read by Ray from
                                     RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH / ~/.ray/auth_token);
                                     `workers` then caps the CPUs a stage uses

Loopback only: ray.init turns a node address of 127.0.0.1 into the machine's routable one
(services.resolve_ip_for_localhost), and its servers then listen on every interface; Ray's
single-machine setting (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, what it runs on macOS and
Windows) keeps the node at 127.0.0.1 and every server on loopback (a test lists the sockets).
Never a bare ray.init(): it joins whatever cluster Ray's session file names, even a dead one.
An address that answers no TCP connection within a few seconds is an InputError before Ray
starts (ray.init would retry for a minute). Ray's own log lines are kept to warnings, so a
tool's error stays one line; Ray Data's progress bars show each stage's progress.
"""

import contextlib
import ctypes
import ctypes.util
import logging
import os
import socket

from mtnlg_jax.data.pieces import InputError
from mtnlg_jax.run import storage

CONNECT_SECONDS = 5
LOOPBACK = '127.0.0.1'
# The environment of Ray's worker processes, so that a worker gives its memory back when a
# task ends and its peak is what one task holds, not the most any task before it held: Arrow
# allocates from the C library rather than from its own pool (mimalloc keeps freed pages),
# and glibc maps large blocks and unmaps them when freed (by default it raises that threshold
# as blocks are freed and keeps them in its heaps). Either alone leaves a worker at its peak
# (docs/benchmarks.md, Curation). And a task's results of over 1 KiB go to the object store:
# Ray returns smaller ones (100 KiB by default) inline into the driver's own memory, and a
# shuffle's map outputs, one per map block and partition, shrink below that as the corpus
# grows (3.2 GB: the driver at 539 MB private, 283 at 200 MB). A value already in the
# environment is kept.
WORKER_ENV = {
    'ARROW_DEFAULT_MEMORY_POOL': 'system',
    'MALLOC_MMAP_THRESHOLD_': '131072',
    'MALLOC_TRIM_THRESHOLD_': '131072',
    'MALLOC_ARENA_MAX': '2',
    'RAY_max_direct_call_object_size': '1024',
}


def give_memory_back():
    """What the driver freed, back to the system: Arrow's pool and glibc's heaps keep freed
    pages (the driver starts without WORKER_ENV: it is the user's process)."""
    import pyarrow  # noqa: PLC0415 (the driver's first Ray Data job has imported it)

    pyarrow.default_memory_pool().release_unused()
    name = ctypes.util.find_library('c')
    trim = getattr(ctypes.CDLL(name), 'malloc_trim', None) if name else None
    if trim is not None:  # glibc
        trim(0)


def check_address(address):
    """InputError unless HOST:PORT accepts a TCP connection (before Ray is asked to join)."""
    host, _, port = address.rpartition(':')
    if not host or not port.isdigit():
        raise InputError(f'--ray_address {address}: not HOST:PORT')
    try:
        socket.create_connection((host, int(port)), CONNECT_SECONDS).close()
    except OSError as e:
        raise InputError(f'--ray_address {address}: unreachable ({e.strerror or e})') from None


class _NoCpuRace(logging.Filter):
    """Ray Data warns that a job "will hang" when it starts while the job before it still
    holds every CPU for a moment (seen between curation's stages on 2 workers); it does not
    hang, and a job that does is ended by the stall watch (data/stall.py) with its own line."""

    def filter(self, record):
        return 'does not have any available CPUs' not in record.getMessage()


_NO_CPU_RACE = _NoCpuRace()


class _RaisedAnyway(logging.Filter):
    """Ray Data's logs of a failed task, with its traceback: the same error, worker traceback
    and all, is raised to the caller, whose tool names it (a full disk in one line)."""

    ECHOES = (
        'An exception was raised from a task of operator',
        'Exception occurred in user code',
        'Exception occurred in Ray Data or Ray Core internal code',
        'Full stack trace',
    )

    def filter(self, record):
        return not record.getMessage().startswith(self.ECHOES)


def _quiet_failed_tasks():
    """On the handlers ray.init made (library loggers propagate to them, past logger filters)."""
    storage.quiet_logged_refusals('ray', 'ray.data')
    for name in ('ray', 'ray.data'):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _RaisedAnyway) for f in handler.filters):
                handler.addFilter(_RaisedAnyway())


def _quiet():
    os.environ.setdefault('RAY_DEDUP_LOGS', '0')
    for name in ('ray', 'ray.data', 'ray._private'):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger('ray.data.dataset').addFilter(_NO_CPU_RACE)


def _loopback_only():
    from ray._private import ray_constants

    # Token authentication on the embedded Ray too (other users of the machine reach its
    # loopback ports), set explicitly: left unset, Ray 2.60 turns it on with a warning line.
    # Ray's own switch, which also refreshes the setting this process has already read.
    if 'RAY_AUTH_MODE' not in os.environ:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()
    os.environ['RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER'] = '0'  # for the processes Ray starts
    ray_constants.ENABLE_RAY_CLUSTER = False  # read at call time by services.get_node_ip_address


class StartError(OSError):
    """The embedded Ray did not start (an overloaded machine: Ray waits 30 s for its raylet)."""


def _worker_env():
    return {k: os.environ.get(k, v) for k, v in WORKER_ENV.items()}


@contextlib.contextmanager
def _environment(values):
    """os.environ with `values` for the block (the processes Ray starts inherit it)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def _init_local(ray, workers, object_store_mb, attempts=2):
    for attempt in range(attempts):
        try:
            with _environment(_worker_env()):
                ray.init(
                    address='local',
                    num_cpus=workers,
                    include_dashboard=False,
                    _node_ip_address=LOOPBACK,
                    object_store_memory=object_store_mb and object_store_mb << 20,
                    logging_level=logging.WARNING,
                    log_to_driver=False,
                )
            return
        except Exception as e:  # Ray raises a bare Exception when its node does not come up
            ray.shutdown()
            if attempt == attempts - 1:
                raise StartError(f'the embedded Ray did not start ({e})') from None


@contextlib.contextmanager
def started(workers, address=None, object_store_mb=None, block_mb=None):
    """Ray up for the block: embedded on loopback, or joined at `address`; Ray Data's CPU use
    capped at `workers`, its blocks at `block_mb` MiB if given. A Ray already running in this
    process (a test's) is used as it is."""
    import ray
    from ray.data import DataContext

    _quiet()
    owned = not ray.is_initialized()
    if owned and address:
        check_address(address)
        ray.init(
            address=address,
            logging_level=logging.WARNING,
            log_to_driver=False,
            runtime_env={'env_vars': _worker_env()},
        )
    elif owned:
        _loopback_only()
        _init_local(ray, workers, object_store_mb)
    _quiet_failed_tasks()  # a worker's full disk is the caller's one line
    context = DataContext.get_current()
    limits = context.execution_options.resource_limits
    context.execution_options.resource_limits = limits.copy(cpu=workers)
    context.print_on_execution_start = False
    block_bytes = context.target_max_block_size
    if block_mb:
        context.target_max_block_size = block_mb << 20
    try:
        yield ray
    finally:
        context.execution_options.resource_limits = limits
        context.target_max_block_size = block_bytes
        if owned:
            ray.shutdown()
