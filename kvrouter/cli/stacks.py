"""Every thread's stack from a running process: on ``kill -USR1 PID``, and by itself when a stop overruns.

A process that hangs while stopping is killed by whoever waits for it (systemd's stop timeout, a test's
bound) and takes the reason with it. These write each thread's Python stack to fd 2 first. faulthandler
writes from a C signal handler and from its own watchdog thread, so the stacks come out while a thread
holds the GIL or the event loop is blocked; a Python signal handler would run only when the stuck loop
lets it. Rejected: ``py-spy dump`` (another tool to install, and ptrace rights an operator may lack).

The watchdog is a thread: arm it only after every fork (``kvrouter up`` arms it at its stop signal).
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
from collections.abc import Iterator

__all__ = ["stacks_later", "stacks_on_sigusr1"]

_STDERR = 2
"""fd 2, not ``sys.stderr``: a test runner or a log handler may have replaced the object, not the fd."""


@contextlib.contextmanager
def stacks_on_sigusr1() -> Iterator[None]:
    """While inside, SIGUSR1 writes every thread's stack to fd 2 and the process carries on."""
    faulthandler.register(signal.SIGUSR1, file=_STDERR, all_threads=True)
    try:
        yield
    finally:
        faulthandler.unregister(signal.SIGUSR1)


def stacks_later(seconds: float) -> None:
    """Write every thread's stack to fd 2 once, ``seconds`` from now, unless the process has exited by then.

    Never cancelled: the interpreter's exit cancels it after joining the remaining threads and running the
    ``atexit`` hooks, so a stop that hangs there is covered too."""
    faulthandler.dump_traceback_later(seconds, file=_STDERR)
