"""``IndexReader.overlaps``: the dense answer equals the dict answer, through every change of rows and slots.

Streams of events over many workers (enough for the mask to widen), worker removals (rows freed and
reused: the rows generation moves) and a ``WorkerSlots`` numbering that grows or is replaced (its
``version`` moves) go into the in-process shards (1, 2 and 4 shards); after every step each remembered
query's ``overlaps`` must equal ``overlaps_from_tiers`` of ``find_matches_by_tier``, for every tier count,
and the dict answers must equal ``RadixIndex``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from numba import njit

from kvrouter.errors import ConfigError, InvalidHashInput
from kvrouter.events.model import EngineHash, LocalHash, StorageTier, Stored, StoredBlock, WorkerKey
from kvrouter.index import RadixIndex
from kvrouter.index._kernels import overlap_shards
from kvrouter.index.dense import WorkerSlots, overlaps_from_tiers
from tests.index.contract import error_kind
from tests.index.shm import InProcessShards

Hashes = npt.NDArray[np.uint64]

CONTENT = st.integers(1, 4)
WORKER_IDS = st.integers(1, 80)
"""Up to 80 workers (one dp rank) or 160 (two): one shard's mask widens past 64 bits."""
RANKS = st.integers(0, 1)
WORKERS = st.tuples(WORKER_IDS, RANKS)


class OverlapsAgree(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.oracle = RadixIndex()
        self.shards = [InProcessShards(n) for n in (1, 2, 4)]
        self.slots = WorkerSlots([(w, r) for w in (1, 2, 3) for r in (0, 1)])
        self.queries: set[tuple[int, ...]] = {(1,), (1, 2, 3)}
        self.long_chains = 0

    def teardown(self) -> None:
        for index in self.shards:
            index.close()

    @rule(
        worker=WORKERS,
        tier=st.sampled_from(list(StorageTier)),
        blocks=st.lists(st.tuples(st.integers(1, 40), CONTENT), min_size=1, max_size=6),
    )
    def store(self, worker: WorkerKey, tier: StorageTier, blocks: list[tuple[int, int]]) -> None:
        stored = tuple(StoredBlock(EngineHash(e), LocalHash(h)) for e, h in blocks)
        event = Stored(worker[0], None, stored, dp_rank=worker[1], tier=tier)
        expected = error_kind(self.oracle, event.worker_id, event)
        for index in self.shards:
            assert error_kind(index, event.worker_id, event) == expected

    @precondition(lambda self: self.long_chains < 4)
    @rule(worker=WORKERS)
    def store_long_chain(self, worker: WorkerKey) -> None:
        """200 new blocks: a few of these grow the tables (a new epoch the reader must remap)."""
        self.long_chains += 1
        first = 1000 * self.long_chains
        chain = tuple(StoredBlock(EngineHash(first + i), LocalHash(first + i)) for i in range(200))
        event = Stored(worker[0], None, chain, dp_rank=worker[1])
        indexes: list[RadixIndex | InProcessShards] = [self.oracle, *self.shards]
        for index in indexes:
            index.apply_event(event.worker_id, event)
        self.queries.add((first, first + 1, first + 2, 7))

    @rule(worker=WORKER_IDS, everything=st.booleans())
    def drop_worker(self, worker: int, everything: bool) -> None:
        indexes: list[RadixIndex | InProcessShards] = [self.oracle, *self.shards]
        for index in indexes:
            if everything:
                index.remove_worker(worker)  # rows freed: the next new worker reuses them
            else:
                index.clear_all_blocks(worker)

    @rule(workers=st.lists(WORKERS, max_size=30))
    def number(self, workers: list[WorkerKey]) -> None:
        """More workers get slots: ``version`` moves when one is new."""
        self.slots.slots(workers)

    @rule(workers=st.lists(WORKERS, max_size=60), data=st.data())
    def renumber(self, workers: list[WorkerKey], data: st.DataObject) -> None:
        """A fresh numbering in another order, of some of the workers only."""
        self.slots = WorkerSlots(data.draw(st.permutations(workers), label="order"))

    @rule(query=st.lists(CONTENT, min_size=1, max_size=7))
    def remember_query(self, query: list[int]) -> None:
        self.queries.add(tuple(query))

    @invariant()
    def same_answers(self) -> None:
        paths = {p for held in self.oracle.holdings().values() for p in held.values() if len(p) <= 8}
        for query in sorted(paths | self.queries):  # a long chain's own paths: by its remembered query
            expected = self.oracle.find_matches_by_tier(query)
            local = np.array(query, dtype=np.uint64)
            for index in self.shards:
                reader = index.reader
                for ntiers in range(1, len(StorageTier) + 1):  # first: a remap or new rows meet them first
                    wanted = overlaps_from_tiers(expected, self.slots, ntiers)
                    fused = np.full((ntiers, len(self.slots)), -1, dtype=np.int64)
                    reader.overlaps_and(_fill, local, self.slots, ntiers, fused)  # mends late shards too
                    assert np.array_equal(fused, wanted), (len(index.writers), query, ntiers)
                    dense = reader.overlaps(local, self.slots, ntiers)
                    assert dense.shape == (ntiers, len(self.slots))
                    assert np.array_equal(dense, wanted), (len(index.writers), query, ntiers)
                assert reader.find_matches_by_tier(query) == expected, (len(index.writers), query)
                assert reader.find_matches(query) == expected[StorageTier.DEVICE]
                assert reader.find_matches(list(query)) == expected[StorageTier.DEVICE]  # the array('L') path


def _fill_py(ctx: npt.NDArray[np.int64], local: Hashes, ntiers: int, out: npt.NDArray[np.int64]) -> tuple[int]:
    """The least consumer ``overlaps_and`` takes: the walk into ``out``, nothing after it."""
    out[:] = 0
    return (overlap_shards(ctx, local, ntiers, out),)


_fill = cast(Callable[..., tuple[int]], njit(_fill_py))


OverlapsAgree.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestOverlapsAgree = OverlapsAgree.TestCase


def test_find_matches_answers_are_fresh_dicts_from_list_and_array_alike():
    """The kernel-built dict: a new one per query (the caller may keep or change it), equal from a list, a
    tuple and an array, for a query longer than the reader's preallocated scratch too."""
    from kvrouter.index.reader import SCRATCH_BLOCKS

    index = InProcessShards(2)
    try:
        long = SCRATCH_BLOCKS + 100
        chain = tuple(StoredBlock(EngineHash(10 + h), LocalHash(h)) for h in range(1, long + 1))
        index.apply_event(5, Stored(5, None, chain))
        index.apply_event(6, Stored(6, None, chain[:2], dp_rank=1))
        reader = index.reader
        first = reader.find_matches([1, 2, 3])
        assert first == {(5, 0): 3, (6, 1): 2}
        first[(7, 0)] = 1
        second = reader.find_matches([1, 2, 3])
        assert second == {(5, 0): 3, (6, 1): 2}
        assert second is not first
        assert first == {(5, 0): 3, (6, 1): 2, (7, 0): 1}  # the caller's, untouched by the next query
        query = list(range(1, long + 1))
        for shape in (query, tuple(query), np.array(query, dtype=np.uint64)):
            assert reader.find_matches(shape) == {(5, 0): long, (6, 1): 2}  # type: ignore[arg-type]
        assert reader.find_matches([long + 1]) == {}
        assert reader.find_matches([]) == {}
    finally:
        index.close()


def test_overlaps_edges():
    index = InProcessShards(2)
    try:
        chain = tuple(StoredBlock(EngineHash(10 + h), LocalHash(h)) for h in (1, 2, 3))
        index.apply_event(5, Stored(5, None, chain))
        index.apply_event(6, Stored(6, None, chain[:1], dp_rank=1))
        slots = WorkerSlots([(6, 1), (99, 0), (5, 0)])
        reader = index.reader
        assert reader.overlaps(np.array([1, 2, 3, 4], dtype=np.uint64), slots, 1).tolist() == [[1, 0, 3]]
        assert reader.overlaps([1, 2], slots, 2).tolist() == [[1, 0, 2], [1, 0, 2]]  # type: ignore[arg-type]
        assert reader.overlaps(np.array([7], dtype=np.uint64), slots, 4).tolist() == [[0, 0, 0]] * 4
        assert reader.overlaps(np.empty(0, dtype=np.uint64), slots, 1).tolist() == [[0, 0, 0]]
        assert reader.overlaps(np.array([1], dtype=np.uint64), WorkerSlots(), 3).shape == (3, 0)
        slots.slot((5, 0))  # not new: the same version, the same map
        assert reader.overlaps(np.array([1, 2], dtype=np.uint64), slots, 1).tolist() == [[1, 0, 2]]
        index.remove_worker(5)
        assert reader.overlaps(np.array([1, 2], dtype=np.uint64), slots, 1).tolist() == [[1, 0, 0]]
        with pytest.raises(ConfigError, match="ntiers"):
            reader.overlaps(np.array([1], dtype=np.uint64), slots, 0)
        with pytest.raises(ConfigError, match="ntiers"):
            reader.overlaps(np.array([1], dtype=np.uint64), slots, 5)
        with pytest.raises(InvalidHashInput):
            reader.overlaps(np.array([[1]], dtype=np.uint64), slots, 1)
        with pytest.raises(InvalidHashInput):
            reader.find_matches([-1])
    finally:
        index.close()
