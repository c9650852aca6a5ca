"""``ReplicaSync`` in one process over a real NATS server: two syncs on slot managers of their own.

The service's part (which slot manager a worker lives in) is a small host over real
:class:`~kvrouter.routing.slots.SlotManager` objects, so these tests reach the paths the replica tests
cannot steer: a request kept for a worker not registered yet and what later events do to it, its
expiry, a duplicate AddRequest, a Free for an id nobody booked.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable

import nats
import numpy as np

from kvrouter.bridge import ReplicaSync, Subjects
from kvrouter.bridge.codec import FREE, MARK_PREFILL_COMPLETED, ActiveSequenceEvent, AddRequest, encode_event
from kvrouter.events.model import WorkerKey
from kvrouter.replay.natsd import NatsServer
from kvrouter.routing.slots import SlotManager

BLOCK = 4
BOUND_S = 10.0


class Host:
    """The service's side: one slot manager, the workers registered in it, what the sync reported."""

    def __init__(self, *workers: WorkerKey) -> None:
        self.slots = SlotManager(block_size=BLOCK)
        self.workers = set(workers)
        self.changes: list[tuple[WorkerKey, str, str]] = []
        self.own: set[str] = set()
        """Ids booked here (``book``) and not freed by a peer: the service's own reservations."""

    def slots_of(self, worker: WorkerKey) -> SlotManager | None:
        return self.slots if worker in self.workers else None

    def all_slots(self) -> Iterable[SlotManager]:
        return (self.slots,)

    def synced(self, worker: WorkerKey, request_id: str, kind: str) -> None:
        self.changes.append((worker, request_id, kind))
        if kind == FREE:
            self.own.discard(request_id)

    def own_requests(self) -> set[str]:
        return self.own


async def until(condition: Callable[[], bool], what: str) -> None:
    """A bounded poll on the loop."""
    deadline = asyncio.get_running_loop().time() + BOUND_S
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def running(sync: ReplicaSync) -> AsyncIterator[ReplicaSync]:
    task = asyncio.create_task(sync.run())
    try:
        await until(lambda: sync.joined, "the join")
        yield sync
    finally:
        await sync.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def book(host: Host, sync: ReplicaSync, request_id: str, worker: WorkerKey, hashes: list[int], isl: int) -> None:
    host.slots.add_request(request_id, worker, np.array(hashes, dtype=np.uint64), isl, 0)
    host.own.add(request_id)
    sync.added(request_id, host.slots)


def view(host: Host, worker: WorkerKey) -> tuple[int, int, int]:
    s = host.slots
    return s.active_prefill_tokens(worker), s.active_blocks(worker), s.active_requests(worker)


def test_kept_requests_duplicates_and_unknown_ids(nats_server: NatsServer) -> None:
    async def main() -> None:
        subjects = Subjects("unit", "backend")
        now = [0.0]
        a_host, b_host = Host((1, 0), (2, 0)), Host((1, 0))
        a = ReplicaSync(nats_server.url, subjects, a_host, expiry_secs=30.0)
        b = ReplicaSync(nats_server.url, subjects, b_host, expiry_secs=30.0, clock=lambda: now[0])
        async with running(a), running(b):
            book(a_host, a, "r1", (1, 0), [11, 12, 13], 12)
            await until(lambda: view(b_host, (1, 0)) == (12, 3, 1), "B applying r1")
            # a request for worker 2, which B has not registered: kept, then completed, then registered
            book(a_host, a, "r2", (2, 0), [21, 22], 8)
            await until(lambda: b.status()["pending"] == 1, "B keeping r2")
            assert b.counters.unknown_worker == 1
            a_host.slots.mark_prefill_completed("r2")
            a.prefill_completed("r2", (2, 0))
            applied = b.counters.applied
            await until(lambda: b.counters.applied == applied + 1, "B applying r2's completion")
            b_host.workers.add((2, 0))
            b.worker_registered((2, 0))
            assert view(b_host, (2, 0)) == view(a_host, (2, 0)) == (0, 2, 1)
            assert b.status()["pending"] == 0
            # a peer's AddRequest for an id already active, and a Free nobody booked
            nc = await nats.connect(nats_server.url, allow_reconnect=False)
            try:
                other = 12345
                dup = ActiveSequenceEvent("r1", (1, 0), AddRequest((1,), 4), other)
                await nc.publish(subjects.active_sequences, encode_event(dup))
                await nc.publish(
                    subjects.active_sequences, encode_event(ActiveSequenceEvent("zz", (1, 0), FREE, other))
                )
                # a kept request that a Free removes, and one that expires
                for rid in ("k1", "k2"):
                    add = ActiveSequenceEvent(rid, (9, 0), AddRequest((5,), 4), other)
                    await nc.publish(subjects.active_sequences, encode_event(add))
                await nc.publish(
                    subjects.active_sequences, encode_event(ActiveSequenceEvent("k1", (9, 0), FREE, other))
                )
                await nc.flush()
            finally:
                await nc.close()
            await until(lambda: b.counters.unknown_worker == 3 and b.status()["pending"] == 1, "B keeping k2 only")
            await until(  # A reads the peer's messages on its own subscription, maybe after B
                lambda: a.counters.duplicate == 1 and a.counters.unknown_request == 1, "A counting them too"
            )
            assert a.counters.duplicate == b.counters.duplicate == 1
            assert a.counters.unknown_request == b.counters.unknown_request == 1
            assert view(b_host, (1, 0)) == view(a_host, (1, 0)) == (12, 3, 1)
            now[0] = 31.0
            assert b.sweep() == 1
            assert b.status()["pending"] == 0
            assert b.counters.expired_pending == 1
            # own events: published, echoed back, ignored
            await until(lambda: a.counters.ignored_own == a.counters.published == 3, "A's echo")
            assert b.counters.ignored_own == b.counters.published == 0
            assert [kind for _, _, kind in b_host.changes] == ["AddRequest", "AddRequest"]
            assert MARK_PREFILL_COMPLETED not in [kind for _, _, kind in a_host.changes]

    asyncio.run(main())


def test_a_joiner_takes_a_multi_part_snapshot_then_follows_live_events(nats_server: NatsServer) -> None:
    async def main() -> None:
        subjects = Subjects("join", "backend")
        a_host, c_host = Host((1, 0)), Host((1, 0))
        a = ReplicaSync(nats_server.url, subjects, a_host, expiry_secs=30.0)
        async with running(a):
            for i in range(300):  # a snapshot of several 512 KiB parts: 300 x 400 hashes
                book(a_host, a, f"s{i}", (1, 0), list(range(i * 1000, i * 1000 + 400)), 1600)
            for i in range(0, 300, 3):
                a_host.slots.mark_prefill_completed(f"s{i}")
                a.prefill_completed(f"s{i}", (1, 0))
            c = ReplicaSync(nats_server.url, subjects, c_host, expiry_secs=30.0)
            async with running(c):
                assert c.peer == a.router_id
                assert c.counters.snapshot_received == 300
                assert view(c_host, (1, 0)) == view(a_host, (1, 0))
                a_host.slots.free("s1")
                a.freed("s1", (1, 0))
                await until(lambda: view(c_host, (1, 0)) == view(a_host, (1, 0)), "C applying A's free")
                assert c.counters.duplicate == 0
                assert a.counters.snapshots_served == 1

    asyncio.run(main())
