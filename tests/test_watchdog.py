"""The progress watchdog in one process, without training: its allowances, a phase that
overruns (stacks, one line, status 3) and what it must not watch. The multi-process drill is
in test_multiprocess.py."""

import re
import subprocess
import sys
import threading
import time

from mtnlg_jax.train import watchdog as watchdog_lib
from mtnlg_jax.train.watchdog import Watchdog
from support import ROOT


class Exits:
    """Records the status the watchdog exits with (instead of os._exit)."""

    def __init__(self):
        self.status, self.called = None, threading.Event()

    def __call__(self, status):
        self.status = status
        self.called.set()


def test_allowances_follow_the_slowest_phase_with_a_floor_and_wait_longer_on_the_devices():
    watchdog = Watchdog(0, floor_s=5.0, peer_grace_s=7.0)
    assert watchdog.allowance('batch') == 5.0  # nothing seen yet: the floor
    assert watchdog.allowance('step') == 5.0 + 7.0  # a peer may be the one stalled
    watchdog.slowest.update(step=0.2, save=2.0)
    assert watchdog.allowance('step') == 5.0 + 7.0  # 10 x 0.2 is under the floor
    assert watchdog.allowance('save') == 10 * 2.0 + 7.0
    watchdog.estimates['evaluation'] = lambda: 3 * watchdog.slowest['save']
    assert watchdog.allowance('evaluation') == 10 * 6.0 + 7.0
    with watchdog.phase('batch', 'step 1'):
        time.sleep(0.05)
    assert watchdog.slowest['batch'] >= 0.05
    fixed = Watchdog(4, floor_s=300.0)
    assert fixed.allowance('save') == 4 and fixed.allowance('batch') == 4


def test_a_phase_that_overruns_writes_every_stack_and_one_line_then_exits_3(tmp_path):
    exits = Exits()
    with open(tmp_path / 'stderr', 'w') as out:
        watchdog = Watchdog(0.3, 0.0, name='process 1 of 2', stderr_fd=out.fileno(), exit=exits)
        with watchdog, watchdog.phase('batch', 'step 5'):
            assert exits.called.wait(10)  # the main thread waits here, as a hung one would
    assert exits.status == watchdog_lib.STALLED == 3
    lines = (tmp_path / 'stderr').read_text().splitlines()
    assert lines[0] == 'process 1 of 2: stacks of every thread'
    assert any('in test_a_phase_that_overruns' in line for line in lines)  # the main thread
    assert any('in _fire' in line for line in lines)  # the watchdog's own
    assert re.match(
        r'error: process 1 of 2 stalled: batch \(step 5\) made no progress for \d+ s '
        r'\(allowance 0.3 s: train.hang_timeout_s\), its main thread at ',
        lines[-1],
    )
    assert 'threading.py' in lines[-1] and 'tests/test_watchdog.py' not in lines[-1]
    assert lines[-1].endswith('; exiting with status 3')


def test_unwatched_time_does_not_count_and_the_phase_clock_starts_again_after_it(tmp_path):
    exits = Exits()
    with open(tmp_path / 'stderr', 'w') as out:
        with Watchdog(0.5, 0.0, stderr_fd=out.fileno(), exit=exits) as watchdog:
            with watchdog.phase('step', 'step 1'):
                time.sleep(0.3)
                with watchdog.unwatched():  # a compile: 1.5 s, three allowances
                    time.sleep(1.5)
                time.sleep(0.3)  # 0.6 s in the phase, but 0.3 since the compile
            time.sleep(1.0)  # between phases: not watched
    assert not exits.called.is_set(), (tmp_path / 'stderr').read_text()
    assert 0.3 <= watchdog.slowest['step'] < 0.5


BLOCKED_WITH_THE_GIL = '''
import ctypes, time
from mtnlg_jax.train import watchdog as watchdog_lib
watchdog_lib.BACKSTOP_MARGIN_S = 1.0
with watchdog_lib.Watchdog(0.5, 0.0) as watchdog, watchdog.phase('batch', 'step 1'):
    time.sleep(0.2)  # the watchdog's thread arms the backstop
    ctypes.PyDLL(None).sleep(20)  # a C call that keeps the GIL: the thread cannot run
'''


def test_a_stall_that_holds_the_gil_is_ended_by_faulthandlers_backstop():
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, '-c', BLOCKED_WITH_THE_GIL],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - started < 15
    assert re.match(r'Timeout \(0:00:0\d', result.stderr), result.stderr
    assert '<string>", line 7 in <module>' in result.stderr  # the blocked main thread
    assert 'stalled' not in result.stderr  # the watchdog's own thread never got to run
