"""Replica sync under faults (issue 12, item 5): a NATS restart, a paused NATS server, a slow consumer, a
replica killed with SIGKILL. Each ends with the replicas agreeing and the loss counted (``disconnects``,
``reconnects``, ``slow_consumer``, ``resyncs`` and what the re-sync corrected), never silent.

Two in-process syncs over real slot managers steer the re-sync's rules cheaply (a restart with traffic
on both sides, a slow consumer provoked by a pending limit of 2); real ``kvrouter up`` replicas then
meet the same faults end to end: a client alternating between A and B while the server restarts, a
SIGSTOP of the server until a replica notices (``/ready`` says why meanwhile), a burst that overflows B's
events subscription (``KVROUTER_SYNC_PENDING_MSGS_LIMIT``, test-only), and a replica killed with SIGKILL
whose reservations expire on the survivor, its processes and shared memory cleaned up as the next engine
would. Every wait is a bounded poll on a condition.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import nats
import pytest

from kvrouter.bridge import ReplicaSync, Subjects
from kvrouter.bridge.codec import FREE, ActiveSequenceEvent, AddRequest, encode_event
from kvrouter.replay.natsd import NatsServer
from tests.bridge.conftest import WORKERS
from tests.bridge.replicas import MODEL, Replica, call, replicas, shm_of
from tests.bridge.test_replica_sync import QUIET_S, agree, prompt, total
from tests.bridge.test_sync import Host, book, running, until, view
from tests.conftest import Worker
from tests.service.test_up import descendants, kill_and_sweep

pytestmark = pytest.mark.timeout(900)  # the replicas' first start may compile kernels on a cold cache

PENDING_ENV = "KVROUTER_SYNC_PENDING_MSGS_LIMIT"
PAUSE_NOTICE_S = 15.0
"""How long a paused server stays paused at most while the test waits for a replica to notice (the
sync's pings: every 2 s, 3 unanswered)."""


# -- in process: the re-sync's rules over a real server ---------------------------------------------


def test_a_restart_with_traffic_on_both_sides_ends_in_agreement_and_is_counted(nats_server: NatsServer) -> None:
    async def main() -> None:
        subjects = Subjects("restart", "backend")
        a_host, b_host = Host((1, 0)), Host((1, 0))
        a = ReplicaSync(nats_server.url, subjects, a_host, expiry_secs=60.0)
        b = ReplicaSync(nats_server.url, subjects, b_host, expiry_secs=60.0)
        async with running(a), running(b):
            for i in range(6):
                book(a_host, a, f"a{i}", (1, 0), [100 + i, 200 + i], 8)
                book(b_host, b, f"b{i}", (1, 0), [300 + i], 4)
            await until(lambda: view(a_host, (1, 0)) == view(b_host, (1, 0)) == (72, 18, 12), "the first agreement")
            nats_server.stop()
            await until(lambda: not a.connected and not b.connected, "both seeing the server gone")
            # traffic while the server is down: new bookings, a completion, frees of own and of peers' ids
            book(a_host, a, "a6", (1, 0), [106], 4)
            book(b_host, b, "b6", (1, 0), [306], 4)
            for host, sync, rid in ((a_host, a, "a0"), (b_host, b, "a1"), (a_host, a, "b0")):
                host.slots.free(rid)
                sync.freed(rid, (1, 0))
            b_host.slots.mark_prefill_completed("b1")
            b.prefill_completed("b1", (1, 0))
            await asyncio.to_thread(nats_server.start)
            await until(
                lambda: a.resyncing is None and b.resyncing is None and a.connected and b.connected, "both re-synced"
            )
            await until(lambda: view(a_host, (1, 0)) == view(b_host, (1, 0)), "agreement after the restart")
            assert set(a_host.slots.request_ids()) == set(b_host.slots.request_ids())
            assert view(a_host, (1, 0))[2] == 12 + 2 - 3
            for sync in (a, b):
                assert sync.counters.disconnects >= 1
                assert sync.counters.reconnects >= 1
                assert sync.counters.resyncs >= 1

    asyncio.run(main())


def test_a_slow_consumer_is_counted_and_resynced(nats_server: NatsServer) -> None:
    """B's pending queue holds 2 messages: each burst of A's overflows it. The re-syncs take over the lost
    AddRequests, completions and Frees of A's requests, and the lost Frees of B's own."""

    async def main() -> None:
        subjects = Subjects("slow", "backend")
        a_host, b_host = Host((1, 0)), Host((1, 0))
        a = ReplicaSync(nats_server.url, subjects, a_host, expiry_secs=60.0)
        b = ReplicaSync(nats_server.url, subjects, b_host, expiry_secs=60.0, pending_msgs_limit=2)

        async def agreed(expected: tuple[int, int, int], what: str) -> None:
            await until(lambda: b.resyncing is None and view(a_host, (1, 0)) == view(b_host, (1, 0)) == expected, what)

        async with running(a), running(b):
            for i in range(50):
                book(b_host, b, f"b{i}", (1, 0), [900 + i], 4)
            await until(lambda: view(a_host, (1, 0)) == (200, 50, 50), "A learning B's requests")
            for i in range(300):  # a burst of AddRequests
                book(a_host, a, f"a{i}", (1, 0), [i], 4)
            await until(lambda: b.counters.slow_consumer > 0, "B dropping messages")
            await agreed((1400, 350, 350), "B re-synced after the AddRequests")
            assert b.counters.resyncs >= 1
            assert b.counters.resync_added > 0  # the dropped AddRequests, from A's snapshot
            for i in range(300):  # a burst of completions
                a_host.slots.mark_prefill_completed(f"a{i}")
                a.prefill_completed(f"a{i}", (1, 0))
            await agreed((200, 350, 350), "B re-synced after the completions")
            assert b.counters.resync_updated > 0
            for rid in [f"a{i}" for i in range(300)] + [f"b{i}" for i in range(50)]:  # a burst of Frees
                a_host.slots.free(rid)
                a.freed(rid, (1, 0))
            await agreed((0, 0, 0), "B re-synced after the Frees")
            assert b_host.own == set()  # B's own, freed by A: a lost Free comes back as A's tombstone
            assert b.counters.resync_freed > 0
            assert a.counters.slow_consumer == 0

    asyncio.run(main())


# -- real kvrouter up replicas ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(
    module_nats_server: NatsServer, mocks: list[Worker], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Replica]]:
    """A and B in namespace ``faults``, both workers registered; B's events subscription holds 4 messages."""
    env = {"B": {PENDING_ENV: "4"}}
    with replicas(module_nats_server.url, "faults", tmp_path_factory.mktemp("pair"), ["A", "B"], env=env) as started:
        for replica in started:
            for wid, worker in zip(WORKERS, mocks, strict=True):
                replica.register(wid, worker)
        yield started


def settled(group: list[Replica], wait_until: Callable[..., None], what: str) -> None:
    """Wait until every replica is ready again (connected, joined, no re-sync due)."""
    for replica in group:
        wait_until(lambda r=replica: call(r.url + "/ready")[0] == 200, timeout=QUIET_S, what=f"{replica.name} {what}")


def test_replicas_agree_after_nats_restarts_mid_run(
    pair: list[Replica], module_nats_server: NatsServer, wait_until: Callable[..., None]
) -> None:
    before = agree(pair, wait_until, "before the restart")
    n = 30
    for i in range(n):  # alternating; the server restarts a third of the way in
        if i == n // 3:
            module_nats_server.restart()
        pair[i % 2].post("/select_and_reserve", {"model_name": MODEL, "token_ids": prompt(i), "selection_id": f"r{i}"})
    settled(pair, wait_until, "settling after the restart")
    view = agree(pair, wait_until, "after the restart")
    assert total(view, 2) == total(before, 2) + n
    freed = 0
    for i in range(n):  # completions and frees, each on the other replica (it learnt every reservation)
        if i % 3:
            pair[(i + 1) % 2].post(f"/reservations/r{i}/prefill_complete")
        if i % 4 < 2:
            pair[(i + 1) % 2].delete(f"/reservations/r{i}")
            freed += 1
    view = agree(pair, wait_until, "after the completions and frees")
    assert total(view, 2) == total(before, 2) + n - freed
    for replica in pair:
        sync = replica.sync()
        assert sync["disconnects"] >= 1, (replica.name, sync)
        assert sync["reconnects"] >= 1, (replica.name, sync)
        assert sync["resyncs"] >= 1, (replica.name, sync)
        assert sync["resyncing"] is None
        text = replica.metrics()
        assert f'kvrouter_replica_sync_events_total{{kind="resyncs"}} {float(sync["resyncs"])}' in text
        assert "kvrouter_replica_sync_resyncing 0.0" in text


def test_a_paused_nats_server_ends_with_consistent_replicas(
    pair: list[Replica], module_nats_server: NatsServer, wait_until: Callable[..., None]
) -> None:
    before = agree(pair, wait_until, "before the pause")
    proc = module_nats_server.proc
    assert proc is not None
    said: dict[str, list[str]] = {}
    """What each replica's /ready said about the sync while the server was paused."""
    noticed = True
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        for i in range(10):  # decisions go on while the server is paused
            pair[i % 2].post(
                "/select_and_reserve", {"model_name": MODEL, "token_ids": prompt(i), "selection_id": f"p{i}"}
            )

        def every_replica_said_why() -> bool:  # pings go unanswered: the connection is lost, /ready says so
            for replica in pair:
                status, body = call(replica.url + "/ready")
                reasons = [r for r in body["reasons"] if r.startswith("replica sync")] if status == 503 else []
                if reasons:
                    said[replica.name] = reasons
            return len(said) == len(pair)

        try:
            wait_until(every_replica_said_why, timeout=PAUSE_NOTICE_S, what="the replicas noticing the pause")
        except (AssertionError, pytest.fail.Exception):
            noticed = False  # a loaded machine: the pause ends before the pings tell; consistency still holds
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    settled(pair, wait_until, "settling after the pause")
    view = agree(pair, wait_until, "after the pause")
    assert total(view, 2) == total(before, 2) + 10
    if noticed:
        assert all(reasons == ["replica sync not connected to NATS"] for reasons in said.values()), said
        assert all(r.sync()["resyncs"] >= 1 for r in pair)
    for i in range(10):
        pair[i % 2].delete(f"/reservations/p{i}")
    assert agree(pair, wait_until, "after the frees") == before


def test_a_slow_consumer_replica_counts_the_drops_and_resyncs(
    pair: list[Replica], module_nats_server: NatsServer, wait_until: Callable[..., None]
) -> None:
    a, b = pair
    settled(pair, wait_until, "ready")
    before = agree(pair, wait_until, "before the burst")
    slow, resyncs = b.sync()["slow_consumer"], b.sync()["resyncs"]
    subject = "namespace.faults.component.backend.active_sequences_events"
    n, peer = 500, 4242  # a peer that is not a replica: its events only, no snapshot

    async def burst(data: str) -> None:
        nc = await nats.connect(module_nats_server.url, connect_timeout=2, allow_reconnect=False)
        try:
            for i in range(n):
                event = ActiveSequenceEvent(
                    f"burst{i}", (1, 0), AddRequest((7_000 + i,), 16) if data == "add" else FREE, peer
                )
                await nc.publish(subject, encode_event(event))
            await nc.flush()
        finally:
            await nc.close()

    asyncio.run(burst("add"))
    wait_until(lambda: b.sync()["slow_consumer"] > slow, timeout=QUIET_S, what="B dropping messages")
    settled(pair, wait_until, "re-syncing after the burst")
    # both views agreeing is not enough: they agree too in the moment before either applied the burst (the
    # publisher's flush returns when NATS has it, not the replicas), so wait for the counts themselves
    wait_until(
        lambda: [total(r.loads(), 2) for r in pair] == [total(before, 2) + n] * 2,
        timeout=QUIET_S,
        what="both replicas counting the burst's requests",
    )
    assert b.sync()["resyncs"] > resyncs
    assert a.sync()["slow_consumer"] == 0
    asyncio.run(burst("free"))
    settled(pair, wait_until, "re-syncing after the Frees")
    wait_until(lambda: [r.loads() for r in pair] == [before] * 2, timeout=QUIET_S, what="both back to before")


def test_a_replica_killed_with_sigkill_leaves_the_others_serving_and_its_load_expires(
    module_nats_server: NatsServer, mocks: list[Worker], tmp_path: Path, wait_until: Callable[..., None]
) -> None:
    flag = ("--router-active-request-expiry-secs", "3")
    k = Replica("K", module_nats_server.url, "kill", tmp_path, *flag)  # starts alongside L
    tree: list[tuple[int, str]] = []
    try:
        with replicas(module_nats_server.url, "kill", tmp_path, ["L"], *flag) as (survivor,):
            k.wait_started()
            for replica in (k, survivor):
                for wid, worker in zip(WORKERS, mocks, strict=True):
                    replica.register(wid, worker)
            for i in range(6):
                k.post("/select_and_reserve", {"model_name": MODEL, "token_ids": prompt(i), "selection_id": f"k{i}"})
            wait_until(lambda: total(survivor.loads(), 2) == 6, timeout=QUIET_S, what="L learning K's reservations")
            tree = descendants(k.proc.pid)
            k.proc.kill()  # no shutdown at all
            k.proc.wait()
            # L keeps serving: ready, deciding, freeing (also one of K's)
            assert call(survivor.url + "/ready")[0] == 200
            survivor.post("/select_and_reserve", {"model_name": MODEL, "token_ids": prompt(9), "selection_id": "l9"})
            survivor.delete("/reservations/l9")
            survivor.delete("/reservations/k0")
            wait_until(lambda: total(survivor.loads(), 2) == 0, timeout=QUIET_S, what="K's reservations expiring")
            assert survivor.loads() == {(1, 0): (0, 0, 0), (2, 0): (0, 0, 0)}
            assert survivor.sync()["connected"]
    finally:
        k.stop()
        kill_and_sweep(tree)  # K's appliers and fork server: gone with it, or killed here
    assert k.proc.returncode == -signal.SIGKILL
    assert shm_of(k.proc.pid) == []
