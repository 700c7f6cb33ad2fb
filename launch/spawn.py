"""Run a launch script as several processes on this machine, each with its own CPU devices.

    python launch/spawn.py --processes 2 --devices_per_process 4 -- \\
        launch/train.py --config configs/tiny.py --workdir runs/tiny2

Everything from the script's name on is its command line, untouched: the `--` before it is
optional (flags of spawn's own after the script's name are the script's). The same command as
one process, run as P: each process gets D simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=D) and joins the others through
jax.distributed on a free localhost port (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID: mtnlg_jax/run/distributed.py reads them), so the script sees P x D devices and
runs its collectives through gloo, as it would run through NCCL on P GPU hosts.

    process 0        prints to this terminal
    process 1 .. P-1 write WORKDIR/logs/process_N.log (from the moment the script has created
                     WORKDIR; until then, and for scripts without --workdir, spawn keeps their
                     lines, so a command with bad input leaves nothing on disk)
    Ctrl-C           SIGTERM to every process: a training run saves and stops at one step
                     (a second one, a second or more later: SIGKILL; the same signal twice
                     within a second is one request, as `timeout` delivers it)
    one fails        the others get --grace_s seconds to end on their own (a lost process
                     ends them within the heartbeat timeout), then SIGKILL; spawn prints one
                     line naming the process that failed and its last line, and exits
                     non-zero (2 when the script rejected its input); a stalled process
                     (its watchdog's status 3) is named before the peers it took down;
                     when every process ended 1 on the same `error:` line (a full disk
                     they share), process 0's line stands alone
"""

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from mtnlg_jax.run.cli import ArgumentParser, fail
from mtnlg_jax.run.rundir import RunDir
from mtnlg_jax.train.watchdog import STALLED

DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'
BAD_INPUT = 2


def parse_args(argv):
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument('--processes', type=int, required=True, help='P processes')
    parser.add_argument('--devices_per_process', type=int, required=True, help='D CPU devices')
    parser.add_argument(
        '--grace_s',
        type=float,
        default=10.0,
        help='after one process fails, seconds the others get to end on their own',
    )
    parser.add_argument(
        'command', nargs=argparse.REMAINDER, help="[--] SCRIPT ARGS... (the script's command line)"
    )
    args = parser.parse_args(argv)
    if args.command[:1] == ['--']:
        args.command = args.command[1:]
    if not args.command:
        fail('give the script to run after --, e.g. -- launch/train.py --config ...')
    if not os.path.isfile(args.command[0]):
        fail(f'{args.command[0]}: no such script')
    for name in ('processes', 'devices_per_process'):
        if getattr(args, name) < 1:
            fail(f'--{name} must be a positive integer, got {getattr(args, name)}')
    if args.grace_s < 0:
        fail(f'--grace_s must be >= 0, got {args.grace_s}')
    return args


def workdir_of(command):
    """The --workdir of the script's command line, if it has one."""
    for i, arg in enumerate(command):
        if arg == '--workdir' and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith('--workdir='):
            return arg.split('=', 1)[1]
    return None


def free_port():
    with socket.socket() as s:
        s.bind(('localhost', 0))
        return s.getsockname()[1]


def process_env(index, processes, devices, port, base=os.environ):
    """The environment of process `index`: its device count and its place among the others."""
    xla_flags = re.sub(rf'{DEVICE_COUNT_FLAG}=\S+', '', base.get('XLA_FLAGS', '')).split()
    return dict(
        base,
        XLA_FLAGS=' '.join([*xla_flags, f'{DEVICE_COUNT_FLAG}={devices}']),
        JAX_PLATFORMS=base.get('JAX_PLATFORMS', 'cpu'),
        JAX_COORDINATOR_ADDRESS=f'localhost:{port}',
        JAX_NUM_PROCESSES=str(processes),
        JAX_PROCESS_ID=str(index),
        PYTHONUNBUFFERED='1',  # lines reach the log before a fatal abort
    )


class QuietGloo:
    """Passes process 0's stderr on to this terminal without gloo's connection notices
    ('[Gloo] Rank 0 is connected to 1 peer ranks. ...', about 20 in a 2-process run), chunk by
    chunk as it arrives, so a progress bar's carriage returns still draw in place. An `error:`
    line, whole or in part, waits for what follows it: the run's error line stays the
    terminal's last, after any warning spawn prints once every process has ended (`close`)."""

    NOTICE = re.compile(rb'\[Gloo\][^\n]*\n')
    PREFIX = b'[Gloo]'
    ERROR = b'error: '

    def __init__(self, out):
        self.out, self.held = out, b''

    def feed(self, data):
        text = self.NOTICE.sub(b'', self.held + data)
        cut = text.find(self.PREFIX)  # a notice not yet ended, or the start of one
        if cut < 0:
            ends = [n for n in range(1, len(self.PREFIX)) if text.endswith(self.PREFIX[:n])]
            cut = len(text) - max(ends) if ends else len(text)
        text, self.held = text[:cut], text[cut:]
        # where the last line starts, after a newline or a progress bar's carriage return (a
        # whole line, or what has come of one: an unbuffered print writes its line and its
        # newline apart, and a read may end between them)
        end = len(text) - 1 if text.endswith(b'\n') else len(text)
        last = max(text.rfind(b'\n', 0, end), text.rfind(b'\r', 0, end)) + 1
        line = text[last:]
        if line and (line.startswith(self.ERROR) or self.ERROR.startswith(line)):
            text, self.held = text[:last], line + self.held
        self.out.write(text)
        self.out.flush()

    def close(self):
        self.out.write(self.NOTICE.sub(b'', self.held))
        self.out.flush()

    def pump(self, stream):
        """Copy `stream` (a binary pipe) through, until it ends; `close` writes what is held."""
        for data in iter(lambda: os.read(stream.fileno(), 65536), b''):
            self.feed(data)


class Log:
    """The output of process N > 0: kept in memory until WORKDIR exists, then appended to
    WORKDIR/logs/process_N.log; remembers the last non-empty line. A log the disk refuses
    keeps only its last KEPT lines and says so in one warning line at the end."""

    KEPT = 1000

    def __init__(self, index, workdir):
        self.index, self.workdir = index, workdir
        self.pending, self.file, self.last_line = [], None, ''
        self.unwritten = None  # why the log could not be written (a full disk), if it could not

    def add(self, line):
        if line.startswith('[Gloo]'):  # gloo's connection notices
            return
        if line.strip():
            self.last_line = line.strip()
        self.pending.append(line)
        self.flush()

    def flush(self):
        if self.unwritten is not None:
            self.pending = self.pending[-self.KEPT :]
            return
        try:
            if self.file is None and self.workdir and os.path.isdir(self.workdir):
                path = RunDir(self.workdir).log(self.index)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self.file = open(path, 'w')
            if self.file is not None:
                self.file.writelines(self.pending)
                self.file.flush()
                self.pending = []
        except OSError as error:  # a full disk: the log stops, the run's own line says why
            self.unwritten = f'{error.strerror or error}'

    def close(self):
        self.flush()
        if self.file is not None:
            try:
                self.file.close()
            except OSError as error:
                self.unwritten = self.unwritten or f'{error.strerror or error}'
        if self.unwritten is not None:
            path = RunDir(self.workdir).log(self.index)
            print(
                f'warning: {path}: not written in full ({self.unwritten}); process '
                f'{self.index} ended on: {self.last_line[:300]}',
                file=sys.stderr,
            )


def _die_with_parent():
    """In the child, before exec: SIGKILL when spawn dies (even by SIGKILL), so no process
    outlives its launcher and holds the others' devices. Linux's prctl; elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start(args):
    """The P processes (each in its own session: Ctrl-C reaches spawn only, which passes it
    on as SIGTERM), the Log of each process but 0, the readers, and process 0's QuietGloo."""
    port, workdir = free_port(), workdir_of(args.command)
    processes, logs, readers, quiet = [], {}, [], None
    for index in range(args.processes):
        env = process_env(index, args.processes, args.devices_per_process, port)
        piped = dict(stderr=subprocess.PIPE)  # process 0: this terminal's, gloo's notices out
        if index:
            piped = dict(
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors='replace',
            )
        process = subprocess.Popen(
            [sys.executable, *args.command],
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            **piped,
        )
        processes.append(process)
        if not index:
            quiet = QuietGloo(sys.stderr.buffer)
            reader = threading.Thread(target=quiet.pump, args=(process.stderr,), daemon=True)
            reader.start()
            readers.append(reader)
        else:
            logs[index] = Log(index, workdir)
            reader = threading.Thread(
                target=lambda p=process, log=logs[index]: [log.add(line) for line in p.stdout],
                daemon=True,
            )
            reader.start()
            readers.append(reader)
    return processes, logs, readers, quiet


def describe(status):
    if status < 0:
        return f'was killed by {signal.Signals(-status).name}'
    return f'exited with status {status}'


def signal_all(processes, sig):
    for process in processes:
        if process.poll() is None:
            try:
                os.kill(process.pid, sig)
            except ProcessLookupError:
                pass


def first_failure(processes, just_ended):
    """Which of the processes seen ending in the same poll failed first. A peer's death can
    end the others within the 0.1 s between polls (gloo sees the closed connection), so a
    process killed by a signal, then one whose watchdog found it stalled (status 3), is taken
    as the cause before one that exited non-zero."""
    failures = [i for i in just_ended if processes[i].returncode != 0]
    killed = [i for i in failures if processes[i].returncode < 0]
    stalled = [i for i in failures if processes[i].returncode == STALLED]
    return (killed or stalled or failures or [None])[0]


def said_the_same(statuses, logs):
    """Whether every process exited 1 with the same `error:` line as its last (a failed save
    on a shared file system): the one process 0 printed says all."""
    lines = {log.last_line for log in logs.values()}
    return set(statuses) == {1} and len(lines) == 1 and lines.pop().startswith('error: ')


# The same signal again within this many seconds is the same request delivered twice.
DUPLICATE_S = 1.0


def main(argv):
    args = parse_args(argv)
    processes, logs, readers, quiet = start(args)
    interrupts = []  # (signal, monotonic time)

    def on_interrupt(signum, frame):
        now = time.monotonic()
        if interrupts and interrupts[-1][0] == signum and now - interrupts[-1][1] < DUPLICATE_S:
            # One request delivered twice: `timeout` sends its signal to its child and to its
            # whole process group, spawn included. Only a second request stops at once.
            return
        interrupts.append((signum, now))
        signal_all(processes, signal.SIGKILL if len(interrupts) > 1 else signal.SIGTERM)

    signal.signal(signal.SIGINT, on_interrupt)
    signal.signal(signal.SIGTERM, on_interrupt)
    began = time.monotonic()
    ended, stopped = {}, set()  # index -> seconds after start; indices spawn killed
    failed = None  # index of the first process that failed
    while len(ended) < len(processes):
        now = time.monotonic() - began
        just_ended = [i for i, p in enumerate(processes) if i not in ended and p.poll() is not None]
        for index in just_ended:
            ended[index] = now
        if failed is None:
            failed = first_failure(processes, just_ended)
        if failed is not None and not stopped and now > ended[failed] + args.grace_s:
            stopped = set(range(len(processes))) - set(ended)
            signal_all(processes, signal.SIGKILL)
        time.sleep(0.1)
    for reader in readers:
        reader.join()
    for log in logs.values():
        log.close()
    quiet.close()  # process 0's last line, held until the logs' warnings are out
    statuses = [p.returncode for p in processes]
    if failed is None:
        return 0
    status = statuses[failed]
    if status == BAD_INPUT and statuses[0] == BAD_INPUT:
        return BAD_INPUT  # process 0 printed its `error:` line; the others said the same
    if interrupts and all(s in (0, -signal.SIGKILL) for s in statuses):
        return 1
    if said_the_same(statuses, logs):
        return 1  # process 0 printed the run's `error:` line; a second one would bury it
    last = logs[failed].last_line if failed in logs else 'see its output above'
    others = '; '.join(
        f'process {i} {describe(statuses[i])} after {ended[i]:.0f} s'
        + (' (stopped by spawn)' if i in stopped else '')
        for i in sorted(ended, key=ended.get)
        if i != failed
    )
    print(
        f'error: process {failed} of {len(processes)} {describe(status)} after '
        f'{ended[failed]:.0f} s (its last line: {last[:300]}); {others}',
        file=sys.stderr,
    )
    return BAD_INPUT if status == BAD_INPUT else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
