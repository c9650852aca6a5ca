"""``KvCache``: one worker's block pool, as Dynamo's mocker keeps it (``spec/routing-benchmark.md`` §2.1).

Two pools share a fixed number of slots. The *active* pool maps a block id to the number of running
sequences holding it; the *inactive* pool holds blocks nobody runs on any more, still cached and
reusable, in least-recently-released order. A new block takes a free slot if there is one, else evicts
the least recently released inactive block, else fails (the scheduler then preempts). That is the
mocker's ``KvManager`` with its ``LRUEvictor`` (an insertion-ordered queue; 1.6.1 replays report
``kv_eviction_policy: "lru"``), here an ``OrderedDict`` so eviction and revival are O(1).

Block ids: a full block is named by one int, used as both engine hash and local hash in the events it
causes (the trace's hash id for prompt blocks, a per-request id for generated ones, see
``scheduler.py``). Trace ids are chained, so one id names one whole prefix and the index needs nothing
else. A partial block is private to its sequence and gets a fresh negative id: never shared, never
stored in an event, and freed outright when released: it never enters the inactive pool. (Tried: keeping
released partial blocks in the inactive pool until evicted, as one mocker version's ``Deref`` does.
Each then holds a slot of cache for a while, and round robin's hit rate came out 0.003 low on every
workload: S4 0.118 vs the anchor's 0.121, S8 0.110 vs 0.112. Freeing them lands within 0.001 on all
four, so 1.6.1 evidently destroys unregistered blocks.)

Events are the kvrouter model's (``events/model.py``) so they feed ``RadixIndex.apply_event`` as they
are: ``Stored`` only when a block that was in neither pool is registered (reusing an active block or
reviving an inactive one emits nothing), with ``parent`` = the block before it in the sequence;
``Removed`` when a full block is evicted. The mocker publishes one ``Removed`` per evicted block; here
evictions are batched into one ``Removed`` that is flushed before the next ``Stored`` (so an id evicted
and re-stored in one iteration reaches the index in that order) or when the events are drained.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from ..events.model import EngineHash, KvEvent, LocalHash, Removed, Stored, StoredBlock

__all__ = ["KvCache"]

log = logging.getLogger(__name__)


class KvCache:
    """Active and inactive block pools of one (worker, dp_rank), with LRU eviction and KV events.

    Args:
        worker_id: the worker named in the events.
        num_blocks: slots in the pool (the mocker's ``num_gpu_blocks``).
        dp_rank: the dp rank named in the events.

    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    def __init__(self, worker_id: int, num_blocks: int, *, dp_rank: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks!r}")
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.capacity = num_blocks
        """Slots in the pool."""
        self._active: dict[int, int] = {}
        """Block id -> running sequences holding it (always >= 1)."""
        self._inactive: OrderedDict[int, None] = OrderedDict()
        """Released blocks, least recently released first: the eviction order."""
        self._partial_ids = itertools.count(-1, -1)
        self._events: list[KvEvent] = []
        self._evicted: list[EngineHash] = []
        """Full blocks evicted since the last flush; become one ``Removed``."""
        self._event_id = 0
        self.evictions = 0
        """Blocks evicted so far (partial ones included)."""
        self._pending: set[int] = set()
        """Full blocks registered since :meth:`settle`: allocated for a chunk of this iteration, their KV not
        computed until it ends."""

    # -- state ----------------------------------------------------------------------------------

    @property
    def active_blocks(self) -> int:
        """Blocks held by at least one running sequence (partial blocks included)."""
        return len(self._active)

    @property
    def inactive_blocks(self) -> int:
        """Cached blocks no running sequence holds."""
        return len(self._inactive)

    @property
    def free_blocks(self) -> int:
        """Slots in neither pool."""
        return self.capacity - len(self._active) - len(self._inactive)

    def is_active(self, block_id: int) -> bool:
        return block_id in self._active

    def is_inactive(self, block_id: int) -> bool:
        return block_id in self._inactive

    def refcount(self, block_id: int) -> int:
        """Running sequences holding ``block_id``; 0 when it is inactive or absent."""
        return self._active.get(block_id, 0)

    def cached_ids(self) -> set[int]:
        """Every full block id in either pool: what the engine could serve from cache."""
        return {block for block in itertools.chain(self._active, self._inactive) if block >= 0}

    def inactive_order(self) -> list[int]:
        """Inactive block ids, next to be evicted first."""
        return list(self._inactive)

    def prefix_hits(self, block_ids: Sequence[int], *, computed_only: bool = False) -> int:
        """How many leading ``block_ids`` are cached (in either pool): what admission may reuse. With
        ``computed_only``, a block registered in this iteration (a running prefill's chunk scheduled now)
        ends the run: SGLang's sharing, where the radix tree takes a chunk once it has run."""
        active, inactive, pending = self._active, self._inactive, self._pending
        hits = 0
        for block in block_ids:  # hot path: once per admission, stops at the first miss
            if block not in active and block not in inactive:
                break
            if computed_only and block in pending:
                break
            hits += 1
        return hits

    def settle(self) -> None:
        """The iteration ended: every block registered in it is computed."""
        self._pending.clear()

    # -- allocation -----------------------------------------------------------------------------

    def acquire_full(self, block_ids: Sequence[int], parent: int | None) -> int:
        """Hold ``block_ids`` (consecutive blocks of one sequence, after ``parent``) for a sequence.

        Each block already active gets one more holder, each inactive one is revived, each absent one
        takes a slot (evicting if needed) and is registered, with one ``Stored`` per run of newly
        registered blocks. Stops at the first block that finds no slot.

        Returns:
            How many leading ``block_ids`` are now held; fewer than asked means the pool is full.
        """
        active, inactive = self._active, self._inactive
        new_run: list[int] = []
        run_parent = parent
        held = 0
        previous = parent
        for block in block_ids:
            count = active.get(block)
            if count is not None:
                active[block] = count + 1
            elif block in inactive:
                del inactive[block]
                active[block] = 1
            else:
                if not self._make_room():
                    break
                active[block] = 1
                self._pending.add(block)
                if not new_run:
                    run_parent = previous
                new_run.append(block)
                held += 1
                previous = block
                continue
            if new_run:  # a reused block ends a run of new ones
                self._store(run_parent, new_run)
                new_run = []
            held += 1
            previous = block
        if new_run:
            self._store(run_parent, new_run)
        return held

    def acquire_partial(self) -> int | None:
        """A fresh private block for a sequence's unfilled tail; ``None`` when the pool is full."""
        if not self._make_room():
            return None
        block = next(self._partial_ids)
        self._active[block] = 1
        return block

    def promote(self, partial: int, block_id: int, parent: int | None) -> None:
        """The sequence's partial block filled up: it becomes the full block ``block_id``.

        Takes no slot (the partial block's is reused). Registers and stores ``block_id`` unless it is
        already cached, in which case the sequence simply holds the cached copy.
        """
        del self._active[partial]
        count = self._active.get(block_id)
        if count is not None:
            self._active[block_id] = count + 1
        elif block_id in self._inactive:
            del self._inactive[block_id]
            self._active[block_id] = 1
        else:
            self._active[block_id] = 1
            self._store(parent, [block_id])

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block, in the order given; blocks left with none become inactive.

        Callers pass a sequence's blocks leaf first (the mocker's reversed ``Deref``), so its deeper
        blocks are evicted before its prefix. A partial block (negative id) is freed, not cached.
        """
        active, inactive = self._active, self._inactive
        for block in block_ids:
            count = active[block] - 1
            if count:
                active[block] = count
            else:
                del active[block]
                if block >= 0:
                    inactive[block] = None

    def _make_room(self) -> bool:
        if len(self._active) + len(self._inactive) < self.capacity:
            return True
        if not self._inactive:
            return False
        block, _ = self._inactive.popitem(last=False)
        self.evictions += 1
        if block >= 0:
            self._evicted.append(EngineHash(block))
        return True

    # -- events ---------------------------------------------------------------------------------

    def _store(self, parent: int | None, blocks: Sequence[int]) -> None:
        self._flush_removed()
        stored = tuple(StoredBlock(EngineHash(block), LocalHash(block)) for block in blocks)
        engine_parent = None if parent is None else EngineHash(parent)
        self._events.append(
            Stored(self.worker_id, engine_parent, stored, dp_rank=self.dp_rank, event_id=self._event_id)
        )
        self._event_id += 1

    def _flush_removed(self) -> None:
        if self._evicted:
            evicted, self._evicted = tuple(self._evicted), []
            self._events.append(Removed(self.worker_id, evicted, dp_rank=self.dp_rank, event_id=self._event_id))
            self._event_id += 1

    def drain_events(self) -> list[KvEvent]:
        """The events since the last drain, in the order they happened."""
        self._flush_removed()
        events, self._events = self._events, []
        return events
