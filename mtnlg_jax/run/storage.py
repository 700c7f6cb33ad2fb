"""A write refused by the storage (a full disk, a spent quota, a read-only file system) as one
line, and the tracebacks such a failure sets off in background threads kept off stderr.

    storage_errno(error)      ENOSPC, EDQUOT or EROFS if `error` (or what it was raised from)
                              is the storage refusing a write, else None; orbax reports a
                              failed tensorstore write as a ValueError whose text carries it
    refusal(error)            'No space left on device (ENOSPC)', or None
    quiet_background_noise()  installed once per process: the threads of a failed write
                              (orbax's event loop closed under tensorstore's callbacks, an
                              asyncio future nobody awaits, tensorboard's writer) print no
                              traceback; the failure reaches the main thread, which names it
    quiet_logged_refusals(..) the same for a library's logs of it (Ray Data's)

This module imports neither JAX nor orbax: launch tools use it before JAX starts.
"""

import errno
import logging
import os
import re
import sys
import threading
import warnings

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class StorageError(RuntimeError):
    """An output the storage refused (a full disk): the one-line message names the file and
    why; the run's status is 1, as for any run gone wrong."""


_CODE = re.compile(r"os_error_code='?(\d+)")  # tensorstore's text of a failed write


def storage_errno(error):
    """The errno of a storage refusal in `error`'s chain (ENOSPC, EDQUOT, EROFS), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in FULL:
            return error.errno
        text = str(error)
        match = _CODE.search(text)
        if match and int(match.group(1)) in FULL:
            return int(match.group(1))
        for code in FULL:
            if os.strerror(code) in text:
                return code
        error = error.__cause__ or error.__context__
    return None


def refusal(error):
    """'No space left on device (ENOSPC)' for a storage refusal in `error`'s chain, else None."""
    code = storage_errno(error)
    return None if code is None else f'{os.strerror(code)} ({errno.errorcode[code]})'


def free_space(path):
    """'12.0 MiB free on /mnt' for the file system holding `path` (its nearest existing
    folder), or '' where it cannot be read."""
    folder = os.path.abspath(path)
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        stats = os.statvfs(folder)
    except OSError:
        return ''
    return f'{stats.f_bavail * stats.f_frsize / 2**20:.1f} MiB free under {folder}'


def _is_noise(value):
    """A background thread's exception that only follows a failed write the main thread names:
    the storage refusal itself, or orbax's event loop closed under a pending write."""
    if storage_errno(value) is not None:
        return True
    return isinstance(value, RuntimeError) and str(value) == 'Event loop is closed'


_refused = []  # set once this process named a refusal: asyncio's later complaints are its echo


def noted(message):
    """`message` (a refusal's one line), remembered: from now on asyncio's complaints about
    the failed write's tasks and futures (pending at exit, never retrieved) stay quiet."""
    _refused.append(message)
    # The failed write's coroutines, dropped unawaited, are garbage-collected at exit.
    warnings.filterwarnings('ignore', 'coroutine .* was never awaited', RuntimeWarning)
    return message


class _NoNoiseRecords(logging.Filter):
    """asyncio's logs of a failed write: a future's 'exception was never retrieved', a task
    'destroyed but it is pending' at exit."""

    def filter(self, record):
        if record.exc_info and _is_noise(record.exc_info[1]):
            return False
        return not (_refused and record.levelno >= logging.ERROR)


def _carries_refusal(record):
    if record.exc_info and storage_errno(record.exc_info[1]) is not None:
        return True
    return any(os.strerror(code) in record.getMessage() for code in FULL)


class _LoggedRefusals(logging.Filter):
    """A library's log of a refused write (Ray Data logs its failed task with the worker's
    traceback, then an error of its own): the caller's one line names it instead."""

    def filter(self, record):
        if _carries_refusal(record):
            noted('a write refused')
            return False
        return not (_refused and record.levelno >= logging.ERROR)


def quiet_logged_refusals(*names):
    """Keep the loggers `names`' logs of a refused write, and their errors after one, off
    their handlers (a handler filter: the libraries log from child loggers)."""
    for name in names:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _LoggedRefusals) for f in handler.filters):
                handler.addFilter(_LoggedRefusals())


_installed = False
_in_background = []  # refusals a thread died of, quietly (tensorboard's writer)


def refused_in_background():
    """The storage refusal a background thread died of (quietly), or None."""
    return _in_background[-1] if _in_background else None


def quiet_background_noise():
    """Keep a failed write's tracebacks from other threads off stderr (once per process):
    tensorstore prints its callbacks' errors through sys.unraisablehook or sys.excepthook,
    threads through threading.excepthook, asyncio through its logger. Other exceptions print
    as before."""
    global _installed
    if _installed:
        return
    _installed = True
    previous_sys, previous_thread = sys.excepthook, threading.excepthook
    previous_unraisable = sys.unraisablehook

    def sys_hook(kind, value, tb):
        # The main thread's own uncaught error always prints: only other threads are quiet.
        if threading.current_thread() is threading.main_thread() or not _is_noise(value):
            previous_sys(kind, value, tb)

    def thread_hook(args):
        if not _is_noise(args.exc_value):
            previous_thread(args)
        elif storage_errno(args.exc_value) is not None:
            _in_background.append(args.exc_value)

    def unraisable_hook(unraisable):
        if not _is_noise(unraisable.exc_value):
            previous_unraisable(unraisable)

    sys.excepthook, threading.excepthook = sys_hook, thread_hook
    sys.unraisablehook = unraisable_hook
    logging.getLogger('asyncio').addFilter(_NoNoiseRecords())
