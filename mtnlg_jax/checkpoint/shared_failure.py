"""A save that fails on one process fails on every process, at once; and the save drill, a
commit that fails as a full disk's would (checkpoint.inject_save_error_at_step).

Orbax's asynchronous save under several processes writes each process's shards, meets the
others at a barrier ('async_write_complete'), lets the primary process commit, and meets
again. A process whose write fails (a full disk under one process's shards) leaves its
background thread before the first barrier, while its finalize thread waits at the next one;
a process whose write succeeded waits at the first. Each waits for the other until orbax's
timeout (20 minutes), and neither's training loop hears of the failure meanwhile.

Here the write's failure is recorded instead of raised, so every process reaches the
barrier; each failing process posts its one-line cause to jax.distributed's key-value store
before it, and every process reads the posts after it: all see the same set, so all raise
`FailedSave` with the lowest failing process's cause, the primary commits nothing, and the
barriers behind stay matched. Under one process nothing changes (orbax raises the write's
error itself)::

    process 0:  write ── ENOSPC (recorded) ─ post cause ─┐
                                                          ├ barrier ─ read posts ─ raise
    process 1:  write ── ok ─────────────────────────────┘
"""

import errno

import jax

WRITE_BARRIER = 'async_write_complete'  # orbax's barrier after every process's write
PREFIX = 'mtnlg_jax/save_failed'


class FailedSave(RuntimeError):
    """The save failed on `process`, whose one-line cause every process names."""

    def __init__(self, process, cause):
        super().__init__(f'process {process}: {cause}')
        self.process, self.cause = process, cause


class _Recorded:
    """An orbax commit future whose failure is recorded, not raised."""

    def __init__(self, future, record):
        self._future, self._record = future, record

    def result(self, timeout=None):
        try:
            return self._future.result(timeout=timeout)
        except Exception as error:  # every write failure is the save's
            self._record(error)


class SharedFailure:
    """Records the save in flight's write failure and shares it at orbax's write barrier.
    `describe(error)` is the cause's one line, as the failing process sees it."""

    def __init__(self, describe):
        self.describe = describe
        self.error = None  # this process's write failure of the save in flight

    @staticmethod
    def needed():
        return jax.process_count() > 1

    def start(self):
        self.error = None

    def commits(self, futures):
        """`futures` (a handler's commit futures), each recording its failure."""
        return [_Recorded(f, self._first) for f in futures or ()]

    def _first(self, error):
        self.error = self.error or error

    def barrier_sync_fn(self):
        """Orbax's barrier, with the failures shared at the write barrier."""
        from jax._src import distributed
        from orbax.checkpoint import multihost

        wait = multihost.get_barrier_sync_fn()
        client = distributed.global_state.client

        def barrier(*, key, timeout_ms):
            at_write = WRITE_BARRIER in key
            if at_write and self.error is not None:
                cause = self.describe(self.error)
                client.key_value_set(f'{PREFIX}/{key}/{jax.process_index()}', cause)
            wait(key=key, timeout_ms=timeout_ms)
            if at_write:
                posts = client.key_value_dir_get(f'{PREFIX}/{key}/')
                if posts:
                    process, cause = min((int(k.rsplit('/', 1)[1]), v) for k, v in posts)
                    raise FailedSave(process, cause)

        return barrier


class _FailedCommit:
    """An orbax commit future whose write failed (the save drill's)."""

    def __init__(self, error):
        self._error = error

    def result(self, timeout=None):
        raise self._error


def with_commits(handler, failing, shared):
    """orbax's `handler`, whose commit fails as a full disk's would while `failing()` is true
    (checkpoint.inject_save_error_at_step): the failure reaches the training loop by orbax's
    own path, from its background thread. Under several processes each commit's failure is
    recorded for `shared` (a SharedFailure) instead of raised."""
    save = handler.async_save

    async def async_save(directory, *args, **kwargs):
        futures = await save(directory, *args, **kwargs)
        if failing():
            path = str(getattr(directory, 'path', directory))
            error = OSError(errno.ENOSPC, 'No space left on device (a drill)', path)
            futures = [_FailedCommit(error), *(futures or [])]  # first: it fails at once
        return shared.commits(futures) if shared.needed() else futures

    handler.async_save = async_save
    return handler


def in_chain(error, kind):
    """The first exception of type `kind` in `error`'s chain of causes, else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
