"""The index cap in ``ShardWriter`` and ``kernels.evict``: in-process, against a mirrored oracle.

The oracle (``RadixIndex``) gets every event the capped shard gets; after each batch, whatever the shard
no longer holds is removed from the oracle too, and counted. So every step checks that the cap only ever
takes entries away (never changes what an event does otherwise), that what it took is what it counted,
that the reader answers as the mirrored oracle does, and that the bound holds at every batch's end.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvrouter.engine import read_shards, read_workers
from kvrouter.events.model import (
    Cleared,
    EngineHash,
    KvEvent,
    LocalHash,
    Removed,
    StorageTier,
    Stored,
    StoredBlock,
    WorkerKey,
)
from kvrouter.hashing import sequence_hashes
from kvrouter.index import RadixIndex
from kvrouter.index.layout import (
    H_CAPACITY,
    H_NWORDS,
    H_TIERS,
    HEADER_WORDS,
    SLOT_MASKS,
    W_SEEN,
    W_STALE,
    W_STATE,
    WORKER_EXACT,
    ZERO_KEY,
    row_words,
    seen_word,
)
from tests.index.contract import error_kind
from tests.index.shm import InProcessShards

Holdings = dict[tuple[WorkerKey, StorageTier], set[int]]

CONTENT = st.integers(1, 4)
ENGINE_HASHES = st.integers(1, 30).map(EngineHash)
WORKERS = [(1, 0), (2, 0), (3, 0), (3, 1)]
TIER_CHOICES = [StorageTier.DEVICE, StorageTier.HOST]


def seq_of(path: tuple[int, ...]) -> int:
    return sequence_hashes(list(path))[-1] or ZERO_KEY


def table_holdings(index: InProcessShards) -> Holdings:
    """What the shard tables hold, read straight from their slots: (worker, tier) -> sequence hashes."""
    held: Holdings = {}
    for shard, writer in enumerate(index.writers):
        table = writer.table
        capacity, nwords, tiers = int(table[H_CAPACITY]), int(table[H_NWORDS]), int(table[H_TIERS])
        width = row_words(nwords, tiers)
        slots = table[HEADER_WORDS : HEADER_WORDS + capacity * width].reshape(capacity, width)
        bits = {bit: (wid, rank) for bit, (wid, rank, _) in index.control.workers(shard).items()}
        for slot in np.flatnonzero(slots[:, 0]).tolist():
            for tier in range(tiers):
                for word in range(nwords):
                    mask = int(slots[slot, SLOT_MASKS + tier * nwords + word])
                    for b in range(64):
                        if mask >> b & 1:
                            held.setdefault((bits[word * 64 + b], list(StorageTier)[tier]), set()).add(
                                int(slots[slot, 0])
                            )
    return held


class CappedAgreesWithMirror(RuleBasedStateMachine):
    """Batches of stores, removes and clears over four workers (some ``exact``, some not) into a shard with
    a small budget."""

    def __init__(self) -> None:
        super().__init__()
        self.oracle = RadixIndex()
        self.index: InProcessShards | None = None
        self.budget = 0
        self.exact: set[WorkerKey] = set()
        self.queries: set[tuple[int, ...]] = set()

    @initialize(budget=st.integers(1, 24), exact=st.sets(st.sampled_from(WORKERS)))
    def start(self, budget: int, exact: set[WorkerKey]) -> None:
        self.budget, self.exact = budget, exact
        self.index = InProcessShards(1, budget=budget)
        writer = self.index.writers[0]
        writer.keep_evicted = True
        for worker in WORKERS:
            writer.register(worker)
            row = writer.row(worker)
            assert row is not None
            row[W_STATE] = WORKER_EXACT if worker in exact else 0

    def teardown(self) -> None:
        if self.index is not None:
            self.index.close()

    def held(self, worker: WorkerKey, tier: StorageTier) -> list[EngineHash]:
        return sorted(self.oracle.holdings().get((worker, tier), {}))

    def oracle_entries(self) -> int:
        return sum(len({seq_of(path) for path in lookup.values()}) for lookup in self.oracle.holdings().values())

    def counters(self) -> tuple[int, int, int]:
        assert self.index is not None
        (shard,) = read_shards(self.index.control)
        return shard.evicted["untrusted"], shard.evicted["lru"], shard.after_eviction

    @rule(worker=st.sampled_from(WORKERS), data=st.data())
    def batch(self, worker: WorkerKey, data: st.DataObject) -> None:
        assert self.index is not None
        events: list[KvEvent] = []
        for _ in range(data.draw(st.integers(1, 4), label="events")):
            tier = data.draw(st.sampled_from(TIER_CHOICES), label="tier")
            held = self.held(worker, tier) + [b.engine_hash for e in events if isinstance(e, Stored) for b in e.blocks]
            known = st.sampled_from(held) if held else ENGINE_HASHES
            match data.draw(st.sampled_from("SSSSRRC"), label="tag"):
                case "S":
                    parent = data.draw(st.none() | known | ENGINE_HASHES, label="parent")
                    blocks = data.draw(st.lists(st.tuples(ENGINE_HASHES, CONTENT), max_size=6), label="blocks")
                    stored = tuple(StoredBlock(EngineHash(e), LocalHash(h)) for e, h in blocks)
                    events.append(Stored(worker[0], parent, stored, dp_rank=worker[1], tier=tier))
                case "R":
                    hashes = data.draw(st.lists(known | ENGINE_HASHES, max_size=4), label="removed")
                    events.append(Removed(worker[0], tuple(hashes), dp_rank=worker[1], tier=tier))
                case _:
                    events.append(Cleared(worker[0], dp_rank=worker[1], tier=tier))
        untrusted_before, lru_before, after_before = self.counters()
        expected = [kind for event in events if (kind := error_kind(self.oracle, worker[0], event))]
        got = self.index.apply_batch(worker, events)
        untrusted, lru, after = self.counters()
        # errors the cap caused are counted apart, never as errors; the rest are the oracle's
        assert len(expected) - len(got) == after - after_before
        assert all(kind in expected for kind in got)
        # mirror: the engine hashes the shard dropped, the oracle drops too; the entries (distinct sequences
        # per worker and tier) that took away must be exactly what was counted
        kept = self.index.writers[0].engine_hashes()
        listed: dict[tuple[WorkerKey, int], set[int]] = {}  # what the recording would carry (evict records)
        for key, rank, evicted in self.index.writers[0].take_evicted():
            listed.setdefault((key, rank), set()).update(evicted.tolist())
        before = self.oracle_entries()
        dropped: dict[tuple[WorkerKey, int], set[int]] = {}
        for (key, tier), lookup in self.oracle.holdings().items():
            gone = [engine for engine in lookup if engine not in kept.get((key, tier.rank), set())]
            if gone:
                dropped[key, tier.rank] = set(gone)
                self.oracle.apply_event(key[0], Removed(key[0], tuple(gone), dp_rank=key[1], tier=tier))
        assert listed == dropped  # each eviction listed once, as the Removed that mirrors it
        assert before - self.oracle_entries() == (untrusted - untrusted_before) + (lru - lru_before)
        table = table_holdings(self.index)
        if lru > lru_before:  # the least recently stored of exact workers go only once no other is left
            assert not any(key not in self.exact for (key, _), seqs in table.items() if seqs)

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        """The front reports a prefix its decision matched: it only reorders what the cap evicts next."""
        assert self.index is not None
        paths = sorted({p for held in self.oracle.holdings().values() for p in held.values()})
        path = data.draw(st.sampled_from(paths), label="path") if paths else (1,)
        seqs = np.array(sequence_hashes(list(path)), dtype=np.uint64)
        (shard,) = read_shards(self.index.control)
        found = self.index.writers[0].touch(seqs)
        assert found <= len(seqs)
        assert read_shards(self.index.control)[0].touched == shard.touched + found

    @rule(query=st.lists(CONTENT, min_size=1, max_size=7))
    def remember_query(self, query: list[int]) -> None:
        self.queries.add(tuple(query))

    @invariant()
    def the_bound_holds_and_the_counts_agree(self) -> None:
        if self.index is None:
            return
        held = table_holdings(self.index)
        entries = sum(len(seqs) for seqs in held.values())
        (shard,) = read_shards(self.index.control)
        assert entries == shard.entries <= self.budget == shard.budget
        rows = read_workers(self.index.control)
        assert entries == sum(sum(stats.cached_by_tier.values()) for stats in rows.values())
        assert sum(sum(stats.evicted.values()) for stats in rows.values()) == sum(shard.evicted.values())
        expected = {key: {seq_of(p) for p in lookup.values()} for key, lookup in self.oracle.holdings().items()}
        assert {key: seqs for key, seqs in held.items() if seqs} == expected

    @invariant()
    def the_reader_answers_as_the_mirror(self) -> None:
        if self.index is None:
            return
        paths = {p for held in self.oracle.holdings().values() for p in held.values()}
        for query in paths | self.queries:
            assert self.index.find_matches_by_tier(query) == self.oracle.find_matches_by_tier(query), query


CappedAgreesWithMirror.TestCase.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCappedAgreesWithMirror = CappedAgreesWithMirror.TestCase


@pytest.fixture
def capped() -> Iterator[InProcessShards]:
    index = InProcessShards(1, budget=64)
    try:
        yield index
    finally:
        index.close()


def _link(worker: int, parent: int | None, engine: int, local: int, tier: StorageTier = StorageTier.DEVICE) -> Stored:
    block = (StoredBlock(EngineHash(engine), LocalHash(local)),)
    return Stored(worker, None if parent is None else EngineHash(parent), block, tier=tier)


def test_a_chain_stored_block_by_block_is_cut_from_its_tip(capped: InProcessShards):
    """One block per event, as SGLang publishes: each block is stored after its parent, yet the cap takes a
    chain's tip first (the oldest leaf), so what remains of it is a matchable prefix."""
    for i in range(60):
        capped.apply_event(1, _link(1, i - 1 if i else None, i, 1000 + i))
    blocks = tuple(StoredBlock(EngineHash(100 + i), LocalHash(2000 + i)) for i in range(30))
    capped.apply_event(1, Stored(1, None, blocks))  # 90 entries: brought down to 63
    (shard,) = read_shards(capped.control)
    assert shard.entries == 63
    assert capped.find_matches([1000 + i for i in range(60)]) == {(1, 0): 33}
    assert capped.find_matches([2000 + i for i in range(30)]) == {(1, 0): 30}
    assert read_workers(capped.control)[1, 0].evicted == {"untrusted": 27, "lru": 0}
    capped.apply_event(1, _link(1, 59, 60, 1060))  # under an evicted block: refused, counted apart
    assert read_shards(capped.control)[0].after_eviction == 1


def test_the_least_recently_stored_chain_goes_first(capped: InProcessShards):
    capped.writers[0].register((1, 0))
    row = capped.writers[0].row((1, 0))
    assert row is not None
    row[W_STATE] = WORKER_EXACT
    for doc in range(3):  # three 30-block chains, the first one touched again by a store under its tip
        blocks = tuple(StoredBlock(EngineHash(doc * 100 + i), LocalHash(doc * 100 + i)) for i in range(30))
        capped.apply_event(1, Stored(1, None, blocks))
        if doc == 1:
            capped.apply_event(1, _link(1, 29, 99, 99))
    answers = [capped.find_matches([doc * 100 + i for i in range(30)]).get((1, 0), 0) for doc in range(3)]
    assert answers[0] == 30
    assert answers[2] == 30
    assert answers[1] < 30
    assert read_workers(capped.control)[1, 0].evicted["untrusted"] == 0


@pytest.mark.parametrize("untrusted_by", ["state", "stale", "seen"])
def test_untrusted_workers_go_first(capped: InProcessShards, untrusted_by: str):
    """Worker 2 is not ``exact`` as the plane knows it: a state other than exact (partial, from a lost gap),
    the stale flag (silent past ``stale_after``), or a contradiction of its registration seen (a foreign
    block size, format or rank)."""
    writer = capped.writers[0]
    for worker in ((1, 0), (2, 0)):
        writer.register(worker)
        row = writer.row(worker)
        assert row is not None
        row[W_STATE] = WORKER_EXACT
    two = writer.row((2, 0))
    assert two is not None
    if untrusted_by == "state":
        two[W_STATE] = 0
    elif untrusted_by == "stale":
        two[W_STALE] = 1
    else:
        two[W_SEEN] = seen_word(0, block_size=32)
    for wid in (1, 2):
        blocks = tuple(StoredBlock(EngineHash(i), LocalHash(i)) for i in range(40))
        capped.apply_event(wid, Stored(wid, None, blocks))
    capped.apply_event(1, _link(1, 39, 40, 40))  # the exact worker's blocks are the older ones, but trusted
    query = list(range(41))
    assert capped.find_matches(query)[1, 0] == 41
    rows = read_workers(capped.control)
    assert rows[2, 0].evicted["untrusted"] > 0
    assert rows[1, 0].evicted == {"untrusted": 0, "lru": 0}


def test_events_about_evicted_blocks_are_not_errors(capped: InProcessShards):
    """The engine still holds what the cap evicted: its later Removed, or a Stored under it, is the cap's
    doing. The store is refused whole, as for a parent never stored, and counted apart."""
    blocks = tuple(StoredBlock(EngineHash(i), LocalHash(i)) for i in range(80))
    capped.apply_event(1, Stored(1, None, blocks))
    assert capped.find_matches(list(range(80)))[1, 0] < 80
    batch: list[KvEvent] = [
        Removed(1, (EngineHash(79),)),
        Stored(1, EngineHash(78), (StoredBlock(EngineHash(500), LocalHash(5)),)),
    ]
    assert capped.apply_batch((1, 0), batch) == []
    (shard,) = read_shards(capped.control)
    assert shard.after_eviction == 2
    assert shard.errors["block_not_found"] == shard.errors["parent_not_found"] == 0
    assert capped.find_matches([*range(79), 5])[1, 0] == shard.entries


def test_a_matched_chain_outlives_a_newer_one_across_growth():
    """A (stored first) and B (stored later) of 100 blocks each; a decision matches A; then 850 blocks of
    other chains grow the table past its first size and the shard past its budget of 1,000: the 65 entries
    evicted are B's tip, not A's, which was matched after B was stored (its stamps moved with the growth)."""
    index = InProcessShards(1, budget=1000)
    try:
        writer = index.writers[0]
        first_segment = writer.segment_name
        for base in (0, 1000):
            blocks = tuple(StoredBlock(EngineHash(base + i), LocalHash(base + i)) for i in range(100))
            index.apply_event(1, Stored(1, None, blocks))
        chain_a = list(range(100))
        assert writer.touch(np.array(sequence_hashes(chain_a), dtype=np.uint64)) == 100
        for doc in range(17):
            base = 10_000 + doc * 100
            blocks = tuple(StoredBlock(EngineHash(base + i), LocalHash(base + i)) for i in range(50))
            index.apply_event(1, Stored(1, None, blocks))
        assert writer.segment_name != first_segment  # grown: the match stamps were carried over
        (shard,) = read_shards(index.control)
        assert shard.entries == 1000 - 1000 // 64
        assert index.find_matches(chain_a) == {(1, 0): 100}
        assert index.find_matches(list(range(1000, 1100))) == {(1, 0): 100 - 65}
        assert shard.touched == 100
    finally:
        index.close()


def test_a_block_named_twice_in_one_match_message_is_counted_once():
    """The front sends a worker's matched chains as they are: prompts under one system prompt name its
    blocks again and again. Each message stamps a block once and counts it once; the next message counts
    it again (it was matched again)."""
    index = InProcessShards(1, budget=1000)
    try:
        writer = index.writers[0]
        blocks = tuple(StoredBlock(EngineHash(i), LocalHash(i)) for i in range(10))
        index.apply_event(1, Stored(1, None, blocks))
        system = sequence_hashes(list(range(6)))
        chains = np.array([*system, *sequence_hashes(list(range(10))), *system, 12345], dtype=np.uint64)
        assert writer.touch(chains) == 10  # 23 hashes: 10 distinct blocks held, one never stored
        assert writer.touch(np.array(system, dtype=np.uint64)) == 6
        assert read_shards(index.control)[0].touched == 16
    finally:
        index.close()


def test_matches_change_nothing_without_a_cap():
    index = InProcessShards(1)
    try:
        index.apply_event(1, Stored(1, None, (StoredBlock(EngineHash(1), LocalHash(1)),)))
        assert index.writers[0].touch(np.array(sequence_hashes([1]), dtype=np.uint64)) == 0
        assert read_shards(index.control)[0].touched == 0
    finally:
        index.close()
