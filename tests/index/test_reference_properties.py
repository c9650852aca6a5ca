"""Property tests of ``RadixIndex``.

1. Against the engines and the reference runtime: engines that evict leaf-first and hash content
   consistently (every worker names a path by the same engine hash), as vLLM and SGLang do. Every
   ``find_matches`` must equal what the engines hold (their prefix-closed caches, tracked here), and
   must equal ``dynamo._core.RadixTree``'s answer for as long as the reference keeps track. It does not
   always: after a leaf-first eviction of a branch whose prefix another worker shares, the compressed
   tree can drop the other worker's blocks from matches or reject its next store (case 1 of
   DESIGN.md's "Index contract"). From the first such divergence on, the reference may only ever
   report less than the engines hold, never more; anything else fails the test.
2. The contract's own invariants on arbitrary sequences (interior evictions, re-stores, moved hashes,
   unknown parents, dp ranks, tiers, clears): a dump re-applied to a fresh index answers identically,
   and removing everything a worker stored leaves no trace of it.
"""

from __future__ import annotations

import itertools

from dynamo._core import RadixTree
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvrouter.events.codecs import dynamo
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
from kvrouter.index import RadixIndex
from tests.index.contract import error_kind

Path = tuple[int, ...]

CONTENT = st.integers(1, 4)
"""Few distinct local hashes, so paths branch and collide often."""
WORKERS = st.integers(1, 4)
RANKS = st.integers(0, 1)


class AgreesWithReference(RuleBasedStateMachine):
    """Engines with prefix-closed caches, leaf-first eviction and one engine hash per path."""

    reference_lost_track: bool
    """Set at the reference's first wrong answer or rejected store; from then on it is checked one-sided."""

    def __init__(self) -> None:
        super().__init__()
        self.ours = RadixIndex()
        self.theirs = RadixTree()
        self.encoder = dynamo.Encoder()
        self.held: dict[WorkerKey, set[Path]] = {}
        self.seen: set[Path] = set()
        self.event_ids = itertools.count()
        self.engine_ids: dict[Path, EngineHash] = {}
        self.reference_lost_track = False

    def engine_hash(self, path: Path) -> EngineHash:
        """Consistent hashing: the same content at the same position gets one id on every worker."""
        return self.engine_ids.setdefault(path, EngineHash(len(self.engine_ids) + 1))

    def apply(self, event: KvEvent) -> None:
        self.ours.apply_event(event.worker_id, event)  # every generated event is valid: ours must take it
        try:
            self.theirs.apply_event(event.worker_id, self.encoder.encode_event(event))
        except RuntimeError as exc:
            rejection = str(exc)
        else:
            return
        assert "Failed to find parent block" in rejection, rejection
        self.lose_track("reference rejected a valid store under a block it dropped")

    @rule(worker=WORKERS, rank=RANKS, data=st.data(), extension=st.lists(CONTENT, min_size=1, max_size=5))
    def store(self, worker: int, rank: int, data: st.DataObject, extension: list[int]) -> None:
        key = (worker, rank)
        held = self.held.setdefault(key, set())
        base: Path = data.draw(st.sampled_from([(), *sorted(held)]), label="base")
        paths = [base + tuple(extension[: i + 1]) for i in range(len(extension))]
        parent = None if not base else self.engine_hash(base)
        blocks = tuple(StoredBlock(self.engine_hash(p), LocalHash(p[-1])) for p in paths)
        self.apply(Stored(worker, parent, blocks, dp_rank=rank, event_id=next(self.event_ids)))
        held.update(paths)
        self.seen.update(paths)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), count=st.integers(1, 4))
    def evict_leaves(self, data: st.DataObject, count: int) -> None:
        """Evict up to ``count`` blocks, each a leaf of what the worker holds when it goes."""
        key = data.draw(st.sampled_from(sorted(k for k, v in self.held.items() if v)), label="worker")
        held = self.held[key]
        evicted: list[EngineHash] = []
        for _ in range(count):
            leaves = sorted(p for p in held if not any(q[:-1] == p for q in held))
            if not leaves:
                break
            leaf = data.draw(st.sampled_from(leaves), label="leaf")
            held.discard(leaf)
            evicted.append(self.engine_hash(leaf))
        self.apply(Removed(key[0], tuple(evicted), dp_rank=key[1], event_id=next(self.event_ids)))

    @rule(worker=WORKERS, rank=RANKS)
    def clear(self, worker: int, rank: int) -> None:
        self.apply(Cleared(worker, dp_rank=rank, event_id=next(self.event_ids)))
        self.held.pop((worker, rank), None)

    @rule(worker=WORKERS)
    def clear_all_blocks(self, worker: int) -> None:
        self.ours.clear_all_blocks(worker)
        self.theirs.clear_all_blocks(worker)
        for key in [k for k in self.held if k[0] == worker]:
            self.held[key] = set()

    @rule(worker=WORKERS)
    def remove_worker(self, worker: int) -> None:
        self.ours.remove_worker(worker)
        self.theirs.remove_worker(worker)
        for key in [k for k in self.held if k[0] == worker]:
            del self.held[key]

    @rule(data=st.data(), tail=st.lists(CONTENT, max_size=3), early_exit=st.booleans())
    def query(self, data: st.DataObject, tail: list[int], early_exit: bool) -> None:
        base: Path = data.draw(st.sampled_from([(), *sorted(self.seen)]), label="query base")
        self.check(list(base) + tail, early_exit)

    @invariant()
    def every_known_path_matches(self) -> None:
        for path in self.seen:
            self.check(list(path), early_exit=False)

    def lose_track(self, why: str) -> None:
        if not self.reference_lost_track:
            event(f"reference lost track (index contract case 1): {why}")
        self.reference_lost_track = True

    def check(self, query: list[int], early_exit: bool) -> None:
        ours = self.ours.find_matches(query, early_exit=early_exit)
        theirs: dict[WorkerKey, int] = self.theirs.find_matches(query, early_exit=early_exit).scores  # type: ignore[assignment]  # the stub says dict[int, int]; keys are pairs
        if theirs != ours:
            assert all(0 < theirs[key] <= ours.get(key, 0) for key in theirs), (query, ours, theirs)
            self.lose_track("reference under-reported a worker's blocks")
        # A prefix-closed cache holds the query up to its longest held prefix.
        depth = {
            key: max((k for k in range(1, len(query) + 1) if tuple(query[:k]) in held), default=0)
            for key, held in self.held.items()
        }
        assert ours == {key: d for key, d in depth.items() if d}, (query, ours, depth)


AgreesWithReference.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestAgreesWithReference = AgreesWithReference.TestCase


ANY_HASH = st.integers(1, 24).map(EngineHash)
"""A small pool, so engine hashes get re-used at other paths (moves) and across workers."""
TIERS = st.sampled_from(list(StorageTier))
TRACED = 1
"""The worker whose every event is withheld from ``without`` in ``ContractInvariants``."""


class ContractInvariants(RuleBasedStateMachine):
    """Arbitrary event streams; ``full`` sees every event, ``without`` all but worker ``TRACED``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.full = RadixIndex()
        self.without = RadixIndex()
        self.event_ids = itertools.count()

    def apply(self, event: KvEvent) -> None:
        kind = error_kind(self.full, event.worker_id, event)
        if event.worker_id != TRACED:
            # Workers never see each other's events: the same event fares the same without TRACED.
            assert error_kind(self.without, event.worker_id, event) == kind, event

    def held_hashes(self, worker: int, rank: int, tier: StorageTier) -> list[EngineHash]:
        return sorted(self.full.holdings().get(((worker, rank), tier), {}))

    @rule(
        worker=WORKERS,
        rank=RANKS,
        tier=TIERS,
        data=st.data(),
        blocks=st.lists(st.tuples(ANY_HASH, CONTENT), min_size=0, max_size=4),
    )
    def store(self, worker: int, rank: int, tier: StorageTier, data: st.DataObject, blocks: list[tuple[int, int]]):
        held = self.held_hashes(worker, rank, tier)
        parent = data.draw(st.none() | st.sampled_from(held) if held else st.none() | ANY_HASH, label="parent")
        stored = tuple(StoredBlock(EngineHash(e), LocalHash(h)) for e, h in blocks)
        self.apply(Stored(worker, parent, stored, dp_rank=rank, event_id=next(self.event_ids), tier=tier))

    @rule(worker=WORKERS, rank=RANKS, tier=TIERS, data=st.data(), unknown=st.lists(ANY_HASH, max_size=2))
    def remove(self, worker: int, rank: int, tier: StorageTier, data: st.DataObject, unknown: list[EngineHash]):
        held = self.held_hashes(worker, rank, tier)
        chosen = data.draw(st.lists(st.sampled_from(held), max_size=3), label="held") if held else []
        hashes = tuple(chosen + unknown)
        self.apply(Removed(worker, hashes, dp_rank=rank, event_id=next(self.event_ids), tier=tier))

    @rule(worker=WORKERS, rank=RANKS, tier=TIERS)
    def clear(self, worker: int, rank: int, tier: StorageTier) -> None:
        self.apply(Cleared(worker, dp_rank=rank, event_id=next(self.event_ids), tier=tier))

    @rule(worker=WORKERS, everything=st.booleans())
    def drop_worker(self, worker: int, everything: bool) -> None:
        for index in (self.full, self.without) if worker != TRACED else (self.full,):
            if everything:
                index.remove_worker(worker)
            else:
                index.clear_all_blocks(worker)

    @invariant()
    def dump_rebuilds_the_same_index(self) -> None:
        rebuilt = RadixIndex()
        for dumped in self.full.dump():
            rebuilt.apply_event(dumped.worker_id, dumped)
        assert rebuilt.holdings() == self.full.holdings()
        for tier in StorageTier:
            assert _nonzero(rebuilt.block_counts(tier)) == _nonzero(self.full.block_counts(tier))
        for path in _all_paths(self.full):
            assert rebuilt.find_matches_by_tier(path) == self.full.find_matches_by_tier(path), path

    def teardown(self) -> None:
        """Release every block TRACED holds: nothing of it may remain, not even an empty trie node."""
        for ((worker, rank), tier), held in self.full.holdings().items():
            if worker == TRACED:
                self.full.apply_event(worker, Removed(worker, tuple(held), dp_rank=rank, tier=tier))
        assert self.full.holdings() == self.without.holdings()
        assert _nonzero(self.full.block_counts()) == _nonzero(self.without.block_counts())
        assert _trie_size(self.full) == _trie_size(self.without)
        for path in _all_paths(self.full) | _all_paths(self.without):
            assert self.full.find_matches_by_tier(path) == self.without.find_matches_by_tier(path)


def _nonzero(counts: dict[WorkerKey, int]) -> dict[WorkerKey, int]:
    return {key: n for key, n in counts.items() if n}


def _all_paths(index: RadixIndex) -> set[tuple[LocalHash, ...]]:
    """Every held path plus one step past it, as queries."""
    paths = {path for held in index.holdings().values() for path in held.values()}
    return paths | {(*path, LocalHash(99)) for path in paths}


def _trie_size(index: RadixIndex) -> int:
    """Nodes in the trie. Private on purpose: unheld nodes have no public view, and leaving none behind
    is exactly what this checks."""
    stack, count = [index._root], 0
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(node.children.values())
    return count


ContractInvariants.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestContractInvariants = ContractInvariants.TestCase
