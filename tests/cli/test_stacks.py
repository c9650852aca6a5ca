"""``cli/stacks.py`` in a real child process: the stop watchdog writes every thread's stack once its time
is up, in the main program or while the exit waits for a thread, and the process carries on; a process
that exits in time writes nothing."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

CHILD = """
import sys, threading, time
from kvrouter.cli.stacks import stacks_later

def stuck_in_a_side_thread(seconds):
    time.sleep(seconds)

def stuck_stopping(seconds):
    time.sleep(seconds)

after_s, main_s, side_s = map(float, sys.argv[1:])
threading.Thread(target=stuck_in_a_side_thread, args=(side_s,)).start()  # not a daemon: the exit joins it
stacks_later(after_s)
stuck_stopping(main_s)
print("carried on", flush=True)
"""


def _run(after_s: float, main_s: float, side_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(after_s), str(main_s), str(side_s)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_stop_that_overruns_writes_every_threads_stack_and_carries_on():
    done = _run(0.2, 1.0, 1.0)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "carried on\n"
    assert "Timeout (0:00:00.200000)!" in done.stderr
    assert "in stuck_stopping" in done.stderr  # the main thread, where it waits
    assert "in stuck_in_a_side_thread" in done.stderr  # and every other thread


def test_an_exit_that_waits_too_long_for_a_thread_writes_the_stacks_too():
    done = _run(0.5, 0.0, 1.5)
    assert done.returncode == 0, done.stderr
    assert "in stuck_in_a_side_thread" in done.stderr
    assert "in stuck_stopping" not in done.stderr  # the main program had ended


def test_a_process_that_exits_in_time_writes_nothing():
    done = _run(5.0, 0.1, 0.2)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "carried on\n"
    assert done.stderr == ""
