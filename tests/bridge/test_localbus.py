"""The local bus (``bridge/localbus.py``): NATS core's semantics the sync relies on, over a real ZMQ broker.

And :class:`ReplicaSync` itself over it: two syncs agree, a third joins late from a snapshot, as over NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import pytest
import zmq
import zmq.asyncio

from kvrouter.bridge import ReplicaSync, Subjects
from kvrouter.bridge.localbus import LocalBroker, LocalBus, LocalMessage, connect
from tests.bridge.test_sync import Host, book, until, view


@contextlib.asynccontextmanager
async def broker(tmp_path: Path) -> AsyncIterator[LocalBroker]:
    found = LocalBroker(f"ipc://{tmp_path}/bus")
    task = asyncio.create_task(found.run())
    try:
        yield found
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        found.close()


@contextlib.asynccontextmanager
async def client(endpoint: str, **kwargs: object) -> AsyncIterator[LocalBus]:
    bus = await connect([endpoint], **kwargs)  # type: ignore[arg-type]
    try:
        yield bus
    finally:
        await bus.close()


def test_publish_subscribe_request_and_no_responders(tmp_path: Path) -> None:
    async def main() -> None:
        async with broker(tmp_path) as b, client(b.endpoint) as one, client(b.endpoint) as two:
            got: list[str] = []

            async def on_a(msg: LocalMessage) -> None:
                got.append(msg.data.decode())

            await two.subscribe("a.b", cb=on_a)
            sub = await two.subscribe("a.b.c")
            await one.publish("a.b", b"1")
            await one.publish("a.b.c", b"2")  # subjects match exactly: not a prefix
            await one.publish("a", b"3")
            assert (await sub.next_msg(2.0)).data == b"2"
            await until(lambda: got == ["1"], "the callback")
            with pytest.raises(nats.errors.TimeoutError):
                await sub.next_msg(0.05)

            async def echo(msg: LocalMessage) -> None:
                await msg.respond(b"re:" + msg.data)

            await two.subscribe("svc", cb=echo)
            assert (await one.request("svc", b"x", timeout=2.0)).data == b"re:x"
            with pytest.raises(nats.errors.NoRespondersError):  # nobody there: at once, not a timeout
                await one.request("nobody", b"x", timeout=30.0)
            silent = await two.subscribe("silent")
            with pytest.raises(nats.errors.TimeoutError):
                await one.request("silent", b"x", timeout=0.1)
            await silent.unsubscribe()
            await two.flush()  # the unsubscribing client's: a flush orders only what its own connection sent
            assert b.subscribers("silent") == 0
            with pytest.raises(nats.errors.NoRespondersError):
                await one.request("silent", b"x", timeout=30.0)

    asyncio.run(main())


def test_slow_consumer_is_reported_and_bad_frames_counted(tmp_path: Path) -> None:
    async def main() -> None:
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        async with broker(tmp_path) as b, client(b.endpoint, error_cb=on_error) as slow, client(b.endpoint) as fast:
            sub = await slow.subscribe("flood", pending_msgs_limit=4)  # nobody reads it
            for i in range(10):
                await fast.publish("flood", str(i).encode())
            await fast.flush()
            await until(lambda: len(errors) == 6, "six drops reported")
            assert all(isinstance(e, nats.errors.SlowConsumerError) for e in errors)
            assert sub.dropped == 6
            assert [(await sub.next_msg(1.0)).data for _ in range(4)] == [b"0", b"1", b"2", b"3"]
            # garbage straight to the broker: counted, and it keeps routing
            context = zmq.asyncio.Context()
            raw = context.socket(zmq.DEALER)
            try:
                raw.setsockopt(zmq.LINGER, 0)
                raw.connect(b.endpoint)
                await raw.send_multipart((b"P", b"only-two"))
                await raw.send_multipart((b"?", b"x"))
                await until(lambda: b.malformed == 2, "two malformed frames counted")
            finally:
                raw.close(linger=0)
                context.term()
            await fast.publish("flood", b"after")
            assert (await sub.next_msg(2.0)).data == b"after"

    asyncio.run(main())


def test_no_broker_is_a_timeout(tmp_path: Path) -> None:
    async def main() -> None:
        with pytest.raises(nats.errors.TimeoutError):
            await connect([f"ipc://{tmp_path}/nobody"])

    asyncio.run(main())


def test_replica_sync_over_the_local_bus(tmp_path: Path) -> None:
    """The fronts' case: the same ReplicaSync, agreeing over the local bus, a late joiner included."""

    async def main() -> None:
        subjects = Subjects("fronts", "local")
        async with broker(tmp_path) as b:
            hosts = [Host((1, 0), (2, 0)) for _ in range(3)]
            syncs = [ReplicaSync(b.endpoint, subjects, host, expiry_secs=30.0, connect=connect) for host in hosts]
            tasks = [asyncio.create_task(syncs[0].run()), asyncio.create_task(syncs[1].run())]
            try:
                await until(lambda: syncs[0].joined and syncs[1].joined, "two joins")
                book(hosts[0], syncs[0], "r1", (1, 0), [1, 2, 3], 12)
                book(hosts[1], syncs[1], "r2", (2, 0), [4, 5], 8)
                await until(
                    lambda: view(hosts[0], (2, 0)) == (8, 2, 1) and view(hosts[1], (1, 0)) == (12, 3, 1),
                    "each applying the other's",
                )
                tasks.append(asyncio.create_task(syncs[2].run()))
                await until(lambda: syncs[2].joined, "the late join")
                assert syncs[2].peer in (syncs[0].router_id, syncs[1].router_id)
                assert view(hosts[2], (1, 0)) == (12, 3, 1)
                assert view(hosts[2], (2, 0)) == (8, 2, 1)
                hosts[1].slots.free("r2")
                syncs[1].freed("r2", (2, 0))
                await until(lambda: all(view(h, (2, 0)) == (0, 0, 0) for h in hosts), "the Free everywhere")
            finally:
                for sync in syncs:
                    await sync.close()
                for task in tasks:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    asyncio.run(main())
