"""KV events over NATS (``kvrouter/bridge/events.py``): a real NATS server, real ZMQ, a real service.

A ``KvPublisher`` publishes the reference's ``RouterEvent`` JSON on ``<prefix>.kv-events`` through a
``NatsEventSink``; the service, which registered the worker with ``"transport": "nats"``, relays the
events onto a local PUB its applier follows, so ``/query`` ends equal to the publisher's own index and a
message lost on the way is a gap recovered from the publisher's query socket. The relay alone is driven
with bad input: each kind counted, the relay carrying on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import zmq

from kvrouter.bridge.events import NatsEventRelay, NatsEventSink
from kvrouter.bridge.subjects import Subjects
from kvrouter.events.codecs.dynamo import Encoder as RouterEventEncoder
from kvrouter.events.codecs.kvrouter import Decoder
from kvrouter.events.codecs.query import QueryReply, QueryRequest, decode_reply, encode_request
from kvrouter.events.model import EngineHash, LocalHash, Stored, StoredBlock
from kvrouter.hashing import block_hashes
from kvrouter.replay.natsd import NatsServer
from kvrouter.routing.config import RouterConfig
from kvrouter.service import Service, ServiceConfig
from kvrouter.worker.publisher import NATS_EVENT_BLOCKS, KvPublisher
from tests.service.conftest import Running, own_segments, serve, stop_served

BLOCK = 16
MODEL = "m"
TOKEN = "s3cret"
WORKER = 5


def tokens_of(chain: int, blocks: int) -> list[int]:
    return [chain * 100_000 + i for i in range(blocks * BLOCK)]


def store_chain(pub: KvPublisher, chain: int, blocks: int) -> list[int]:
    """Store ``blocks`` blocks of chain ``chain`` at the root; returns their local hashes."""
    tokens = tokens_of(chain, blocks)
    pub.store([chain * 1000 + i for i in range(blocks)], tokens)
    return [int(h) for h in block_hashes(tokens, BLOCK)]


def query_equals_publisher(run: Running, pub: KvPublisher, chains: list[list[int]]) -> bool:
    """``/query_by_hash`` answers every chain with the depth the publisher's own index holds."""
    pub.serve(5)  # the applier's restore and recoveries ask this socket: answer between checks
    for hashes in chains:
        expected = pub.index.find_matches(hashes).get((WORKER, 0), 0) * BLOCK
        _, answer, _ = run.call("POST", "/query_by_hash", {"model_name": MODEL, "block_hashes": hashes})
        got = int(answer["instances"].get(str(WORKER), {}).get("dp", {}).get("0", 0))
        if got != expected:
            return False
    return True


@pytest.fixture
def nats_service(nats_server: NatsServer, tmp_path: Path) -> Iterator[Running]:
    config = ServiceConfig(
        port=0,
        shards=1,
        auth_token=TOKEN,
        health_interval_secs=0.1,
        drain_secs=1.0,
        router=RouterConfig(),
        nats_url=nats_server.url,
        namespace="evtest",
    )
    service = Service(config)
    service.start()  # forks: before the service thread and any NATS sink thread
    thread: threading.Thread | None = None
    try:
        thread, url = serve(service)
        yield Running(service, url)
    finally:
        stop_served(service, thread)
    leftovers = own_segments()
    assert leftovers == [], leftovers


def test_publisher_over_nats_query_equal_gap_recovered_bad_input_counted(
    nats_service: Running, nats_server: NatsServer, wait_until: Callable[..., None]
) -> None:
    run = nats_service
    subject = Subjects("evtest", "backend").kv_events
    assert subject == "namespace.evtest.component.backend.kv-events"
    sink = NatsEventSink(nats_server.url, subject)
    try:
        with KvPublisher(
            WORKER, block_size=BLOCK, endpoint="tcp://127.0.0.1:*", query_endpoint="tcp://127.0.0.1:*", nats=sink
        ) as pub:
            run.ok(
                "POST",
                "/register",
                {
                    "instance_id": WORKER,
                    "transport": "nats",
                    "query_endpoint": pub.query_endpoint,
                    "model_name": MODEL,
                    "block_size": BLOCK,
                },
            )

            def relay() -> dict[str, Any]:
                pub.serve(5)
                return dict(run.call("GET", "/ready")[1].get("nats_events") or {})

            wait_until(lambda: relay().get("connected") is True, what="relay subscribed")

            def ready() -> bool:
                pub.serve(5)
                return run.call("GET", "/ready")[0] == 200

            wait_until(ready, what="/ready 200")

            chains = [store_chain(pub, c, 4 + c) for c in range(1, 4)]
            pub.publish()
            wait_until(lambda: query_equals_publisher(run, pub, chains), what="/query equal after live events")

            # a step lost on the way (applied and numbered by the publisher, never sent): a gap
            chains.append(store_chain(pub, 9, 3))
            pub.remove([2000 + 3])
            pub.publish(send=False)
            chains.append(store_chain(pub, 10, 2))
            pub.publish()

            def recovered() -> bool:
                pub.serve(5)
                row = run.service.engine.workers()[(WORKER, 0)]
                return row.gaps_detected >= 1 and row.gaps_recovered == row.gaps_detected

            wait_until(recovered, what="gap detected and recovered from the query socket")
            wait_until(lambda: query_equals_publisher(run, pub, chains), what="/query equal after the gap")
            row = run.service.engine.workers()[(WORKER, 0)]
            assert row.gaps_lost == 0
            assert row.state == "exact"

            # bad input on the subject: counted, the relay carries on
            sink.send(b"not json")
            other = {"worker_id": 999, "event": {"event_id": 0, "data": "cleared"}}
            sink.send(json.dumps(other).encode())
            wait_until(
                lambda: relay().get("malformed") == 1 and relay().get("unknown_worker") == 1, what="bad input counted"
            )
            chains.append(store_chain(pub, 11, 2))
            pub.publish()
            wait_until(lambda: query_equals_publisher(run, pub, chains), what="/query equal after bad input")
            assert run.service.engine.workers()[(WORKER, 0)].gaps_lost == 0
    finally:
        sink.close()
    assert sink.failed == 0


def test_big_store_fits_nats(nats_server: NatsServer) -> None:
    """With a NATS sink a store is split at NATS_EVENT_BLOCKS blocks, each message under 1 MiB."""
    sent: list[bytes] = []

    class Capture:
        def send(self, payload: bytes) -> None:
            sent.append(payload)

    with KvPublisher(1, block_size=1, endpoint="tcp://127.0.0.1:*", nats=Capture()) as pub:
        blocks = NATS_EVENT_BLOCKS + 5
        pub.store([(1 << 64) - 1 - i for i in range(blocks)], [(1 << 32) - 1 - i for i in range(blocks)])
        pub.publish()
    assert len(sent) == 2
    assert all(len(p) < 1 << 20 for p in sent)
    first, second = (json.loads(p) for p in sent)
    assert (first["worker_id"], first["storage_tier"]) == (1, "device")
    assert [first["event"]["event_id"], second["event"]["event_id"]] == [0, 1]
    assert len(first["event"]["data"]["stored"]["blocks"]) == NATS_EVENT_BLOCKS
    assert (
        second["event"]["data"]["stored"]["parent_hash"] == first["event"]["data"]["stored"]["blocks"][-1]["block_hash"]
    )


def test_relay_counts_bad_input_and_carries_on(nats_server: NatsServer) -> None:
    """Malformed, unknown-worker and oversized messages are each counted; valid ones still reach the PUB."""

    async def main() -> None:
        relay = NatsEventRelay(nats_server.url, "namespace.r.component.c.kv-events", max_message_bytes=4096)
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        task = asyncio.create_task(relay.run())
        nc = await nats.connect(nats_server.url)
        try:
            endpoint = relay.add(7, 1)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while not relay.connected:
                assert loop.time() < deadline, "relay did not subscribe"
                await asyncio.sleep(0.01)
            await nc.publish(relay.subject, b"{not json")
            await nc.publish(
                relay.subject, json.dumps({"worker_id": 8, "event": {"event_id": 0, "data": "cleared"}}).encode()
            )
            await nc.publish(relay.subject, b" " * 5000)
            # valid events until one crosses the SUB (a ZMQ SUB misses what precedes its connection)
            received: list[bytes] = []
            event_id = 0
            while not received:
                assert loop.time() < deadline, "no valid event relayed"
                record = {"worker_id": 7, "event": {"event_id": event_id, "dp_rank": 1, "data": "cleared"}}
                await nc.publish(relay.subject, json.dumps(record).encode())
                await nc.flush()
                event_id += 1
                await asyncio.sleep(0.01)
                while sub.poll(0):
                    received.append(sub.recv_multipart()[2])
            batch = Decoder().decode(received[0])
            assert batch.dp_rank == 1
            assert [(e.worker_id, e.dp_rank) for e in batch.events] == [(7, 1)]
            counters = relay.counters
            assert (counters.malformed, counters.unknown_worker, counters.oversized) == (1, 1, 1)
            assert counters.forwarded >= 1
        finally:
            await nc.close()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await relay.close()
            sub.close(linger=0)
            context.term()

    asyncio.run(main())


def test_durable_relay_indexes_every_rank_drops_duplicates_and_answers_queries_itself() -> None:
    """Durable mode, fed directly (no NATS needed): a rank not registered is still indexed; a repeated id is
    dropped, a jump counted and the rank marked incomplete, id 0 after others resets the rank; the rank's
    query ROUTER answers a join (tree dump) and a range from the relay's own state."""
    encoder = RouterEventEncoder()

    def stored(event_id: int, chain: int, parent: int | None = None) -> bytes:
        blocks = (StoredBlock(EngineHash(chain), LocalHash(chain * 7 + 1)),)
        parent_hash = None if parent is None else EngineHash(parent)
        return encoder.encode_router_event(Stored(WORKER, parent_hash, blocks, dp_rank=0, event_id=event_id))

    async def main() -> None:
        relay = NatsEventRelay("nats://127.0.0.1:1", "namespace.d.component.c.kv-events", durable=True)
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            for event_id, chain, parent in [(0, 10, None), (1, 11, 10), (2, 12, 11)]:
                relay.relay(stored(event_id, chain, parent))
            relay.relay(stored(1, 11, 10))  # delivered twice: dropped, not applied again
            local = relay.local(WORKER, 0)
            assert local is not None
            assert local.last_event_id == 2
            assert relay.counters.duplicates == 1
            assert relay.counters.unknown_worker == 0  # kept for when it registers
            assert relay.status()["incomplete"] == []

            endpoint = relay.add_query(WORKER, 0)
            dealer.connect(endpoint)
            loop = asyncio.get_running_loop()

            async def ask(start: int | None) -> QueryReply:
                dealer.send_multipart(encode_request(QueryRequest(start, None)))
                deadline = loop.time() + 30
                while not dealer.poll(0):
                    assert loop.time() < deadline, "no answer from the relay's ROUTER"
                    await asyncio.sleep(0.005)
                return decode_reply(dealer.recv_multipart())

            join = await ask(None)
            assert (join.reply, join.last_event_id) == ("tree_dump", 2)
            dumped = [e for payload in join.batches for e in Decoder().decode(payload).events]
            assert sum(len(e.blocks) for e in dumped if isinstance(e, Stored)) == 3
            tail = await ask(1)
            assert (tail.reply, [e.event_id for p in tail.batches for e in Decoder().decode(p).events]) == (
                "events",
                [1, 2],
            )
            assert relay.counters.queries == 2

            relay.relay(stored(5, 20))  # 3 and 4 never reached the stream
            assert relay.counters.gaps == 1
            assert relay.status()["incomplete"] == [[WORKER, 0]]
            assert (await ask(1)).reply == "tree_dump"  # the ring restarted at the jump: no range across it
            relay.relay(stored(0, 30))  # the worker restarted: ids from 0 again
            assert relay.counters.restarts == 1
            assert local.last_event_id == 0
            assert local.index.block_counts() == {(WORKER, 0): 1}
        finally:
            dealer.close(linger=0)
            context.term()
            await relay.close()

    asyncio.run(main())
