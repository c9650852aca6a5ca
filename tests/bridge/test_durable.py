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

from kvrouter.bridge.durable import bucket_name, consumer_name, slug, stream_name
from kvrouter.bridge.events import NatsEventSink
from kvrouter.bridge.subjects import Subjects
from kvrouter.hashing import block_hashes
from kvrouter.replay.natsd import NatsServer
from kvrouter.worker.publisher import KvPublisher
from tests.bridge.replicas import BLOCK, MODEL, Replica, call, shm_of
from tests.conftest import STACKS_SHOWN
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
    """Register the publisher (transport nats): taken at once (201), followed once the replica's durable start
    is done (a 503 only while the index itself starts)."""

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
        assert replica.proc.returncode == 0, (replica.name, replica.stderr_path.read_text()[-STACKS_SHOWN:])
        assert shm_of(replica.proc.pid) == []


def test_a_replica_killed_mid_stream_resumes_from_the_stream_then_from_a_snapshot_without_asking_the_worker(
    nats_server: NatsServer,
    publisher: tuple[KvPublisher, NatsEventSink],
    tmp_path: Path,
    wait_until: Callable[..., None],
) -> None:
    """b is SIGKILLed twice: first with the whole stream still there (it replays it), then after a snapshot
    past the threshold purged the stream (it loads the snapshot and replays the rest). Each time it ends
    equal to the worker and to a, which never stopped, with no duplicate, no gap and no query to the worker."""
    pub, _ = publisher
    chains = Chains(pub)
    threshold = ("--router-snapshot-threshold", "14")  # crossed only in the second half
    a = durable("a", nats_server, "durable", tmp_path, *threshold)
    a.wait_started()  # on a cold numba cache the first compiles the kernels; b then loads them
    started = [durable("b", nats_server, "durable", tmp_path, *threshold)]
    trees: list[list[tuple[int, str]]] = []

    def kill(replica: Replica) -> None:
        trees.append(descendants(replica.proc.pid))
        replica.proc.kill()  # mid-stream: no shutdown at all; its consumer stays on the server
        replica.proc.wait()
        kill_and_sweep(trees[-1])

    def restart() -> Replica:
        b = durable("b", nats_server, "durable", tmp_path, *threshold)
        started.append(b)
        b.wait_started()
        register(b, pub, wait_until)
        wait_until(lambda: status(b)["ready"], timeout=QUIET_S, what="the restarted b /ready")
        wait_until(lambda: chains.agree(b), timeout=QUIET_S, what="the restarted b equal to the worker")
        return b

    def clean(b: Replica) -> dict[str, Any]:
        """b's status, checked: its own consumer found again, a's position, nothing twice, no gap, no worker."""
        after = status(b)
        assert after["consumer"] == "kvrouter-b"
        assert after["processed_seq"] == status(a)["processed_seq"]
        relay = after["relay"]
        assert (relay["duplicates"], relay["gaps"], relay["malformed"], relay["incomplete"]) == (0, 0, 0, [])
        assert relay["queries"] >= 1  # the applier's join was answered by the relay itself
        assert pub.queries_answered == 0
        assert pub.bad_queries == 0
        return after

    with stopping(a):
        try:
            b = started[0]
            b.wait_started()
            for replica in (a, b):
                register(replica, pub, wait_until)
            for c in range(1, 4):
                chains.store(c, 3 + c)
            pub.publish()
            for replica in (a, b):
                name = f"{replica.name} equal to the worker"
                wait_until(lambda r=replica: chains.agree(r), timeout=QUIET_S, what=name)

            kill(b)
            for c in range(4, 7):  # while b is away: stores, an eviction, a step in several messages
                chains.store(c, 2)
            pub.remove([1000 + 2, 3000 + 4])
            pub.publish()
            chains.store(7, 5)
            pub.publish()
            wait_until(lambda: chains.agree(a), timeout=QUIET_S, what="a equal while b is away")
            b = restart()
            assert clean(b)["snapshot_loaded"] is False  # no snapshot yet: the whole stream replayed
            chains.store(8, 3)
            pub.remove([7000 + 4])
            pub.publish()  # 10 messages so far

            for c in range(10, 16):  # 16 messages: past the threshold of 14
                chains.store(c, 2 + c % 3)
            pub.publish()

            def snapshotted() -> bool:
                return sum(int(status(r)["purged"]) for r in (a, b)) >= 1

            wait_until(snapshotted, timeout=QUIET_S, what="a snapshot past the threshold, and a purge")
            taken = max((status(r)["last_snapshot"] or {"seq": -1} for r in (a, b)), key=lambda t: t["seq"])
            assert taken["seq"] >= 14
            for replica in (a, b):
                wait_until(lambda r=replica: chains.agree(r), timeout=QUIET_S, what=f"{replica.name} equal")

            kill(b)
            chains.store(20, 4)  # after the snapshot: replayed from the stream
            pub.publish()
            wait_until(lambda: chains.agree(a), timeout=QUIET_S, what="a equal after the snapshot")
            b = restart()
            after = clean(b)
            assert after["snapshot_loaded"] is True
            assert after["snapshot_loads"] == 1
            assert after["snapshot_seq"] >= taken["seq"]
            assert after["snapshot_bad"] == 0
            assert 'kvrouter_durable_events_total{kind="snapshot_loads"} 1.0' in b.metrics()
        finally:
            for replica in started:
                replica.stop()
            for tree in trees:
                kill_and_sweep(tree)
    assert [r.proc.returncode for r in started] == [-signal.SIGKILL, -signal.SIGKILL, 0]
    assert all(shm_of(r.proc.pid) == [] for r in started)


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
        wait_until(lambda: status(replica)["loaded"], timeout=QUIET_S, what=f"{replica.name}'s durable start")
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
        assert replica.proc.returncode == 0, replica.stderr_path.read_text()[-STACKS_SHOWN:]
        assert shm_of(replica.proc.pid) == []


def test_nats_absent_at_start_restarted_mid_run_or_a_step_lost_the_replica_says_so_and_carries_on(
    nats_server: NatsServer,
    publisher: tuple[KvPublisher, NatsEventSink],
    tmp_path: Path,
    wait_until: Callable[..., None],
) -> None:
    pub, sink = publisher
    chains = Chains(pub)
    nats_server.stop()  # the sink reconnects when it is back
    d = durable("d", nats_server, "durable", tmp_path)
    with stopping(d):
        d.wait_started()  # the API and the engine come up without NATS
        said = status(d)
        assert said["ready"] is False
        assert "durable kv-events starting (stream, snapshot)" in said["reasons"]
        body = {"instance_id": WORKER, "transport": "nats", "query_endpoint": pub.query_endpoint}
        code, answer = call(d.url + "/register", "POST", {**body, "model_name": MODEL, "block_size": BLOCK})
        assert code == 201, answer  # taken while the durable start waits for NATS: followed once it is done
        code, workers = call(d.url + "/workers", "GET")
        assert [(w["instance_id"], w["status"]) for w in workers] == [(WORKER, "pending")]

        nats_server.start()  # same port: the replica's connection attempts now succeed
        wait_until(lambda: status(d)["loaded"], timeout=QUIET_S, what="d's durable start once NATS is up")
        wait_until(
            lambda: [w["status"] for w in call(d.url + "/workers", "GET")[1]] == ["active"],
            timeout=QUIET_S,
            what="d following the worker registered while it started",
        )
        chains.store(1, 4)
        pub.publish()
        wait_until(lambda: chains.agree(d), timeout=QUIET_S, what="d equal before the restart")
        wait_until(lambda: status(d)["ready"], timeout=QUIET_S, what="d /ready")
        assert pub.queries_answered == 0
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


def test_names_are_the_references() -> None:
    """Stream and bucket slugged as the reference's ``Slug`` (``spec/dynamo-semantics.md`` §6.4); the consumer
    named after the router id, or the host and port, and only ever NATS-safe characters."""
    subjects = Subjects("my_ns", "backend")
    assert stream_name(subjects) == "namespace-my-ns-component-backend-kv-events"
    assert bucket_name(subjects) == "namespace-my-ns-component-backend-radix-bucket"
    assert slug("a.b_c/d\\e") == "a-b-c-d-e"
    assert consumer_name("r-1", "127.0.0.1", 8490) == "kvrouter-r-1"
    host = consumer_name(None, "127.0.0.1", 8490)
    assert host.startswith("kvrouter-")
    assert host.endswith("-8490")
    assert all(c.isalnum() or c in "-_" for c in host)
    assert consumer_name(None, "127.0.0.1", 0) != consumer_name(None, "127.0.0.1", 0)  # random: pass --router-id
