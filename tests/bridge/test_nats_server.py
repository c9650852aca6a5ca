"""The NATS fixture itself: a real server that accepts a client, restarts in place, and is gone after."""

from __future__ import annotations

import asyncio

import nats

from tests.bridge.conftest import NatsServer


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
    assert nats_server.store.parent.exists()
