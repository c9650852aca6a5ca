"""The shared-memory index (writers + reader, in-process) against the oracle: every contract scenario and
hypothesis streams, with 1, 2 and 4 shards; growth; worker rows."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvrouter.engine import read_workers
from kvrouter.events.model import (
    Cleared,
    EngineHash,
    KvEvent,
    LocalHash,
    Removed,
    StorageTier,
    Stored,
    StoredBlock,
)
from kvrouter.index import RadixIndex, _kernels as kernels, layout
from kvrouter.index.layout import H_CAPACITY, H_LIVE, H_NWORDS, H_TIERS, MAP_MAX_LOAD, MAX_LOAD, Control
from kvrouter.index.reader import IndexReader
from kvrouter.index.writer import raw_event
from tests.index.contract import error_kind, replay
from tests.index.shm import InProcessShards


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"{n}-shards")
def shards(request: pytest.FixtureRequest) -> Iterator[InProcessShards]:
    engine = InProcessShards(request.param)
    try:
        yield engine
    finally:
        engine.close()


def test_contract_scenario(contract_scenario: dict[str, Any], shards: InProcessShards):
    for where, got, expected in replay(shards, contract_scenario):
        assert got == expected, where


CONTENT = st.integers(1, 4)
ENGINE_HASHES = st.integers(1, 40).map(EngineHash)
WORKER_IDS = st.integers(1, 12)


class AgreesWithOracle(RuleBasedStateMachine):
    """Arbitrary streams over many workers, dp ranks and tiers into RadixIndex and the shared-memory
    index with 1, 2 and 4 shards: every event fares the same, every query answers the same."""

    def __init__(self) -> None:
        super().__init__()
        self.oracle = RadixIndex()
        self.shards = [InProcessShards(n) for n in (1, 2, 4)]
        self.queries: set[tuple[int, ...]] = set()

    def teardown(self) -> None:
        for index in self.shards:
            index.close()

    def apply(self, event: KvEvent) -> None:
        expected = error_kind(self.oracle, event.worker_id, event)
        for index in self.shards:
            assert error_kind(index, event.worker_id, event) == expected, (len(index.writers), event)

    def held(self, worker: int, rank: int, tier: StorageTier) -> list[EngineHash]:
        return sorted(self.oracle.holdings().get(((worker, rank), tier), {}))

    @rule(
        worker=WORKER_IDS,
        rank=st.integers(0, 2),
        tier=st.sampled_from(list(StorageTier)),
        data=st.data(),
        blocks=st.lists(st.tuples(ENGINE_HASHES, CONTENT), max_size=6),
    )
    def store(self, worker: int, rank: int, tier: StorageTier, data: st.DataObject, blocks: list[tuple[int, int]]):
        held = self.held(worker, rank, tier)
        parent = data.draw(st.none() | (st.sampled_from(held) if held else ENGINE_HASHES), label="parent")
        stored = tuple(StoredBlock(EngineHash(e), LocalHash(h)) for e, h in blocks)
        self.apply(Stored(worker, parent, stored, dp_rank=rank, tier=tier))

    @rule(worker=WORKER_IDS, rank=st.integers(0, 2), tier=st.sampled_from(list(StorageTier)), data=st.data())
    def remove(self, worker: int, rank: int, tier: StorageTier, data: st.DataObject):
        held = self.held(worker, rank, tier)
        chosen = data.draw(st.lists(st.sampled_from(held), max_size=4), label="held") if held else []
        unknown = data.draw(st.lists(ENGINE_HASHES, max_size=1), label="unknown")
        self.apply(Removed(worker, tuple(chosen + unknown), dp_rank=rank, tier=tier))

    @rule(worker=WORKER_IDS, rank=st.integers(0, 2), tier=st.sampled_from(list(StorageTier)))
    def clear(self, worker: int, rank: int, tier: StorageTier):
        self.apply(Cleared(worker, dp_rank=rank, tier=tier))

    @rule(worker=WORKER_IDS, rank=st.integers(0, 2), data=st.data())
    def batch(self, worker: int, rank: int, data: st.DataObject):
        """Several events of one worker in one ``apply_batch`` (runs of one tier go to ``apply_run``)."""
        tiers = data.draw(st.lists(st.sampled_from(list(StorageTier)), min_size=1, max_size=2), label="tiers")
        events: list[KvEvent] = []
        for _ in range(data.draw(st.integers(1, 6), label="events")):
            tier = data.draw(st.sampled_from(tiers), label="tier")
            held = self.held(worker, rank, tier) + [
                b.engine_hash for e in events if isinstance(e, Stored) for b in e.blocks
            ]
            known = st.sampled_from(held) if held else ENGINE_HASHES
            match data.draw(st.sampled_from("SSSRRC"), label="tag"):
                case "S":
                    parent = data.draw(st.none() | known | ENGINE_HASHES, label="parent")
                    blocks = data.draw(st.lists(st.tuples(ENGINE_HASHES, CONTENT), max_size=6), label="blocks")
                    stored = tuple(StoredBlock(EngineHash(e), LocalHash(h)) for e, h in blocks)
                    events.append(Stored(worker, parent, stored, dp_rank=rank, tier=tier))
                case "R":
                    hashes = data.draw(st.lists(known | ENGINE_HASHES, max_size=4), label="removed")
                    events.append(Removed(worker, tuple(hashes), dp_rank=rank, tier=tier))
                case _:
                    events.append(Cleared(worker, dp_rank=rank, tier=tier))
        expected = [kind for event in events if (kind := error_kind(self.oracle, worker, event))]
        for index in self.shards:
            assert index.apply_batch((worker, rank), events) == expected, (len(index.writers), events)

    @rule(worker=WORKER_IDS, everything=st.booleans())
    def drop_worker(self, worker: int, everything: bool):
        indexes: list[RadixIndex | InProcessShards] = [self.oracle, *self.shards]
        for index in indexes:
            if everything:
                index.remove_worker(worker)
            else:
                index.clear_all_blocks(worker)

    @rule(query=st.lists(CONTENT, min_size=1, max_size=7))
    def remember_query(self, query: list[int]):
        self.queries.add(tuple(query))

    @invariant()
    def same_cached_blocks_per_tier(self) -> None:
        """Every worker row counts, per tier, the distinct blocks the oracle holds for it there."""
        expected = {tier: self.oracle.block_counts(tier) for tier in StorageTier}
        for index in self.shards:
            for key, stats in read_workers(index.control).items():
                got = {tier: stats.cached_by_tier[tier.value] for tier in StorageTier}
                assert got == {tier: counts.get(key, 0) for tier, counts in expected.items()}, (len(index.writers), key)
                assert stats.cached_blocks == got[StorageTier.DEVICE]

    @invariant()
    def same_answers(self) -> None:
        paths = {p for held in self.oracle.holdings().values() for p in held.values()}
        for query in paths | self.queries:
            expected = self.oracle.find_matches_by_tier(query)
            for index in self.shards:
                assert index.find_matches_by_tier(query) == expected, (len(index.writers), query)
                assert index.find_matches(query) == expected[StorageTier.DEVICE]


AgreesWithOracle.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestAgreesWithOracle = AgreesWithOracle.TestCase


def _chain_event(worker: int, locals_: list[int], first_engine: int, dp_rank: int = 0) -> Stored:
    blocks = tuple(StoredBlock(EngineHash(first_engine + i), LocalHash(h)) for i, h in enumerate(locals_))
    return Stored(worker, None, blocks, dp_rank=dp_rank)


def test_growth_keeps_every_answer_and_unlinks_old_segments():
    index, oracle = InProcessShards(1), RadixIndex()
    try:
        first_segment = index.writers[0].segment_name
        for doc in range(40):  # 40 chains of 100 blocks: several doublings from 1024 slots
            event = _chain_event(1 + doc % 3, [doc * 1000 + i for i in range(100)], doc * 1000)
            index.apply_event(event.worker_id, event)
            oracle.apply_event(event.worker_id, event)
        index.writers[0].settle()  # the helper has released the old segments
        assert index.control.epoch(0) > 1
        assert not os.path.exists(f"/dev/shm/{first_segment}")
        for doc in range(40):
            query = [doc * 1000 + i for i in range(120)]
            assert index.find_matches_by_tier(query) == oracle.find_matches_by_tier(query)
    finally:
        index.close()


def test_a_batch_grows_the_tables_between_its_events():
    """A multi-event batch passes every table's load mid-run: the writer grows them and resumes at the event
    that needed room, with every answer (and the one error) as if the events had come one by one."""
    index, oracle = InProcessShards(1), RadixIndex()
    try:
        events: list[KvEvent] = [_chain_event(1, [doc * 1000 + i for i in range(100)], doc * 1000) for doc in range(40)]
        events.append(Removed(1, (EngineHash(5), EngineHash(999_999))))
        assert index.apply_batch((1, 0), events) == ["block_not_found"]
        for event in events:
            error_kind(oracle, 1, event)
        assert index.control.epoch(0) > 1
        for doc in range(40):
            query = [doc * 1000 + i for i in range(120)]
            assert index.find_matches_by_tier(query) == oracle.find_matches_by_tier(query)
        assert index.control.workers(0) == {0: (1, 0, 40 * 100 - 1)}
    finally:
        index.close()


def test_compaction_drops_tombstones_without_growing():
    index = InProcessShards(1)
    try:
        for round_ in range(30):
            event = _chain_event(1, [round_ * 1000 + i for i in range(100)], round_ * 1000)
            index.apply_event(1, event)
            index.apply_event(1, Removed(1, tuple(b.engine_hash for b in event.blocks)))
        table = index.writers[0].table
        assert int(table[H_LIVE]) == 0
        assert int(table[H_CAPACITY]) <= 1024  # churn alone never grew the table: rebuilds compacted it
        assert index.find_matches([29_000]) == {}
    finally:
        index.close()


def test_masks_widen_past_64_workers_and_rows_are_reused():
    index, oracle = InProcessShards(1), RadixIndex()
    try:
        for worker in range(1, 151):
            event = _chain_event(worker, [1, 2, worker + 100], 10 * worker)
            index.apply_event(worker, event)
            oracle.apply_event(worker, event)
        assert int(index.writers[0].table[H_NWORDS]) == 4
        assert index.find_matches([1, 2, 3]) == oracle.find_matches([1, 2, 3])
        assert index.find_matches([1, 2, 150]) == {(w, 0): 2 for w in range(1, 151)} | {(50, 0): 3}
        index.remove_worker(7)
        rows_in_use = len(index.control.workers(0))
        index.apply_event(999, _chain_event(999, [1], 5))
        assert len(index.control.workers(0)) == rows_in_use + 1
        assert index.control.workers(0)[6] == (999, 0, 1)  # worker 7's freed row (bit 6) went to the newcomer
    finally:
        index.close()


def test_a_table_has_masks_for_the_tiers_in_use_and_widens_at_the_first_store_in_another():
    """A table starts with device masks only; removes and clears in a tier it has no masks for change
    nothing; the first store in a slower tier widens it once, keeping every answer of every tier, and a
    reader attached before the widening follows it."""
    index, oracle = InProcessShards(1), RadixIndex()
    reader = IndexReader(index.control.name)
    events: list[KvEvent] = [
        _chain_event(1, [1, 2, 3], 10),
        _chain_event(2, [1, 2, 4], 20),
        Removed(1, (EngineHash(99),), tier=StorageTier.HOST),
        Cleared(2, tier=StorageTier.DISK),
    ]
    try:
        for event in events:
            index.apply_batch((event.worker_id, 0), [event])
            error_kind(oracle, event.worker_id, event)
        table = index.writers[0].table
        assert (int(table[H_TIERS]), int(table[H_NWORDS])) == (1, 1)
        epoch = index.control.epoch(0)
        assert reader.find_matches_by_tier([1, 2, 3]) == oracle.find_matches_by_tier([1, 2, 3])
        for event, tiers in (
            (Stored(2, None, (StoredBlock(EngineHash(30), LocalHash(1)),), tier=StorageTier.HOST), 2),
            (Stored(1, None, (StoredBlock(EngineHash(40), LocalHash(7)),), tier=StorageTier.SHARED), 4),
            (Stored(1, None, (StoredBlock(EngineHash(50), LocalHash(8)),), tier=StorageTier.DISK), 4),
        ):
            index.apply_event(event.worker_id, event)
            oracle.apply_event(event.worker_id, event)
            assert int(index.writers[0].table[H_TIERS]) == tiers
            for query in ([1, 2, 3], [1, 2, 4], [7], [8]):
                assert reader.find_matches_by_tier(query) == oracle.find_matches_by_tier(query), query
                assert reader.find_matches(query) == oracle.find_matches(query), query
        assert index.control.epoch(0) == epoch + 2  # one copy per widening, none for a tier already there
        assert _tiers(index, (1, 0)) == (3, 0, 1, 1)
    finally:
        reader.close()
        index.close()


def test_the_engine_map_fills_to_its_own_load_and_the_table_to_half():
    """The writer's private engine map grows past ``MAP_MAX_LOAD``, the shared table past ``MAX_LOAD``: 700
    fresh blocks take the table from 1,024 slots to 2,048 and leave the 1,024-row map as it is (0.68)."""
    index = InProcessShards(1)
    try:
        writer = index.writers[0]
        rows = int(writer._emeta[kernels.M_CAPACITY])
        assert rows == int(writer.table[H_CAPACITY]) == 1024
        for doc in range(7):
            index.apply_event(1, _chain_event(1, [doc * 1000 + i for i in range(100)], doc * 1000))
        writer.settle()
        assert MAX_LOAD < int(writer._emeta[kernels.M_USED]) / rows < MAP_MAX_LOAD
        assert int(writer._emeta[kernels.M_CAPACITY]) == rows
        assert int(writer.table[H_CAPACITY]) == 2048
    finally:
        index.close()


def test_worker_rows_count_cached_device_blocks():
    index = InProcessShards(1)
    try:
        index.apply_event(3, _chain_event(3, [1, 2, 3], 100, dp_rank=1))
        index.apply_event(3, Removed(3, (EngineHash(101),), dp_rank=1))
        assert index.control.workers(0) == {0: (3, 1, 2)}
        index.clear_all_blocks(3)
        assert index.control.workers(0) == {0: (3, 1, 0)}
    finally:
        index.close()


def _tiers(index: InProcessShards, key: tuple[int, int]) -> tuple[int, ...]:
    """The worker's cached blocks per tier (device, host, disk, shared) as its control row holds them."""
    return tuple(read_workers(index.control)[key].cached_by_tier[tier.value] for tier in StorageTier)


def test_worker_rows_count_cached_blocks_in_every_tier():
    """Stores and removes in the host and disk tiers, a block moving from device to host, an engine hash
    re-used for other content, one content under two engine hashes, a Cleared tier, then everything
    cleared: after each, the row's four counts are the oracle's per-tier block counts."""
    index, oracle = InProcessShards(2), RadixIndex()
    key = (3, 1)
    host, disk = StorageTier.HOST, StorageTier.DISK

    def blocks(*pairs: tuple[int, int]) -> tuple[StoredBlock, ...]:
        return tuple(StoredBlock(EngineHash(e), LocalHash(h)) for e, h in pairs)

    steps: list[tuple[KvEvent, tuple[int, int, int, int]]] = [
        (_chain_event(3, [1, 2, 3], 100, dp_rank=1), (3, 0, 0, 0)),
        (Stored(3, None, blocks((200, 1), (201, 2)), dp_rank=1, tier=host), (3, 2, 0, 0)),
        (Stored(3, None, blocks((300, 7), (301, 8), (302, 9), (303, 10)), dp_rank=1, tier=disk), (3, 2, 4, 0)),
        (Removed(3, (EngineHash(302), EngineHash(303)), dp_rank=1, tier=disk), (3, 2, 2, 0)),
        # the device's third block is offloaded: gone from the device, stored in the host tier
        (Removed(3, (EngineHash(102),), dp_rank=1), (2, 2, 2, 0)),
        (Stored(3, EngineHash(201), blocks((202, 3)), dp_rank=1, tier=host), (2, 3, 2, 0)),
        # host hash 202 re-used for other content: the block moved, the count stays
        (Stored(3, EngineHash(201), blocks((202, 4)), dp_rank=1, tier=host), (2, 3, 2, 0)),
        # the same content under a second engine hash counts once, until both are removed
        (Stored(3, None, blocks((210, 1)), dp_rank=1, tier=host), (2, 3, 2, 0)),
        (Removed(3, (EngineHash(200),), dp_rank=1, tier=host), (2, 3, 2, 0)),
        (Removed(3, (EngineHash(210),), dp_rank=1, tier=host), (2, 2, 2, 0)),
        (Stored(3, None, blocks((400, 1)), dp_rank=1, tier=StorageTier.SHARED), (2, 2, 2, 1)),
        (Cleared(3, dp_rank=1, tier=host), (2, 0, 2, 1)),
    ]
    try:
        for event, expected in steps:
            index.apply_event(3, event)
            oracle.apply_event(3, event)
            counts = tuple(oracle.block_counts(tier).get(key, 0) for tier in StorageTier)
            assert (_tiers(index, key), counts) == (expected, expected), event
        index.clear_all_blocks(3)
        assert _tiers(index, key) == (0, 0, 0, 0)
    finally:
        index.close()


def test_a_freed_row_starts_its_next_worker_at_zero_in_every_tier():
    index = InProcessShards(1)
    try:
        index.apply_event(3, Stored(3, None, (StoredBlock(EngineHash(1), LocalHash(1)),), tier=StorageTier.DISK))
        index.remove_worker(3)
        index.writers[0].register((4, 0))
        assert index.control.workers(0) == {0: (4, 0, 0)}  # worker 3's row
        assert _tiers(index, (4, 0)) == (0, 0, 0, 0)
    finally:
        index.close()


def test_the_per_tier_counts_round_trip_through_a_read_only_attachment():
    """What the writer keeps in a row is what another process reads: ``Control.cached_by_tier`` and
    ``read_workers`` over a read-only mapping of the control segment, beside the row's other words."""
    index = InProcessShards(1)
    attached = Control.attach(index.control.name)
    try:
        index.apply_event(5, _chain_event(5, [1, 2], 10))
        index.apply_event(5, Stored(5, None, (StoredBlock(EngineHash(20), LocalHash(3)),), tier=StorageTier.HOST))
        shared = tuple(StoredBlock(EngineHash(30 + i), LocalHash(40 + i)) for i in range(3))
        index.apply_event(5, Stored(5, None, shared, tier=StorageTier.SHARED))
        assert attached.cached_by_tier(0) == {0: (2, 1, 0, 3)}
        assert attached.workers(0) == {0: (5, 0, 2)}
        stats = read_workers(attached)[5, 0]
        assert stats.cached_by_tier == {"device": 2, "host": 1, "disk": 0, "shared": 3}
        assert (stats.cached_blocks, stats.events, stats.last_id) == (2, 0, None)  # the plane's words untouched
    finally:
        attached.close()
        index.close()


def test_the_row_words_are_distinct_and_fit_the_row():
    words = {name: getattr(layout, name) for name in dir(layout) if name.startswith("W_") and name.isupper()}
    words.pop("W_CACHED_BY_TIER")
    words.pop("W_EVICTED_BY_REASON")
    assert sorted(words.values()) == list(range(len(words)))
    assert len(words) == layout.WORKER_ROW_WORDS == 22  # the cap's evictions, by reason, took two more
    assert layout.W_EVICTED_BY_REASON == (layout.W_EVICTED_UNTRUSTED, layout.W_EVICTED_LRU)
    assert layout.W_CACHED_BY_TIER == (
        layout.W_CACHED,
        layout.W_CACHED_HOST,
        layout.W_CACHED_DISK,
        layout.W_CACHED_SHARED,
    )
    assert layout.LAYOUT_VERSION == 5


def test_every_holder_tag_fits_below_a_deleted_row_s():
    """An engine-map row's tag holds ``holder + 1`` under ``HOLDER``, its links above: the largest holder of a
    shard must not read as ``TOMB``'s all-ones, and no link bit may fall in the holder's."""
    assert int(kernels.HOLDER) > layout.WORKER_ROWS * layout.TIERS + 1
    assert int(kernels.HOLDER) & int(kernels.CHILDREN | kernels.HAS_PARENT) == 0
    assert int(kernels.HOLDER | kernels.CHILDREN | kernels.HAS_PARENT) == int(kernels.TOMB)


def test_the_shard_block_words_are_distinct_and_fit_the_block():
    single = {name: getattr(layout, name) for name in dir(layout) if name.startswith("S_") and name.isupper()}
    taken = [word for name, word in single.items() if name not in ("S_ERRORS", "S_NAME", "S_EVICTED")]
    taken += [layout.S_ERRORS + i for i in range(len(layout.ERROR_KINDS))]
    taken += [layout.S_NAME + i for i in range(layout.NAME_BYTES // 8)]
    taken += [layout.S_EVICTED + i for i in range(len(layout.EVICT_REASONS))]
    assert len(set(taken)) == len(taken)
    assert max(taken) < layout.SHARD_BLOCK_WORDS


def test_the_shard_block_keeps_a_smoothed_index_lag_of_stamped_batches():
    index = InProcessShards(1)
    try:
        writer = index.writers[0]
        worker = (3, 0)
        writer.apply_batch(worker, [raw_event(_chain_event(3, [1], 100))])  # no stamp: no lag yet
        assert index.control.stats(0)["lag_us"] == 0
        writer.apply_batch(worker, [raw_event(_chain_event(3, [2], 101))], time.time() - 0.8)
        first = index.control.stats(0)["lag_us"]
        assert 800_000 <= first < 10_000_000  # the first stamped batch sets it
        for n in range(40):  # prompt batches pull it down an eighth of the way each
            writer.apply_batch(worker, [raw_event(_chain_event(3, [10 + n], 200 + n))], time.time())
        assert 0 < index.control.stats(0)["lag_us"] < first / 50
    finally:
        index.close()


def test_a_reader_follows_the_shard_across_growth():
    index = InProcessShards(1)
    try:
        index.apply_event(1, _chain_event(1, [1, 2], 10))
        assert index.find_matches([1, 2]) == {(1, 0): 2}
        for doc in range(30):
            index.apply_event(2, _chain_event(2, [doc * 1000 + i for i in range(100)], 100_000 + doc * 1000))
        assert index.find_matches([1, 2]) == {(1, 0): 2}
        assert index.find_matches([29_000, 29_001]) == {(2, 0): 2}
    finally:
        index.close()
