"""``cli/stacks.py`` in a real child process: the stop watchdog writes every thread's stack once its time
is up and the process carries on; cancelled in time, it writes nothing."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

CHILD = """
import sys, threading, time
from kvrouter.cli.stacks import cancel_stacks_later, stacks_later

def stuck_in_a_side_thread():
    time.sleep(1.5)

def stuck_stopping(seconds):
    time.sleep(seconds)

side = threading.Thread(target=stuck_in_a_side_thread, daemon=True)
side.start()
stacks_later(float(sys.argv[1]))
stuck_stopping(float(sys.argv[2]))
cancel_stacks_later()
print("carried on", flush=True)
"""


def _run(after_s: float, stuck_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(after_s), str(stuck_s)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_stop_that_overruns_writes_every_threads_stack_and_carries_on():
    done = _run(0.2, 1.0)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "carried on\n"
    assert "Timeout (0:00:00.200000)!" in done.stderr
    assert "in stuck_stopping" in done.stderr  # the main thread, where it waits
    assert "in stuck_in_a_side_thread" in done.stderr  # and every other thread


def test_a_stop_in_time_writes_nothing():
    done = _run(5.0, 0.1)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "carried on\n"
    assert done.stderr == ""
