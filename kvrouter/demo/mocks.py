"""Mock engines as subprocesses: ``kvrouter mock-worker`` started, its ready line read, stopped and reaped.

The demo fleet of ``kvrouter up`` and ``kvrouter replay``'s local stack both start their engines here.
Each is ``python -m kvrouter mock-worker`` (vLLM event format with a replay socket, every port chosen by
the OS), exec'd rather than forked (the caller's process has threads by then), in its own session so a
terminal's Ctrl-C reaches the parent alone and the shutdown order stays the parent's; its ready line gives
the ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from ..errors import KvRouterError
from ..ready_line import ready_line

__all__ = ["MOCK_START_TIMEOUT_S", "MockError", "MockProcess", "start_mock", "stop_mocks"]

log = logging.getLogger(__name__)

READY_RE: Final = re.compile(r"kvrouter-mock-worker ready http=(\S+) events=(\S+) replay=(\S+)")
"""The mock worker's ready line (``kvrouter/cli/mock_worker.py``)."""

MOCK_START_TIMEOUT_S: Final = 120.0
"""Longest wait for a mock engine's ready line: a cold numba cache compiles for tens of seconds on 2 cores."""

MOCK_STOP_TIMEOUT_S: Final = 3.0
"""SIGTERM, then this long, then SIGKILL: the mocks poll for a stop every 0.1 s."""


class MockError(KvRouterError):
    """A mock engine could not start: it exited, or printed no ready line in time."""


@dataclass(slots=True)
class MockProcess:
    """One mock engine subprocess and what its ready line said."""

    worker_id: int
    proc: asyncio.subprocess.Process
    http: str = ""
    events: str = ""
    replay: str | None = None


async def start_mock(
    worker_id: int,
    started: list[MockProcess],
    *,
    block_size: int,
    num_gpu_blocks: int,
    speedup_ratio: float = 1.0,
    extra_args: Sequence[str] = (),
) -> MockProcess:
    """Start one mock engine and wait for its ready line; appended to ``started`` at once, so a caller
    that is cancelled meanwhile still stops it. ``block_size`` and ``num_gpu_blocks``: the engine's KV
    shape; ``speedup_ratio``: the mock's simulated ms per wall ms (``kvrouter replay`` runs a trace faster
    than real time); ``extra_args``: more ``kvrouter mock-worker`` flags (``kvrouter replay`` gives its
    slow-consumer victim small publisher queues).

    Raises:
        MockError: the process exited or printed no ready line within :data:`MOCK_START_TIMEOUT_S`.
    """
    argv = [
        sys.executable, "-m", "kvrouter", "mock-worker",
        "--worker-id", str(worker_id),
        "--host", "127.0.0.1",
        "--port", "0",
        "--zmq-kv-events-port", "0",
        "--zmq-replay-port", "0",
        "--format", "vllm",
        "--block-size", str(block_size),
        "--num-gpu-blocks", str(num_gpu_blocks),
        "--speedup-ratio", repr(speedup_ratio),
        "--exit-with-parent",
        *extra_args,
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, start_new_session=True
    )
    mock = MockProcess(worker_id, proc)
    started.append(mock)
    assert proc.stdout is not None
    try:
        match = await ready_line(proc.stdout, READY_RE, MOCK_START_TIMEOUT_S)
    except TimeoutError:
        raise MockError(f"mock engine {worker_id} printed no ready line in {MOCK_START_TIMEOUT_S:.0f}s") from None
    if match is None:
        code = await proc.wait()
        raise MockError(f"mock engine {worker_id} exited with status {code} before it was ready")
    mock.http, mock.events = match[1], match[2]
    mock.replay = None if match[3] == "none" else match[3]
    return mock


async def stop_mocks(mocks: list[MockProcess], timeout: float = MOCK_STOP_TIMEOUT_S) -> None:
    """SIGTERM every mock engine, wait up to ``timeout``, SIGKILL the rest; every one reaped."""
    for mock in mocks:
        if mock.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                mock.proc.send_signal(signal.SIGTERM)
    waits = [asyncio.create_task(mock.proc.wait()) for mock in mocks]
    if not waits:
        return
    _, pending = await asyncio.wait(waits, timeout=timeout)
    for mock in mocks:
        if mock.proc.returncode is None:
            log.warning(
                "mock engine did not stop on SIGTERM worker=%d pid=%d; killing it", mock.worker_id, mock.proc.pid
            )
            with contextlib.suppress(ProcessLookupError):
                mock.proc.kill()
    if pending:
        await asyncio.wait(pending)
    for mock in mocks:
        if mock.proc.stdout is not None:
            mock.proc.stdout.feed_eof()
