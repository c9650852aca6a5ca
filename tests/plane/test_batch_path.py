"""The compiled batch path (``Stream.on_drain``, ``events/codecs/runs.py``) against the per-message path.

The oracle is the same stream with its batch path off: every message checked, decoded and applied on its
own, as the applier did before there was a batch path. Both get the same drains of generated messages
that mix in-order stretches, gaps, restarts, another rank's batches, LoRA and salted stores (which the
batch path leaves to the Python decoder), clears, tiers and malformed frames; afterwards the two indexes
answer every query alike and every counter of the worker's row and of the shard is the same.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack, closing
from dataclasses import dataclass, replace
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from kvrouter.events.codecs import kvrouter, sglang, vllm
from kvrouter.events.codecs.frames import encode_live
from kvrouter.events.codecs.kvrouter import RawEvent
from kvrouter.events.model import (
    Cleared,
    EngineHash,
    EventBatch,
    KvEvent,
    LocalHash,
    Removed,
    StorageTier,
    Stored,
    StoredBlock,
    WorkerKey,
)
from kvrouter.hashing import block_hashes
from kvrouter.index.layout import W_BAD_FRAMES, W_DROPPED_BLOCKS, W_LAST_EVENT_NS, W_SKIPPED_EVENTS
from kvrouter.plane import PlaneConfig, WorkerSpec
from kvrouter.plane.ingest import Ingest
from kvrouter.plane.stream import Stream
from kvrouter.plane.wakes import Wakes
from tests.index.shm import InProcessShards
from tests.plane.drains import drain_of

BLOCK = 4
TOPIC = b"kv"
CONFIG = PlaneConfig(max_message_bytes=64 << 10)
HASHES = st.integers(1, 40)
"""Engine hashes from a small pool, so stores meet their parents and removals meet stores."""


@dataclass
class Side:
    shards: InProcessShards
    ingest: Ingest
    wakes: Wakes
    streams: dict[int, Stream]
    """By worker id; the workers share the shard."""

    def close(self) -> None:
        self.ingest.close()
        self.wakes.close()
        self.shards.close()


def side(
    context: zmq.Context[zmq.Socket[bytes]], fmt: str, *, batch: bool, workers: int = 1, config: PlaneConfig = CONFIG
) -> Side:
    shards = InProcessShards(1)
    wakes = Wakes()
    ingest = Ingest(context, wakes, shards.writers[0], config)
    try:
        for worker in range(1, workers + 1):
            spec = WorkerSpec(worker, f"tcp://127.0.0.1:{worker}", format=fmt, topic=TOPIC, block_size=BLOCK)  # type: ignore[arg-type]
            ingest.add(spec, [0])
        streams = {key[0]: stream for key, stream in ingest._streams.items()}
    except BaseException:
        ingest.close()
        wakes.close()
        shards.close()
        raise
    if not batch:
        for stream in streams.values():
            stream._runs = None  # the oracle: the same streams, one message at a time
    return Side(shards, ingest, wakes, streams)


def stored(hashes: list[int], parent: int | None, seed: int, **extra: object) -> Stored:
    blocks = []
    for i, engine_hash in enumerate(hashes):
        tokens = tuple(range(seed + 10 * i, seed + 10 * i + BLOCK))
        blocks.append(StoredBlock(EngineHash(engine_hash), LocalHash(block_hashes(tokens, BLOCK)[0]), tokens))
    return Stored(1, None if parent is None else EngineHash(parent), tuple(blocks), **extra)  # type: ignore[arg-type]


@st.composite
def events(draw: st.DrawFn) -> KvEvent:
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear", "lora", "salt"]))
    tier = draw(st.sampled_from([StorageTier.DEVICE, StorageTier.DEVICE, StorageTier.HOST]))
    if kind == "remove":
        return Removed(1, tuple(EngineHash(h) for h in draw(st.lists(HASHES, min_size=1, max_size=3))), tier=tier)
    if kind == "clear":
        return Cleared(1)
    hashes = draw(st.lists(HASHES, min_size=1, max_size=4, unique=True))
    parent = draw(st.none() | HASHES)
    seed = draw(st.integers(0, 3)) * 100
    if kind == "lora":
        return stored(hashes, parent, seed, tier=tier, lora_name="adapter-x")
    if kind == "salt":
        return stored(hashes, parent, seed, tier=tier, cache_salt="tenant")
    return stored(hashes, parent, seed, tier=tier)


@st.composite
def messages(draw: st.DrawFn, fmt: str, worker: int = 1) -> list[list[bytes]]:
    """Frames as a worker's PUB would send them, some of them wrong. ``next_id`` is the ZMQ sequence number
    of an engine's next batch, or a kvrouter worker's next event id (its batches' sequence numbers are not
    read)."""
    out: list[list[bytes]] = []
    next_id = 0
    for seq in range(draw(st.integers(1, 24))):
        what = draw(st.sampled_from(["batch"] * 8 + ["gap", "restart", "rank", "garbage", "topic", "shape", "ids"]))
        rank = 1 if what == "rank" else 0
        if what == "gap":
            next_id += draw(st.integers(2, 3))
        elif what == "restart":
            next_id = 0
        drawn = [replace(e, worker_id=worker) for e in draw(st.lists(events(), min_size=1, max_size=3))]
        if fmt == "kvrouter":
            ids = [next_id + i for i in range(len(drawn))]
            if what == "ids" and len(ids) > 1:
                ids.reverse()
            batch = EventBatch(
                tuple(replace(e, dp_rank=rank, event_id=i) for e, i in zip(drawn, ids, strict=True)),
                timestamp=1.0,
                dp_rank=rank,
            )
            payload = kvrouter.Encoder(with_tokens=draw(st.booleans())).encode(batch)
            wire_seq, next_id = seq, next_id + len(drawn)
        else:
            codec = vllm if fmt == "vllm" else sglang
            batch = EventBatch(tuple(replace(e, dp_rank=rank) for e in drawn), timestamp=1.0, dp_rank=rank)
            payload = codec.Encoder(draw(st.sampled_from(["map", "array"]))).encode(batch)
            wire_seq, next_id = next_id, next_id + 1
        if what == "garbage":
            out.append(encode_live(TOPIC, wire_seq, payload[: len(payload) // 2]))
        elif what == "topic":
            out.append(encode_live(b"kv-other", wire_seq, payload))
        elif what == "shape":
            out.append([TOPIC, payload])
        else:
            out.append(encode_live(TOPIC, wire_seq, payload))
    return out


def state(s: Side) -> tuple[object, ...]:
    rows = []
    for stream in s.streams.values():
        row = stream.row.copy()
        row[W_LAST_EVENT_NS] = 0
        rows.append((row.tolist(), stream.cursor))
    stats = s.shards.control.stats(0)
    stats.pop("last_event_ns")
    stats.pop("lag_us")
    return rows, stats, s.shards.writers[0].engine_hashes()


def answers(s: Side, queries: list[list[int]]) -> list[dict[tuple[int, int], int]]:
    return [s.shards.find_matches(q) for q in queries]


def queries_of(frames: list[list[bytes]], fmt: str) -> list[list[int]]:
    """Every store's local hashes, as a chain and block by block (the worker a decoder is built for does
    not change the hashes)."""
    out: list[list[int]] = []
    decoder = kvrouter.Decoder() if fmt == "kvrouter" else (vllm if fmt == "vllm" else sglang).Decoder(1, BLOCK)
    for message in frames:
        try:
            batch = decoder.decode(message[-1])
        except Exception:
            continue
        for event in batch.events:
            if isinstance(event, Stored):
                chain = [int(b.local_hash) for b in event.blocks]
                out.append(chain)
                out.extend([h] for h in chain)
    return out


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "kvrouter"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_drains_apply_as_the_messages_one_by_one(
    context: zmq.Context[zmq.Socket[bytes]], fmt: str, data: st.DataObject
) -> None:
    """Two workers on one shard, their drains interleaved as the applier's poller would hand them over."""
    frames = {worker: data.draw(messages(fmt, worker)) for worker in (1, 2)}
    drains: dict[int, list[list[list[bytes]]]] = {}
    for worker, sent in frames.items():
        cuts = sorted(set(data.draw(st.lists(st.integers(1, len(sent) - 1), max_size=3)) if len(sent) > 1 else []))
        drains[worker] = [sent[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, len(sent)], strict=True)]
    turns = data.draw(st.permutations([worker for worker, own in drains.items() for _ in own]))
    with ExitStack() as stack:
        batch = stack.enter_context(closing(side(context, fmt, batch=True, workers=2)))
        oracle = stack.enter_context(closing(side(context, fmt, batch=False, workers=2)))
        now = time.monotonic()
        for worker in turns:  # each worker's drains in order, the two workers' interleaved
            drain = drains[worker].pop(0)
            for s in (batch, oracle):
                s.streams[worker].on_drain(drain_of(s.streams[worker], drain, CONFIG), now)
        assert state(batch) == state(oracle)
        queries = queries_of(frames[1] + frames[2], fmt)
        assert answers(batch, queries) == answers(oracle, queries)


def test_a_steady_drain_is_one_apply_and_a_lora_store_in_it_is_applied_on_its_own(
    context: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten in-order batches after the first: the first is read against no cursor (on its own), the next four
    are one run, the LoRA store goes through the Python decoder, the last four are one run again."""
    encoder = vllm.Encoder("map")
    plain = [encoder.encode(EventBatch((stored([10 + i], None, 100 * i),), timestamp=1.0)) for i in range(10)]
    plain[5] = encoder.encode(EventBatch((stored([99], None, 7, lora_name="adapter-x"),), timestamp=1.0))
    s = side(context, "vllm", batch=True)
    writer = s.shards.writers[0]
    runs: list[int] = []
    packed, single = writer.apply_packed, writer.apply_batch

    def apply_packed(key: WorkerKey, kinds: npt.NDArray[np.uint8], *args: Any, **kwargs: Any) -> list[str]:
        runs.append(kinds.size)
        return packed(key, kinds, *args, **kwargs)

    def apply_batch(key: WorkerKey, events: Sequence[RawEvent], *args: Any) -> list[str]:
        runs.append(-len(events))
        return single(key, events, *args)

    monkeypatch.setattr(writer, "apply_packed", apply_packed)
    monkeypatch.setattr(writer, "apply_batch", apply_batch)
    try:
        sent = [encode_live(TOPIC, seq, p) for seq, p in enumerate(plain)]
        s.streams[1].on_drain(drain_of(s.streams[1], sent, CONFIG), time.monotonic())
        assert runs == [-1, 4, -1, 4]
        assert s.streams[1].cursor == 9
        lora_local = block_hashes(tuple(range(7, 7 + BLOCK)), BLOCK, lora_name="adapter-x")
        assert s.shards.find_matches(lora_local) == {(1, 0): 1}
        assert s.shards.find_matches([block_hashes(tuple(range(900, 900 + BLOCK)), BLOCK)[0]]) == {(1, 0): 1}
    finally:
        s.close()


def test_the_decoder_gives_up_rather_than_guess() -> None:
    """Payloads the Python decoder reads in ways this pass does not copy stay with it: the run is empty and
    the pass says it gave up, never an error of its own."""
    from kvrouter.events.codecs.runs import C_NEXT, GAVE_UP, RunBuffers, RunDecoder

    encoder = vllm.Encoder("map")
    good = encoder.encode(EventBatch((stored([1, 2], None, 0),), timestamp=1.0))
    cases = [
        good + b"\x00",  # trailing bytes
        good[:-3],  # truncated
        b"\x93\xcb" + np.float64(1.0).byteswap().tobytes() + b"\x91\x81\xa4type\xa7Unknown\x00",  # unknown tag
        encoder.encode(EventBatch((replace(stored([1], None, 0), dp_rank=3),), timestamp=1.0, dp_rank=3)),
        encoder.encode(EventBatch((Stored(1, None, (StoredBlock(EngineHash(1), LocalHash(0), (1, 2)),)),))),
    ]
    for payload in cases:
        runs = RunDecoder(vllm.Decoder.dialect, 1, 0, BLOCK, RunBuffers())
        runs.load([payload], [0])
        assert runs.decode(0, 0) == GAVE_UP
        assert runs.buffers.counts[C_NEXT] == 0


def engine_store(hashes: list[int], seed: int, **fields: object) -> dict[str, object]:
    """A vLLM 0.33 BlockStored map, with ``fields`` added or replacing the defaults."""
    tokens = [seed + i for i in range(BLOCK * len(hashes))]
    event: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    return {**event, **fields}


def test_skipped_groups_foreign_sizes_and_oversized_messages_count_alike(
    context: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the batch path counts itself (events of another attention group) and what it leaves to the stream
    (a block size not the router's, tokens short of the hashes, a message over the size limit) end in the same
    counters either way."""
    batches = [
        [engine_store([1, 2], 0)],
        [engine_store([3], 100, group_idx=1), engine_store([4], 200)],  # another group: skipped
        [
            engine_store([5], 300, kv_cache_spec_kind="sliding_window"),
            engine_store([6], 400, kv_cache_spec_kind="mla_attention"),
        ],
        [engine_store([7, 8], 500, block_size=2 * BLOCK)],  # not the router's block size: dropped, counted
        [engine_store([9, 10], 600, token_ids=list(range(BLOCK)))],  # the second block has no tokens
        [engine_store([11], 700, extra_keys=[None])],  # extra keys that say nothing
        [engine_store([12], 800, unknown_field=[1, "x", None])],  # a field no decoder reads
        [engine_store(list(range(20, 20 + 2000)), 900)],  # past the size limit below
        [{"type": "BlockRemoved", "block_hashes": [1, 99], "medium": "CPU", "group_idx": 0}],
        [{"type": "AllBlocksCleared"}, engine_store([13], 1000)],
    ]
    frames = [encode_live(TOPIC, seq, msgpack.packb([1.5, events, 0])) for seq, events in enumerate(batches)]
    limit = max(len(f[2]) for f in frames[:-3]) + 1
    config = PlaneConfig(max_message_bytes=limit)
    runs: list[int] = []

    def apply_packed(key: WorkerKey, kinds: npt.NDArray[np.uint8], *args: Any, **kwargs: Any) -> list[str]:
        runs.append(kinds.size)
        return packed(key, kinds, *args, **kwargs)

    with ExitStack() as stack:
        sides = [stack.enter_context(closing(side(context, "vllm", batch=b, config=config))) for b in (True, False)]
        packed = sides[0].shards.writers[0].apply_packed
        monkeypatch.setattr(sides[0].shards.writers[0], "apply_packed", apply_packed)
        for s in sides:
            s.streams[1].on_drain(drain_of(s.streams[1], frames[:1], config), time.monotonic())
            s.streams[1].on_drain(drain_of(s.streams[1], frames[1:], config), time.monotonic())
        # Stretches end at the foreign size and at the oversized message, whose sequence number the stream
        # never reads: the removal after it is a gap (read one by one), the clear and store after that a run.
        assert runs == [2, 2, 2]
        assert state(sides[0]) == state(sides[1])
        row = sides[0].streams[1].row
        assert int(row[W_SKIPPED_EVENTS]) == 2
        assert int(row[W_DROPPED_BLOCKS]) == 3  # two of another size, one short of tokens
        assert int(row[W_BAD_FRAMES]) == 1  # the oversized one
