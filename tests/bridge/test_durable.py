"""JetStream durable mode (``kvrouter/bridge/durable.py``): real NATS server, real ``kvrouter up`` replicas.

A ``KvPublisher`` in this process publishes the reference's ``RouterEvent`` JSON on ``kv-events`` (NATS
core; the stream captures it). Every replica registers it with ``transport: nats``; its appliers then
follow the replica's own relay, which answers their queries, so the publisher's query socket (served
here, ``queries_answered``) must receive nothing at all, however the replicas start, die and restart.
``/query`` is compared chain by chain with the publisher's own index (the truth) on every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.errors import BucketNotFoundError

from kvrouter.bridge.events import NatsEventSink
from kvrouter.bridge.subjects import Subjects
from kvrouter.hashing import block_hashes
from kvrouter.worker.publisher import KvPublisher
from tests.bridge.conftest import NatsServer
from tests.bridge.replicas import BLOCK, MODEL, Replica, call, shm_of
from tests.service.test_up import descendants, kill_and_sweep

WORKER = 5
QUIET_S = 60.0
"""Bound of every wait for the replicas to converge (a loaded 2-core machine, numba kernels loading)."""


def durable(name: str, server: NatsServer, namespace: str, folder: Path, *extra: str) -> Replica:
    """A durable replica named ``name`` (its router id, hence its consumer: the same after a restart)."""
    return Replica(name, server.url, namespace, folder, "--router-durable-kv-events", "--router-id", name, *extra)


def status(replica: Replica) -> dict[str, Any]:
    """``/ready``'s ``durable_events`` and ``nats_events`` (ready or not)."""
    code, body = call(replica.url + "/ready")
    assert code in (200, 503), code
    return {"ready": code == 200, "reasons": body["reasons"], **body["durable_events"], "relay": body["nats_events"]}


def register(replica: Replica, pub: KvPublisher, wait_until: Callable[..., None]) -> None:
    """Register the publisher (transport nats) once the replica's durable start is done (503 before)."""

    def done() -> bool:
        code, _ = call(
            replica.url + "/register",
            "POST",
            {
                "instance_id": WORKER,
                "transport": "nats",
                "query_endpoint": pub.query_endpoint,
                "model_name": MODEL,
                "block_size": BLOCK,
            },
        )
        assert code in (200, 201, 503), code
        return code != 503

    wait_until(done, timeout=QUIET_S, what=f"{replica.name} accepting the registration")


class Chains:
    """Root chains stored by the publisher (chain c: ``blocks`` blocks, engine hashes c * 1000 + i)."""

    def __init__(self, pub: KvPublisher) -> None:
        self.pub = pub
        self.hashes: list[list[int]] = []

    def store(self, chain: int, blocks: int) -> None:
        tokens = [chain * 100_000 + i for i in range(blocks * BLOCK)]
        self.pub.store([chain * 1000 + i for i in range(blocks)], tokens)
        self.hashes.append([int(h) for h in block_hashes(tokens, BLOCK)])

    def agree(self, replica: Replica) -> bool:
        """``/query_by_hash`` on ``replica`` answers every chain with the publisher's own depth."""
        self.pub.serve(0)  # a query to the worker would be counted here (none must come)
        for hashes in self.hashes:
            expected = self.pub.index.find_matches(hashes).get((WORKER, 0), 0) * BLOCK
            code, answer = call(replica.url + "/query_by_hash", "POST", {"model_name": MODEL, "block_hashes": hashes})
            if code != 200:
                return False
            if int(answer["instances"].get(str(WORKER), {}).get("dp", {}).get("0", 0)) != expected:
                return False
        return True


@pytest.fixture
def publisher(nats_server: NatsServer) -> Iterator[tuple[KvPublisher, NatsEventSink]]:
    sink = NatsEventSink(nats_server.url, Subjects("durable", "backend").kv_events)
    try:
        with KvPublisher(
            WORKER, block_size=BLOCK, endpoint="tcp://127.0.0.1:*", query_endpoint="tcp://127.0.0.1:*", nats=sink
        ) as pub:
            yield pub, sink
    finally:
        sink.close()
    assert sink.failed == 0


@contextlib.contextmanager
def stopping(*started: Replica) -> Iterator[None]:
    """Stop every replica on leaving; each must have exited 0 and left no segment."""
    try:
        yield
    finally:
        for replica in started:
            replica.stop()
    for replica in started:
        assert replica.proc.returncode == 0, (replica.name, replica.stderr_path.read_text()[-3000:])
        assert shm_of(replica.proc.pid) == []


def test_a_replica_killed_and_restarted_resumes_from_the_stream_without_asking_the_worker(
    nats_server: NatsServer,
    publisher: tuple[KvPublisher, NatsEventSink],
    tmp_path: Path,
    wait_until: Callable[..., None],
) -> None:
    pub, _ = publisher
    chains = Chains(pub)
    a = durable("a", nats_server, "durable", tmp_path)
    a.wait_started()  # on a cold numba cache the first compiles the kernels; b then loads them
    b = durable("b", nats_server, "durable", tmp_path)
    restarted: Replica | None = None
    tree: list[tuple[int, str]] = []
    with stopping(a):
        try:
            b.wait_started()
            for replica in (a, b):
                register(replica, pub, wait_until)
            for c in range(1, 4):
                chains.store(c, 3 + c)
            pub.publish()
            for replica in (a, b):
                wait_until(
                    lambda r=replica: chains.agree(r), timeout=QUIET_S, what=f"{replica.name} equal to the worker"
                )
            assert status(b)["consumer"] == "kvrouter-b"

            tree = descendants(b.proc.pid)
            b.proc.kill()  # mid-stream: no shutdown at all
            b.proc.wait()
            kill_and_sweep(tree)
            # while b is away: more stores, an eviction, a step in several messages
            for c in range(4, 7):
                chains.store(c, 2)
            pub.remove([1000 + 2, 3000 + 4])
            pub.publish()
            chains.store(7, 5)
            pub.publish()
            wait_until(lambda: chains.agree(a), timeout=QUIET_S, what="a equal while b is away")

            restarted = durable("b", nats_server, "durable", tmp_path)
            restarted.wait_started()
            register(restarted, pub, wait_until)
            wait_until(lambda: status(restarted)["ready"], timeout=QUIET_S, what="the restarted b /ready")
            wait_until(lambda: chains.agree(restarted), timeout=QUIET_S, what="the restarted b equal to the worker")
            chains.store(8, 3)
            pub.remove([7000 + 4])
            pub.publish()
            for replica in (a, restarted):
                wait_until(
                    lambda r=replica: chains.agree(r), timeout=QUIET_S, what=f"{replica.name} equal after restart"
                )

            after = status(restarted)
            assert after["consumer"] == "kvrouter-b"  # its own consumer, found again
            assert after["snapshot_loaded"] is False  # no snapshot: the whole stream replayed
            assert after["processed_seq"] == status(a)["processed_seq"]
            relay = after["relay"]
            assert (relay["duplicates"], relay["gaps"], relay["malformed"], relay["incomplete"]) == (0, 0, 0, [])
            assert relay["queries"] >= 1  # the applier's join was answered by the relay itself
            assert pub.queries_answered == 0
            assert pub.bad_queries == 0
        finally:
            b.stop()
            if restarted is not None:
                restarted.stop()
            kill_and_sweep(tree)
    assert b.proc.returncode == -signal.SIGKILL
    assert restarted is not None
    assert restarted.proc.returncode == 0
    assert shm_of(b.proc.pid) == []
    assert shm_of(restarted.proc.pid) == []


def test_a_snapshot_past_the_threshold_purges_the_stream_and_a_restarted_replica_loads_it(
    nats_server: NatsServer,
    publisher: tuple[KvPublisher, NatsEventSink],
    tmp_path: Path,
    wait_until: Callable[..., None],
) -> None:
    pub, _ = publisher
    chains = Chains(pub)
    threshold = ("--router-snapshot-threshold", "6")
    a = durable("a", nats_server, "durable", tmp_path, *threshold)
    a.wait_started()
    b = durable("b", nats_server, "durable", tmp_path, *threshold)
    restarted: Replica | None = None
    with stopping(a):
        try:
            b.wait_started()
            for replica in (a, b):
                register(replica, pub, wait_until)
            for c in range(1, 9):  # 8 messages (one event each), past the threshold of 6
                chains.store(c, 2 + c % 3)
            pub.remove([3000 + 1])
            pub.publish()

            def snapshotted() -> bool:
                return sum(int(status(r)["snapshot_uploads"]) for r in (a, b)) >= 1

            wait_until(snapshotted, timeout=QUIET_S, what="a snapshot past the threshold")
            wait_until(lambda: sum(status(r)["purged"] for r in (a, b)) >= 6, timeout=QUIET_S, what="the purge")
            taken = max((status(r)["last_snapshot"] or {"seq": -1} for r in (a, b)), key=lambda t: t["seq"])
            assert taken["seq"] >= 9
            assert taken["purged_below"] == taken["seq"] + 1  # both replicas had read it all

            b.stop()  # a clean stop this time; its consumer stays on the server
            chains.store(20, 4)  # after the snapshot: replayed from the stream
            pub.publish()
            wait_until(lambda: chains.agree(a), timeout=QUIET_S, what="a equal after the snapshot")

            restarted = durable("b", nats_server, "durable", tmp_path, *threshold)
            restarted.wait_started()
            register(restarted, pub, wait_until)
            wait_until(lambda: status(restarted)["ready"], timeout=QUIET_S, what="the restarted b /ready")
            wait_until(lambda: chains.agree(restarted), timeout=QUIET_S, what="the restarted b equal to the worker")
            after = status(restarted)
            assert after["snapshot_loaded"] is True
            assert after["snapshot_loads"] == 1
            assert after["snapshot_seq"] >= taken["seq"]
            assert after["snapshot_bad"] == 0
            assert 'kvrouter_durable_events_total{kind="snapshot_loads"} 1.0' in restarted.metrics()
            assert after["processed_seq"] == status(a)["processed_seq"]
            relay = after["relay"]
            assert (relay["duplicates"], relay["gaps"], relay["incomplete"]) == (0, 0, [])
            assert pub.queries_answered == 0
        finally:
            b.stop()
            if restarted is not None:
                restarted.stop()
    assert b.proc.returncode == 0
    assert restarted is not None
    assert restarted.proc.returncode == 0


async def _put_garbage(url: str, bucket: str) -> None:
    nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False)
    try:
        store = await nc.jetstream().object_store(bucket)
        await store.put("radix-state", b"\x93garbage, not a snapshot\xff" * 100)
    finally:
        await nc.close()


async def _stored(url: str, stream: str, bucket: str) -> tuple[int, bool]:
    """(messages in the stream, whether the snapshot bucket exists)."""
    nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False)
    try:
        js = nc.jetstream()
        messages = (await js.stream_info(stream)).state.messages
        try:
            await js.object_store(bucket)
        except BucketNotFoundError:
            return messages, False
        return messages, True
    finally:
        await nc.close()


def test_a_bad_snapshot_is_counted_and_reset_states_purges_both_and_the_replica_still_converges(
    nats_server: NatsServer,
    publisher: tuple[KvPublisher, NatsEventSink],
    tmp_path: Path,
    wait_until: Callable[..., None],
) -> None:
    pub, _ = publisher
    chains = Chains(pub)
    threshold = ("--router-snapshot-threshold", "4")
    started: list[Replica] = []

    def start(*extra: str) -> Replica:
        replica = durable("c", nats_server, "durable", tmp_path, *threshold, *extra)
        started.append(replica)
        replica.wait_started()
        register(replica, pub, wait_until)
        return replica

    try:
        c = start()
        for n in range(1, 7):
            chains.store(n, 3)
        pub.publish()
        wait_until(lambda: status(c)["purged"] >= 4, timeout=QUIET_S, what="a snapshot and a purge")
        wait_until(lambda: chains.agree(c), timeout=QUIET_S, what="c equal to the worker")
        stream, bucket = status(c)["stream"], status(c)["bucket"]
        c.stop()

        # a snapshot object that is not one: counted, said, and the replica repairs from the worker
        asyncio.run(_put_garbage(nats_server.url, bucket))
        chains.store(7, 2)
        pub.publish()
        c = start()
        wait_until(lambda: status(c)["loaded"], timeout=QUIET_S, what="c started")
        wait_until(lambda: chains.agree(c), timeout=QUIET_S, what="c equal after a bad snapshot")
        after = status(c)
        assert (after["snapshot_bad"], after["snapshot_loaded"]) == (1, False)
        assert after["relay"]["partial"] is True
        assert after["relay"]["worker_queries"] >= 1
        assert pub.queries_answered >= 1  # the fallback: the worker was asked, and it is counted
        assert "durable snapshot unreadable" in c.stderr_path.read_text()
        c.stop()

        # --router-reset-states: the bucket deleted, the stream purged, at start
        assert asyncio.run(_stored(nats_server.url, stream, bucket))[1] is True
        asked = pub.queries_answered
        c = start("--router-reset-states")
        assert asyncio.run(_stored(nats_server.url, stream, bucket)) == (0, False)
        wait_until(lambda: chains.agree(c), timeout=QUIET_S, what="c equal after the reset")
        after = status(c)
        assert (after["snapshot_bad"], after["snapshot_loaded"], after["processed_seq"]) == (0, False, 0)
        assert pub.queries_answered > asked
        chains.store(8, 2)
        pub.publish()
        wait_until(lambda: chains.agree(c), timeout=QUIET_S, what="c equal after the reset and new events")
    finally:
        for replica in started:
            replica.stop()
    for replica in started:
        assert replica.proc.returncode == 0, replica.stderr_path.read_text()[-3000:]
        assert shm_of(replica.proc.pid) == []


def test_nats_restarted_or_a_step_lost_the_durable_replica_carries_on_and_counts_it(
    nats_server: NatsServer,
    publisher: tuple[KvPublisher, NatsEventSink],
    tmp_path: Path,
    wait_until: Callable[..., None],
) -> None:
    pub, sink = publisher
    chains = Chains(pub)
    d = durable("d", nats_server, "durable", tmp_path)
    with stopping(d):
        d.wait_started()
        register(d, pub, wait_until)
        chains.store(1, 4)
        pub.publish()
        wait_until(lambda: chains.agree(d), timeout=QUIET_S, what="d equal before the restart")
        before = status(d)["processed_seq"]

        nats_server.restart()  # same port and store: the stream and the consumer survive on disk
        chains.store(2, 3)  # published while the clients reconnect (nats-py buffers, or the sink counts a failure)
        pub.publish()
        wait_until(lambda: status(d)["connected"], timeout=QUIET_S, what="d reconnected")
        chains.store(3, 2)
        pub.remove([1000 + 3])
        pub.publish()
        wait_until(lambda: chains.agree(d), timeout=QUIET_S, what="d equal after the NATS restart")
        after = status(d)
        assert after["processed_seq"] > before
        relay = after["relay"]
        # nothing lost silently: either every event reached the stream, or the jump was counted and the rank
        # repaired from the worker (the one path that asks it)
        if relay["gaps"] == 0:
            assert pub.queries_answered == 0
        else:
            assert relay["worker_queries"] >= 1
            assert pub.queries_answered >= 1
        assert relay["duplicates"] == 0
        assert sink.failed == 0 or relay["gaps"] >= 1
        asked = pub.queries_answered

        # a step that never reaches the stream: the relay counts the jump, and the applier's gap is answered
        # by repairing the rank from the worker's own query socket
        chains.store(4, 3)
        pub.publish(send=False)
        chains.store(5, 2)
        pub.publish()
        wait_until(lambda: chains.agree(d), timeout=QUIET_S, what="d equal after a lost step")
        relay = status(d)["relay"]
        assert relay["gaps"] >= 1
        assert relay["worker_queries"] >= 1
        assert pub.queries_answered > asked
        assert relay["incomplete"] == []  # repaired


async def _consumers(url: str, stream: str) -> list[str]:
    nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False)
    try:
        return sorted(c.name for c in await nc.jetstream().consumers_info(stream))
    finally:
        await nc.close()


def test_with_two_fronts_only_front_0_reads_the_stream(
    nats_server: NatsServer,
    publisher: tuple[KvPublisher, NatsEventSink],
    tmp_path: Path,
    wait_until: Callable[..., None],
) -> None:
    """``--fronts 2``: front 0 owns the engine, so the relay and the one consumer; front 1 (same router id)
    must not make a consumer of its own, which would take over front 0's or split the stream with it."""
    pub, _ = publisher
    chains = Chains(pub)
    f = durable("f", nats_server, "durable", tmp_path, "--fronts", "2")
    with stopping(f):
        f.wait_started()
        register(f, pub, wait_until)  # on either front: front 1 forwards it to front 0
        for c in range(1, 5):
            chains.store(c, 2)
        pub.publish()
        wait_until(lambda: chains.agree(f), timeout=QUIET_S, what="both fronts equal to the worker")
        stream = "namespace-durable-component-backend-kv-events"
        assert asyncio.run(_consumers(nats_server.url, stream)) == ["kvrouter-f"]
        assert pub.queries_answered == 0
