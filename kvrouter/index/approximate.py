"""``ApproxIndex``: the router's own guess at each worker's cache, for engines that send no KV events.

Dynamo's approximate mode (``use_kv_events=False``, ``spec/dynamo-semantics.md`` §3.2): a routing
decision is taken as a store of the request's full blocks on the chosen (worker, dp_rank), and each
block is forgotten ``ttl`` seconds after the last decision that put it there. The blocks live in a
plain :class:`RadixIndex` fed synthetic Stored and Removed events, so matching is exactly the index
contract's and nothing here walks a tree.

Expiry is lazy: every public call first removes what has expired by the clock's current reading,
where Dynamo runs a background "prune pump". No thread and no lock, and an injected clock makes every
test deterministic; the cost is that expired blocks hold memory until the next call, and that call
pays for the whole burst of removals.

Timers: a dict per worker, sequence hash → :class:`_Timer`, is the truth; a heap of the same timers
orders them for expiry and for size pruning. A refresh pushes a new timer and leaves the old one in
the heap rather than searching for it (O(log n) instead of O(n)); a popped timer that no longer
equals its dict entry is stale and skipped, and the heap is rebuilt from the dicts when stale items
outnumber live ones by ``STALE_HEAP_FACTOR``, so memory stays proportional to the live entries.

A block's expiry is never earlier than that of any deeper block of the same worker (every request
that refreshes a block also refreshes its prefix), and on equal expiry deeper blocks go first, so
neither expiry nor pruning leaves a worker holding a block without its prefix.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple

from ..events.model import (
    EngineHash,
    KvEvent,
    LocalHash,
    Removed,
    SeqHash,
    StorageTier,
    Stored,
    StoredBlock,
    WorkerKey,
)
from ..hashing import sequence_hashes
from .reference import RadixIndex

__all__ = ["ApproxIndex"]

log = logging.getLogger(__name__)

DEFAULT_TTL_SECS: Final = 120.0
"""Dynamo's ``router_ttl_secs`` default (``spec/dynamo-semantics.md`` §3.2)."""
DEFAULT_MAX_BLOCKS: Final = 2**20
"""Dynamo's ``PruneConfig.max_tree_size``, 1,048,576 (worker, block) entries (§3.2)."""
DEFAULT_PRUNE_RATIO: Final = 0.8
"""Dynamo's ``prune_target_ratio``: past ``max_blocks``, prune down to this share of it (§3.2)."""
STALE_HEAP_FACTOR: Final = 2
"""Rebuild the heap once stale items exceed this many times the live ones. Dynamo waits for 50 times;
2 keeps the heap under about three times the live entries, and since a rebuild (O(live)) follows
at least 2·live refreshes, each refresh still costs O(1) amortised. Pinned by
``tests/index/test_approximate.py::test_refreshing_keeps_the_heap_bounded``."""


class _Timer(NamedTuple):
    """When one (worker, block) entry expires. Tuples compare in Dynamo's pop order (``approx.rs``, a
    max-heap of ``(Reverse(expiry), BlockEntry{seq_position, key, worker})``): earliest expiry first,
    then the deepest block, then the largest sequence hash, then the largest (worker_id, dp_rank);
    hence the negated fields in a min-heap."""

    expiry: float
    neg_position: int
    neg_seq_hash: int
    neg_worker_id: int
    neg_dp_rank: int

    @property
    def worker(self) -> WorkerKey:
        return (-self.neg_worker_id, -self.neg_dp_rank)

    @property
    def seq_hash(self) -> SeqHash:
        return SeqHash(-self.neg_seq_hash)


class ApproxIndex:
    """Which worker probably holds which blocks, from the router's own routing decisions.

    Answers the same queries as :class:`RadixIndex`; everything is device tier. Each call first
    removes the blocks whose TTL has passed (an entry expiring at ``t`` is gone for a call at ``t``).

    Args:
        ttl: seconds a routed block is kept after the last decision that routed it.
        max_blocks: live (worker, block) entries allowed before size pruning starts.
        prune_ratio: pruning stops at ``floor(max_blocks * prune_ratio)`` entries.
        clock: seconds, never going backwards; ``time.monotonic`` unless a test injects one.

    Raises:
        ValueError: ``ttl`` not > 0, ``max_blocks`` < 1, or ``prune_ratio`` outside (0, 1].
    """

    def __init__(
        self,
        *,
        ttl: float = DEFAULT_TTL_SECS,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        prune_ratio: float = DEFAULT_PRUNE_RATIO,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl > 0:  # `not >` also rejects NaN
            raise ValueError(f"ttl must be > 0 seconds, got {ttl!r}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks!r}")
        if not 0 < prune_ratio <= 1:
            raise ValueError(f"prune_ratio must be in (0, 1], got {prune_ratio!r}")
        self._ttl = ttl
        self._max_blocks = max_blocks
        self._prune_target = math.floor(max_blocks * prune_ratio)
        """Entries left after a prune; truncated as Dynamo's ``(max as f64 * ratio) as usize``."""
        self._clock = clock
        self._index = RadixIndex()
        self._timers: dict[WorkerKey, dict[SeqHash, _Timer]] = {}
        self._size = 0
        """Live entries: the total length of the ``_timers`` dicts."""
        self._heap: list[_Timer] = []

    # -- routing decisions --------------------------------------------------------------------

    def record_routing(self, worker: WorkerKey, local_hashes: Sequence[int]) -> None:
        """Take a request routed to ``worker`` as cached there: store its blocks, (re)start their TTL.

        Args:
            worker: the chosen (worker_id, dp_rank).
            local_hashes: the request's full blocks' local hashes, in order.

        Raises:
            InvalidHashInput: a hash outside u64 or not an integer.
        """
        now = self._clock()
        self._expire(now)
        seq_hashes = sequence_hashes(local_hashes)
        worker_id, dp_rank = worker
        blocks = tuple(StoredBlock(EngineHash(s), LocalHash(h)) for s, h in zip(seq_hashes, local_hashes, strict=True))
        self._index.apply_event(worker_id, Stored(worker_id, None, blocks, dp_rank=dp_rank))
        expiry = now + self._ttl
        timers = self._timers.setdefault(worker, {})
        heap = self._heap
        for position, seq_hash in enumerate(seq_hashes):  # hot path: one dict probe and push per block
            timer = _Timer(expiry, -position, -seq_hash, -worker_id, -dp_rank)
            previous = timers.get(SeqHash(seq_hash))
            if previous == timer:  # routed again at the same instant: its heap item is still current
                continue
            if previous is None:
                self._size += 1
            timers[SeqHash(seq_hash)] = timer
            heapq.heappush(heap, timer)
        if self._size > self._max_blocks:
            self._prune()
        self._compact()

    def _expire(self, now: float) -> None:
        """Remove every entry whose expiry is at or before ``now``."""
        removed: dict[WorkerKey, list[EngineHash]] = {}
        heap = self._heap
        while heap and heap[0].expiry <= now:
            self._drop(heapq.heappop(heap), removed)
        self._release(removed)
        self._compact()

    def _prune(self) -> None:
        """Remove entries in pop order until ``_prune_target`` are left (spec §3.2)."""
        before = self._size
        removed: dict[WorkerKey, list[EngineHash]] = {}
        while self._size > self._prune_target:  # every live entry has a heap item, so the heap is not empty
            self._drop(heapq.heappop(self._heap), removed)
        self._release(removed)
        log.info("approximate index pruned before=%d after=%d max=%d", before, self._size, self._max_blocks)

    def _drop(self, timer: _Timer, removed: dict[WorkerKey, list[EngineHash]]) -> None:
        """Forget ``timer``'s entry and note its block for removal, unless the timer is stale."""
        worker, seq_hash = timer.worker, timer.seq_hash
        timers = self._timers.get(worker)
        if timers is None or timers.get(seq_hash) != timer:
            return
        del timers[seq_hash]
        if not timers:
            del self._timers[worker]
        self._size -= 1
        removed.setdefault(worker, []).append(EngineHash(seq_hash))

    def _release(self, removed: dict[WorkerKey, list[EngineHash]]) -> None:
        """Apply the dropped entries to the inner index: one synthetic Removed per worker."""
        for (worker_id, dp_rank), hashes in removed.items():
            self._index.apply_event(worker_id, Removed(worker_id, tuple(hashes), dp_rank=dp_rank))

    def _compact(self) -> None:
        """Rebuild the heap from the live timers once stale items pass ``STALE_HEAP_FACTOR`` times the live ones."""
        if len(self._heap) - self._size > STALE_HEAP_FACTOR * self._size:
            self._heap = [timer for timers in self._timers.values() for timer in timers.values()]
            heapq.heapify(self._heap)

    # -- workers ------------------------------------------------------------------------------

    def remove_worker(self, worker_id: int) -> None:
        """Forget every dp rank of ``worker_id``: its blocks, their TTLs and the worker itself."""
        self.clear_all_blocks(worker_id)
        self._index.remove_worker(worker_id)

    def clear_all_blocks(self, worker_id: int) -> None:
        """Drop every block and TTL of every dp rank of ``worker_id``; the worker stays known."""
        self._expire(self._clock())
        for worker in [worker for worker in self._timers if worker[0] == worker_id]:
            self._size -= len(self._timers.pop(worker))
        self._index.clear_all_blocks(worker_id)
        self._compact()

    # -- queries ------------------------------------------------------------------------------

    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> dict[WorkerKey, int]:
        """Per worker, the leading query blocks routed to it and not yet expired (see ``RadixIndex``)."""
        self._expire(self._clock())
        return self._index.find_matches(local_hashes, early_exit)

    def find_matches_by_tier(self, local_hashes: Sequence[int]) -> dict[StorageTier, dict[WorkerKey, int]]:
        """``RadixIndex.find_matches_by_tier``; every block is device tier, so all tiers agree."""
        self._expire(self._clock())
        return self._index.find_matches_by_tier(local_hashes)

    def block_counts(self, tier: StorageTier | None = None) -> dict[WorkerKey, int]:
        """Unexpired blocks per known worker (``RadixIndex.block_counts``)."""
        self._expire(self._clock())
        return self._index.block_counts(tier)

    def workers(self) -> set[WorkerKey]:
        """Every (worker, dp_rank) routed to and not removed, holding blocks or not."""
        self._expire(self._clock())
        return self._index.workers()

    def dump(self) -> list[KvEvent]:
        """Events that rebuild the unexpired blocks in an empty ``RadixIndex``; the TTLs are not dumped."""
        self._expire(self._clock())
        return self._index.dump()
