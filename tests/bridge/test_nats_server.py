"""The NATS server the bridge's tests, the drills and ``bench_nats`` start (``replay/natsd.py``): a real
server that accepts a client, restarts in place, is gone after, and says why when it cannot start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest

from kvrouter.replay.natsd import NatsServer, nats_server_binary
from kvrouter.replay.stack import ReplayError


async def _round_trip(url: str) -> bytes:
    nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False)
    try:
        sub = await nc.subscribe("t.x")
        await nc.publish("t.x", b"hello")
        msg = await sub.next_msg(timeout=5)
        data: bytes = msg.data
        return data
    finally:
        await nc.close()


def test_server_round_trips_and_restarts_on_the_same_port(nats_server: NatsServer) -> None:
    assert asyncio.run(_round_trip(nats_server.url)) == b"hello"
    port, proc = nats_server.port, nats_server.proc
    nats_server.restart()
    assert nats_server.port == port
    assert nats_server.proc is not proc
    assert asyncio.run(_round_trip(nats_server.url)) == b"hello"
    assert proc is not None
    assert proc.poll() is not None


def test_server_is_stopped_by_pid(nats_server: NatsServer) -> None:
    proc = nats_server.proc
    assert proc is not None
    nats_server.stop()
    assert proc.poll() is not None
    assert nats_server.store is not None
    assert nats_server.store.is_dir()
    nats_server.stop()  # idempotent


def test_a_second_start_while_running_is_refused(nats_server: NatsServer) -> None:
    proc = nats_server.proc
    with pytest.raises(ReplayError, match="already running"):
        nats_server.start()
    assert nats_server.proc is proc
    assert asyncio.run(_round_trip(nats_server.url)) == b"hello"


def test_a_server_that_cannot_listen_fails_quoting_its_log(nats_server: NatsServer, tmp_path: Path) -> None:
    binary = nats_server_binary()
    assert binary is not None
    taken = NatsServer(binary, tmp_path / "second")
    (tmp_path / "second").mkdir()
    taken.port = nats_server.port  # the running server holds it
    with pytest.raises(ReplayError, match=r"(?s)exited \d+ at start; log: .*address already in use"):
        taken.start()
    assert taken.proc is not None
    assert taken.proc.poll() is not None
    assert asyncio.run(_round_trip(nats_server.url)) == b"hello"  # the first one is untouched
