"""The durable-mode snapshot codec (``kvrouter/bridge/snapshot.py``): compact, round trip, refusal of garbage.

The oracle is :class:`~kvrouter.index.reference.RadixIndex`: an index rebuilt from a snapshot's events
must dump exactly as the one the snapshot was taken from, interior evictions (gap blocks) included.
"""

from __future__ import annotations

import contextlib
import random

import msgpack
import pytest

from kvrouter.bridge.snapshot import RankState, compact, decode_snapshot, encode_snapshot
from kvrouter.errors import BadMessage, EventError
from kvrouter.events.codecs.kvrouter import Decoder
from kvrouter.events.codecs.query import QueryRequest
from kvrouter.events.model import EngineHash, LocalHash, Removed, StorageTier, Stored, StoredBlock
from kvrouter.index.reference import RadixIndex
from kvrouter.worker.local_indexer import LocalIndexer

WORKER = 3


def random_index(seed: int, steps: int = 300) -> RadixIndex:
    """Branching chains stored and partly evicted (leaves and interior blocks), on two tiers."""
    rng = random.Random(seed)
    index = RadixIndex()
    held: dict[StorageTier, list[int]] = {StorageTier.DEVICE: [], StorageTier.HOST: []}
    next_hash = 1
    for event_id in range(steps):
        tier = rng.choice(list(held))
        blocks = held[tier]
        if blocks and rng.random() < 0.25:
            gone = rng.sample(blocks, k=min(len(blocks), rng.randint(1, 3)))
            event: Stored | Removed = Removed(WORKER, tuple(EngineHash(h) for h in gone), event_id=event_id, tier=tier)
            for h in gone:
                blocks.remove(h)
        else:
            parent = rng.choice(blocks) if blocks and rng.random() < 0.8 else None
            run = tuple(
                StoredBlock(EngineHash(next_hash + i), LocalHash(rng.getrandbits(64))) for i in range(rng.randint(1, 4))
            )
            next_hash += len(run)
            event = Stored(WORKER, None if parent is None else EngineHash(parent), run, event_id=event_id, tier=tier)
            blocks.extend(b.engine_hash for b in run)
        with contextlib.suppress(EventError):
            index.apply_event(WORKER, event)
    return index


@pytest.mark.parametrize("seed", range(8))
def test_compact_rebuilds_the_same_index_with_fewer_events(seed: int) -> None:
    index = random_index(seed)
    dump = index.dump()
    events = compact(dump)
    assert len(events) < len(dump)
    rebuilt = RadixIndex()
    for event in events:
        rebuilt.apply_event(WORKER, event)
    assert rebuilt.holdings() == index.holdings()


def test_snapshot_round_trip_is_compact() -> None:
    index = random_index(99, steps=2000)
    dump = index.dump()
    blocks = sum(len(e.blocks) for e in dump if isinstance(e, Stored))
    batches = tuple(LocalIndexer(WORKER).batches(compact(dump), None))
    data = encode_snapshot(41, [RankState(WORKER, 0, 1999, batches), RankState(8, 2, None, ())])
    assert len(data) < 24 * blocks  # 16 bytes of hashes a block plus a chain's share of one header
    snapshot = decode_snapshot(data)
    assert snapshot.stream_seq == 41
    assert [(r.worker_id, r.dp_rank, r.last_event_id) for r in snapshot.ranks] == [(WORKER, 0, 1999), (8, 2, None)]
    rebuilt = RadixIndex()
    for payload in snapshot.ranks[0].batches:
        for event in Decoder().decode(payload).events:
            rebuilt.apply_event(WORKER, event)
    assert rebuilt.holdings() == index.holdings()


def test_a_loaded_snapshot_answers_joins_with_its_batches_and_builds_the_index_only_when_needed() -> None:
    """``LocalIndexer.load_batches``: a tree dump is the snapshot's batches plus the events since, and the
    block set built later (``index``, or past ``buffer_events`` events) is the same as an eager load's."""
    index = random_index(7)
    batches = tuple(LocalIndexer(WORKER).batches(compact(index.dump()), None))
    lazy, eager = LocalIndexer(WORKER, buffer_events=4), LocalIndexer(WORKER, buffer_events=4)
    lazy.load_batches(batches, 299)
    eager.load([e for p in batches for e in Decoder().decode(p).events], 299)
    later = [
        Stored(WORKER, None, (StoredBlock(EngineHash(10_000 + i), LocalHash(i + 1)),), event_id=300 + i)
        for i in range(3)
    ]
    for local in (lazy, eager):
        local.apply(later)
    join = lazy.answer(QueryRequest(None, None))
    assert (join.reply, join.last_event_id) == ("tree_dump", 302)
    assert join.batches[: len(batches)] == batches  # the snapshot's bytes, as loaded
    rebuilt = RadixIndex()
    for payload in join.batches:
        for event in Decoder().decode(payload).events:
            rebuilt.apply_event(WORKER, event)
    assert rebuilt.holdings() == eager.index.holdings()
    assert lazy.answer(QueryRequest(301, None)).reply == "events"
    more = [Stored(WORKER, None, (StoredBlock(EngineHash(9_000 + i), LocalHash(i)),), event_id=303 + i) for i in [0, 1]]
    for local in (lazy, eager):
        local.apply(more)
    assert lazy.index.holdings() == eager.index.holdings()  # past buffer_events: built, the same
    assert [e.event_id for e in lazy.since(300)] == [301, 302, 303, 304]


@pytest.mark.parametrize(
    ("data", "names"),
    [
        (b"garbage \x00\xff", "not msgpack"),
        (msgpack.packb([1, 2]), "expected a map"),
        (msgpack.packb({"v": 1, "kind": "other"}), "kind 'other'"),
        (msgpack.packb({"v": 1, "kind": "kvrouter-radix-state", "stream_seq": -1, "ranks": []}), "stream_seq"),
        (msgpack.packb({"v": 1, "kind": "kvrouter-radix-state", "stream_seq": 1, "ranks": [[1, 0]]}), "ranks[0]"),
        (
            msgpack.packb({"v": 1, "kind": "kvrouter-radix-state", "stream_seq": 1, "ranks": [[1, 0, 5, [b"x"]]]}),
            "ranks[0].batches[0]",
        ),
    ],
)
def test_garbage_is_refused_naming_the_field(data: bytes, names: str) -> None:
    with pytest.raises(BadMessage, match=names.replace("[", r"\[").replace("]", r"\]")):
        decode_snapshot(data)
