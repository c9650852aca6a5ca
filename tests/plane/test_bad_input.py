"""Bad input on the event plane: garbage frames, a wrong topic or rank, oversized messages, unknown workers,
a replay peer that never answers, a publisher that vanishes. Each is counted in the worker's row, logged
once, and the applier keeps serving: later good messages apply, flushes and queries answer."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from kvrouter import Engine
from kvrouter.engine import WorkerStats
from kvrouter.events.codecs import kvrouter as kvrouter_codec, vllm
from kvrouter.events.codecs.frames import encode_live
from kvrouter.events.model import EngineHash, EventBatch, LocalHash, Stored, StoredBlock
from kvrouter.hashing import block_hashes
from kvrouter.index.layout import W_BAD_FRAMES
from kvrouter.plane import PlaneConfig, WorkerSpec
from kvrouter.plane.ingest import Ingest
from kvrouter.plane.wakes import Wakes
from tests.index.shm import InProcessShards
from tests.plane.drains import drain_of

BLOCK = 4
TOPIC = b"kv"
LIMIT = 64 << 10


def stored_batch(engine_hash: int, *, parent: int | None = None, dp_rank: int = 0, tokens: int = BLOCK) -> bytes:
    """A vLLM payload storing one block whose tokens are ``engine_hash`` repeated."""
    ids = tuple([engine_hash % (1 << 32)] * tokens)
    local = block_hashes(list(ids), tokens)[0]
    block = StoredBlock(EngineHash(engine_hash), LocalHash(local), ids)
    parent_hash = None if parent is None else EngineHash(parent)
    event = Stored(1, parent_hash, (block,), dp_rank=dp_rank)
    return vllm.Encoder().encode(EventBatch((event,), timestamp=1.0, dp_rank=dp_rank))


def local_of(engine_hash: int) -> int:
    return block_hashes([engine_hash % (1 << 32)] * BLOCK, BLOCK)[0]


class Wire:
    """A bound XPUB standing in for an engine; ``ready()`` waits for the router's subscription."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.socket = context.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def ready(self) -> None:
        assert self.socket.poll(30_000), "the router never subscribed"
        self.socket.recv()

    def send(self, *frames: bytes) -> None:
        self.socket.send_multipart(list(frames))

    def live(self, seq: int, payload: bytes, topic: bytes = TOPIC) -> None:
        self.send(*encode_live(topic, seq, payload))

    def close(self) -> None:
        self.socket.close(linger=0)


@pytest.fixture
def wire(context: zmq.Context[zmq.Socket[bytes]]) -> Iterator[Wire]:
    wire = Wire(context)
    yield wire
    wire.close()


@pytest.fixture
def silent_peer(context: zmq.Context[zmq.Socket[bytes]]) -> Iterator[str]:
    """A replay ROUTER that takes requests and never answers."""
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind("tcp://127.0.0.1:*")
    yield socket.getsockopt_string(zmq.LAST_ENDPOINT)
    socket.close(linger=0)


CONFIG = PlaneConfig(max_message_bytes=LIMIT, recovery_timeout=0.3, stale_after=0.5)


def worker(engine: Engine, worker_id: int = 1) -> WorkerStats:
    return engine.workers()[worker_id, 0]


def test_garbage_and_misaddressed_frames_are_counted_and_serving_goes_on(wire: Wire, wait_until):
    with Engine(shards=1, plane=CONFIG) as engine:
        engine.add_worker(WorkerSpec(1, wire.endpoint, topic=TOPIC, block_size=BLOCK))
        wire.ready()
        wire.live(0, stored_batch(10))
        wait_until(lambda: worker(engine).last_id == 0, what="the first batch")
        bad = [
            [TOPIC, b"seq", stored_batch(11)],  # a seq frame of 3 bytes
            [TOPIC, (1).to_bytes(8, "big")],  # two frames
            encode_live(TOPIC, 1, b"\xc1 not msgpack"),
            encode_live(TOPIC + b"-events", 1, stored_batch(11)),  # another topic sharing the prefix
            encode_live(TOPIC, 1, stored_batch(11, dp_rank=3)),  # rank 3's batch on rank 0's socket
            encode_live(TOPIC, 1, b"\x00" * (LIMIT + 1)),  # oversized
            encode_live(TOPIC, 1, kvrouter_codec.Encoder().encode(EventBatch(()))),  # another format
        ]
        for frames in bad:
            wire.send(*frames)
        wire.live(1, stored_batch(11, parent=10))
        wait_until(lambda: worker(engine).last_id == 1, what="a good batch after the bad ones")
        stats = worker(engine)
        assert stats.bad_frames == len(bad)
        assert (stats.gaps_detected, stats.gaps_lost, stats.state) == (0, 0, "exact")
        assert engine.find_matches([local_of(10), local_of(11)]) == {(1, 0): 2}
        assert engine.stats()[0].errors["bad_event"] == len(bad)
        engine.flush()


def test_an_undecodable_batch_is_a_lost_gap_when_nothing_can_replay_it(wire: Wire, wait_until):
    with Engine(shards=1, plane=CONFIG) as engine:
        engine.add_worker(WorkerSpec(1, wire.endpoint, topic=TOPIC, block_size=BLOCK))
        wire.ready()
        wire.live(0, stored_batch(10))
        wire.live(1, b"\xc1")
        wire.live(2, stored_batch(12))
        wait_until(lambda: worker(engine).last_id == 2, what="the batch after the hole")
        stats = worker(engine)
        assert (stats.bad_frames, stats.gaps_detected, stats.gaps_lost, stats.state) == (1, 1, 1, "partial")
        assert engine.find_matches([local_of(12)]) == {(1, 0): 1}


def test_a_block_size_other_than_the_registered_one_is_dropped_and_counted(wire: Wire, wait_until):
    with Engine(shards=1, plane=CONFIG) as engine:
        engine.add_worker(WorkerSpec(1, wire.endpoint, topic=TOPIC, block_size=BLOCK))
        wire.ready()
        wire.live(0, stored_batch(10))
        wire.live(1, stored_batch(11, tokens=BLOCK + 1))  # the event says block_size 5
        wait_until(lambda: worker(engine).last_id == 1, what="both batches")
        stats = worker(engine)
        assert stats.dropped_blocks == 1
        assert stats.cached_blocks == 1


def test_events_of_another_attention_group_are_skipped_and_counted(wire: Wire, wait_until):
    """A hybrid model's second KV-cache group (``group_idx`` 1) is not the main attention's: skipped."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [5],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    payload = msgpack.packb([1.0, [{**stored, "group_idx": 1}, {**stored, "group_idx": 0}], 0])
    with Engine(shards=1, plane=CONFIG) as engine:
        engine.add_worker(WorkerSpec(1, wire.endpoint, topic=TOPIC, block_size=BLOCK))
        wire.ready()
        wire.live(0, payload)
        wait_until(lambda: worker(engine).last_id == 0, what="the batch")
        stats = worker(engine)
        assert (stats.skipped_events, stats.events, stats.cached_blocks) == (1, 1, 1)


def test_a_replay_peer_that_never_answers_times_out_into_lost_never_a_hang(wire: Wire, silent_peer: str, wait_until):
    with Engine(shards=1, plane=CONFIG) as engine:
        engine.add_worker(WorkerSpec(1, wire.endpoint, topic=TOPIC, replay_endpoint=silent_peer, block_size=BLOCK))
        wire.ready()
        wait_until(lambda: worker(engine).state == "partial", what="the join replay given up")
        wire.live(0, stored_batch(10))  # the engine's first batch: the whole history after all
        wait_until(lambda: worker(engine).state == "exact", what="the first batch")
        wire.live(3, stored_batch(13))  # 1 and 2 lost on the wire; the replay socket stays silent
        wait_until(lambda: worker(engine).gaps_lost == 1, what="the gap given up")
        stats = worker(engine)
        assert (stats.gaps_detected, stats.gaps_recovered, stats.state, stats.last_id) == (1, 0, "partial", 3)
        assert engine.find_matches([local_of(13)]) == {(1, 0): 1}
        engine.flush()


def test_a_publisher_that_vanishes_goes_stale_and_the_others_are_served(
    context: zmq.Context[zmq.Socket[bytes]], wait_until
):
    gone, stays = Wire(context), Wire(context)
    try:
        with Engine(shards=1, plane=CONFIG) as engine:
            engine.add_worker(WorkerSpec(1, gone.endpoint, topic=TOPIC, block_size=BLOCK))
            engine.add_worker(WorkerSpec(2, stays.endpoint, topic=TOPIC, block_size=BLOCK))
            gone.ready()
            stays.ready()
            gone.live(0, stored_batch(10))
            wait_until(lambda: worker(engine).last_id == 0, what="worker 1's batch")
            gone.close()
            wait_until(lambda: worker(engine).stale, what="worker 1 stale")
            stays.live(0, stored_batch(20))
            wait_until(lambda: worker(engine, 2).events == 1, what="worker 2 served")
            assert engine.find_matches([local_of(10)]) == {(1, 0): 1}  # stale is a report; blocks stay
    finally:
        stays.close()


def test_unknown_workers_are_refused_cleanly(wait_until):
    with Engine(shards=1, plane=CONFIG) as engine:
        engine.remove_worker(404)  # never registered: nothing to do, no error
        engine.flush()
        assert engine.workers() == {}


def test_each_kind_of_bad_message_is_logged_once_then_only_counted(
    context: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
):
    """The stream code in this process (no applier), so its log lines can be read."""
    shards = InProcessShards(1)
    wakes = Wakes()
    ingest = Ingest(context, wakes, shards.writers[0], CONFIG)
    try:
        ingest.add(WorkerSpec(1, "tcp://127.0.0.1:9", topic=TOPIC, block_size=BLOCK), [0])
        (stream,) = ingest._streams.values()
        with caplog.at_level(logging.WARNING, logger="kvrouter.plane.stream"):
            for seq in range(5):
                stream.on_drain(drain_of(stream, [encode_live(TOPIC, seq, b"\xc1"), [TOPIC]], CONFIG), time.monotonic())
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bad message")]
        assert len(lines) == 2
        assert all("worker=1 dp=0" in line and "tcp://127.0.0.1:9" in line for line in lines)
        assert int(stream.row[W_BAD_FRAMES]) == 10
    finally:
        ingest.close()
        wakes.close()
        shards.close()
