"""``ShardWriter``: everything an applier does to its shard, in one process, with no sockets.

It owns the shard's current segment and the private maps the kernels need (``docs/shm-engine.md``),
turns events into kernel calls with the index contract of ``index/reference.py``, and grows the table
by publishing a new segment. Keeping this apart from the applier's socket loop is what lets the tests
drive the shared-memory index in-process against ``RadixIndex`` (``tests/index/test_writer.py``).

Growth runs beside the writer (``index/growth.py``): a table or private map passing ``MAX_LOAD`` gets a
successor twice its size (``growth.capacity_for``), built and filled on the writer's helper threads while
the writer goes on writing the old one up to ``GROWING_LOAD``; between batches the writer checks on it
(``advance``) and publishes it once reconciled. Growing by 4x while small would save the copy into every
other size, at the cost of tables and maps up to twice the size they need (the engine map alone is 48
bytes a held block); not done: a long-running applier reaches its working set once, and a bigger first
size is the knob for that (``INITIAL_CAPACITY``).

The index cap (``--max-index-blocks``; ``docs/shm-engine.md`` "The index cap") is kept here, by the shard's
one writer, so an eviction is a release like a Removed event's, under the slot seqlock, and readers need
no change. Each shard keeps ``cap // shards`` (word ``S_BUDGET``), so no applier waits on another. After a
batch leaves the shard above its budget, ``_evict`` brings it to ``budget - budget // EVICT_SLACK`` with
``kernels.evict``: leaves first, workers not ``exact`` first, then the least recently stored or matched
(``touch``, fed by the front). Cost: two words of links and one stamp per engine-map row, a word per table
slot for matches, and one scan of the engine map plus a heap per eviction, amortised over 1/64 of the
budget. Rejected: a global budget (appliers would have to agree on one order across processes); an exact
LRU list per worker (a linked list through the map is two more words a row and a pointer chase per store,
for an order the cap needs only when it evicts); sampled eviction, Redis style (cheaper per eviction, but
it cannot keep the leaf rule, and the bound must hold at every batch's end); remembering evicted blocks to
excuse the engine's later events about them exactly (that memory would grow with the very losses the cap
bounds: ``_excuse`` approximates it per worker instead).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor
from typing import Final

import numpy as np
import numpy.typing as npt

from ..errors import BadEvent, BlockNotFound, InvalidBlockSequence, ParentNotFound
from ..events import packed
from ..events.codecs.kvrouter import RawEvent
from ..events.model import Cleared, KvEvent, Removed, Stored, WorkerKey
from . import _kernels as kernels
from .growth import Growth, Helper, MapGrowth, TableGrowth, capacity_for, new_map, new_table
from .layout import (
    EVICT_REASONS,
    GROWING_LOAD,
    H_CAPACITY,
    H_LIVE,
    H_MAGIC,
    H_NWORDS,
    H_TIERS,
    H_USED,
    MAP_GROWING_LOAD,
    MAP_MAX_LOAD,
    MAX_LOAD,
    MIN_CAPACITY,
    NO_ID,
    S_AFTER_EVICTION,
    S_BUDGET,
    S_ENTRIES,
    S_EVICTED,
    S_TOUCHED,
    SHARD_MAGIC,
    TIERS,
    W_BAD_FRAMES,
    W_CACHED_BY_TIER,
    W_DP_RANK,
    W_DROPPED_BLOCKS,
    W_EVENTS,
    W_EVICTED_BY_REASON,
    W_EVICTED_LRU,
    W_EVICTED_UNTRUSTED,
    W_GAPS_DETECTED,
    W_GAPS_LOST,
    W_GAPS_RECOVERED,
    W_IN_USE,
    W_LAST_EVENT_NS,
    W_LAST_ID,
    W_RESTARTS,
    W_SEEN,
    W_SKIPPED_EVENTS,
    W_STALE,
    W_STATE,
    W_WORKER_ID,
    WORD_BITS,
    WORKER_EXACT,
    Control,
    shard_name,
    unlink_segment,
)

__all__ = ["AFTER_EVICTION", "EVICT_SLACK", "ShardWriter", "pack_run", "raw_event"]

Table = npt.NDArray[np.uint64]

log = logging.getLogger(__name__)

EVICT_SLACK: Final = 64
"""An eviction brings a shard to ``budget - budget // EVICT_SLACK`` entries, not to the budget: each costs
a scan of the engine map, so it frees 1/64 of the budget at once and the next one comes that many stores
later. The cap is a bound, so the index keeps 98.4% of what it may hold at worst."""
MIN_MAP_ROWS: Final = 1024
INITIAL_CAPACITY: Final = 1 << 16
"""Slots of a new shard table (3 MiB at 64 workers): a fleet's working set fills it in seconds, and
starting there skips six doublings (each a copy and fresh page faults). Tests start smaller."""
RETIRE_S: Final = 1.0
"""How long an old shard table stays mapped here after its successor is published. The last process to
unmap a segment frees its pages; without the wait that was the reader's next query, which maps the new
table and unmaps the old: 6.6 ms of a ``/query`` at 1 M slots, and it doubles with every doubling. A reader
that queries within the second unmaps it while the writer still holds it, and the helper frees it."""
_NONE: Final = np.empty(0, dtype=np.uint64)
AFTER_EVICTION: Final = frozenset({BlockNotFound.kind, ParentNotFound.kind})
"""Error kinds an evicted block can cause (see ``ShardWriter._excuse``; the logical replay applies the same
rule)."""
_ERRORS: Final = {
    kernels.PARENT_NOT_FOUND: ParentNotFound.kind,
    kernels.INVALID_SEQUENCE: InvalidBlockSequence.kind,
    kernels.BLOCK_NOT_FOUND: BlockNotFound.kind,
}
"""Kernel statuses that are errors, by the error kind they count as."""


def raw_event(event: KvEvent) -> RawEvent:
    """A model event as the arrays ``apply_batch`` takes (token ids left out: the writer never reads them)."""
    match event:
        case Stored(parent=parent, blocks=blocks):
            engine = np.fromiter((b.engine_hash for b in blocks), dtype=np.uint64, count=len(blocks))
            local = np.fromiter((b.local_hash for b in blocks), dtype=np.uint64, count=len(blocks))
            return RawEvent("S", event.event_id, event.tier, parent, engine, local, None)
        case Removed(engine_hashes=hashes):
            engine = np.fromiter(hashes, dtype=np.uint64, count=len(hashes))
            return RawEvent("R", event.event_id, event.tier, None, engine, _NONE, None)
        case Cleared():
            return RawEvent("C", event.event_id, event.tier, None, _NONE, _NONE, None)


def _read_only(array: Table) -> Table:
    """``array``, or a read-only view of it. ``store`` and ``remove`` are compiled (``warm_up``) for the
    decoders' read-only views of a frame, and numba types a writable array apart: one would compile the
    kernel again (``store``: 11 s on a cold cache) in the applier, mid-stream. Writable ones come from
    model events (``raw_event``) and an engine decoder's own arrays (computed local hashes, the empty
    placeholder of a dropped event, hashes msgpack read as a list)."""
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


def pack_run(events: Sequence[RawEvent]) -> tuple[npt.NDArray[np.uint8], Table, npt.NDArray[np.int64], Table, Table]:
    """Stored and Removed events as ``apply_run`` takes them: kinds, parents, offsets, engine hashes,
    local hashes (the fork server's warm-up packs its run here too, so it compiles the same types)."""
    kinds = np.fromiter(map(_run_kind, events), dtype=np.uint8, count=len(events))
    parents = np.fromiter((e.parent or 0 for e in events), dtype=np.uint64, count=len(events))
    offsets = np.zeros(len(events) + 1, dtype=np.int64)
    np.cumsum([len(e.engine) for e in events], out=offsets[1:])
    return (
        kinds,
        parents,
        offsets,
        np.concatenate([e.engine for e in events]),
        np.concatenate([e.local for e in events]),
    )


def _run_kind(event: RawEvent) -> int:
    if event.tag == "R":
        return packed.REMOVED
    return packed.STORED if event.parent is None else packed.STORED_UNDER


def _stretches(kinds: npt.NDArray[np.uint8], tiers: npt.NDArray[np.uint8]) -> list[tuple[int, int]]:
    """A packed run's stretches ``[first, end)``: each clear alone, and between clears the events of one tier,
    which ``apply_run`` takes in one call."""
    cleared = kinds == packed.CLEARED
    cuts = (np.flatnonzero(cleared[1:] | cleared[:-1] | (tiers[1:] != tiers[:-1])) + 1).tolist()
    return list(zip([0, *cuts], [*cuts, kinds.size], strict=True))


def _map_load(meta: npt.NDArray[np.int64]) -> tuple[int, int, int]:
    """A private map's (used rows, capacity, live rows)."""
    used, tombs = int(meta[kernels.M_USED]), int(meta[kernels.M_TOMBS])
    return used, int(meta[kernels.M_CAPACITY]), used - tombs


HISTORY_WORDS: Final = [
    W_GAPS_DETECTED,
    W_GAPS_RECOVERED,
    W_GAPS_LOST,
    W_DROPPED_BLOCKS,
    W_SKIPPED_EVENTS,
    W_BAD_FRAMES,
    W_RESTARTS,
    W_EVENTS,
    W_EVICTED_UNTRUSTED,
    W_EVICTED_LRU,
]
"""Row words that describe a worker's history rather than the table: a restarted applier keeps them, so a
gap counted before an applier crash is still accounted after it (``detected = recovered + lost``)."""


def _history(rows: npt.NDArray[np.uint64]) -> dict[WorkerKey, npt.NDArray[np.uint64]]:
    """The history words of every row in use, by worker."""
    used = np.flatnonzero(rows[:, W_IN_USE])
    return {(int(rows[b, W_WORKER_ID]), int(rows[b, W_DP_RANK])): rows[b, HISTORY_WORDS].copy() for b in used}


class ShardWriter:
    """The single writer of one shard: applies events, grows the table, keeps the control rows current."""

    def __init__(
        self,
        control: Control,
        shard: int,
        owner_pid: int,
        *,
        workers: Iterable[WorkerKey] = (),
        capacity: int = INITIAL_CAPACITY,
        budget: int = 0,
        helper: Executor | None = None,
    ) -> None:
        """``helper`` runs the growths (``index/growth.py``); by default a thread of the writer's own,
        started on the first growth. Tests pass one they step by hand."""
        self.control = control
        self.shard = shard
        self.owner_pid = owner_pid
        self.budget = budget
        """The (worker, block) entries this shard may hold at a batch's end; 0: no cap."""
        self._target = budget - budget // EVICT_SLACK
        """What an eviction brings the entries down to (``EVICT_SLACK``)."""
        self._block = control.block(shard)
        self._block[S_BUDGET] = budget
        self._block[S_ENTRIES] = 0
        self._bits: dict[WorkerKey, int] = {}
        self._evicted_once = False
        self.keep_evicted = False
        """Keep what the cap evicts for :meth:`take_evicted` (set while the router records)."""
        self._evictions: list[tuple[WorkerKey, int, npt.NDArray[np.uint64]]] = []
        self.evictions_unlisted = 0
        """Evicted rows beyond what one eviction's list held: missing from the recording, counted."""
        self._cached = np.zeros((TIERS, control.rows), dtype=np.int64)
        """Cached blocks per tier and row (``kernels.TierCounts``), copied into the rows by ``_sync_cached``."""
        self._emap, self._emeta = new_map(capacity)
        self._refs, self._rmeta = new_map(MIN_MAP_ROWS)
        self._rows = control.worker_rows(shard)
        """This shard's worker rows (a view: the control segment never moves)."""
        self._history = _history(self._rows)
        kernels.begin_rows_change(control.block(shard))
        control.worker_rows(shard)[:] = 0  # a dead predecessor's rows: this writer registers its own
        kernels.end_rows_change(control.block(shard))
        self._helper = Helper(helper)
        self._growths: dict[str, Growth] = {}
        """What is growing now, by part: ``table``, ``emap``, ``refs`` (``_parts``)."""
        self._retiring: list[tuple[float, TableGrowth]] = []
        """Published growths whose old segment stays mapped until a monotonic time (``RETIRE_S``)."""
        epoch = control.epoch(shard) + 1
        self._segment = new_table(shard_name(owner_pid, shard, epoch), capacity, 1, 1, epoch)
        self._segment.words[H_MAGIC] = SHARD_MAGIC
        control.publish_segment(shard, self._segment.name, epoch, 1)
        self._matched = np.zeros(0, dtype=np.uint64)
        """When each table slot's block was last matched (``touch``; 0: never), in the engine map's stamps:
        private, beside the shared table, carried through every growth (``kernels.copy_slots``). Empty
        until the first match: growths then carry nothing."""
        for worker in workers:
            self._bit(worker)

    @property
    def segment_name(self) -> str:
        return self._segment.name

    @property
    def table(self) -> npt.NDArray[np.uint64]:
        return self._segment.words

    def workers(self) -> set[WorkerKey]:
        return set(self._bits)

    def owns(self, worker: WorkerKey) -> bool:
        """Whether the worker has a row here (registered, or met by ``apply``, and not forgotten)."""
        return worker in self._bits

    # -- events -------------------------------------------------------------------------------

    def apply(self, event: KvEvent) -> str | None:
        """Apply one event under the index contract; count it, and its error kind if any, in the control
        segment. Returns the error kind (``parent_not_found``, ``block_not_found``,
        ``invalid_block_sequence``, ``bad_event``) or None."""
        self._emeta[kernels.M_STAMP] += 1
        worker = (event.worker_id, event.dp_rank)
        kind = self._apply(worker, raw_event(event))
        errors = [kind] if kind else []
        bit = self._bits.get(worker, -1)
        if bit >= 0:
            errors = self._excuse(bit, errors)
        self._count(1, errors)
        return errors[0] if errors else None

    def apply_batch(self, worker: WorkerKey, events: Sequence[RawEvent], sent_at: float = 0.0) -> list[str]:
        """Apply one worker's events, already decoded into packed arrays (no object per block), in order;
        count them once, with their batch's engine stamp ``sent_at`` (0: none) for the index lag. Returns
        the error kinds met, one per failed event, in order.

        A lone event goes to its kernel as is; consecutive Stored and Removed events of one tier go to
        ``apply_run`` in one call (their arrays concatenated), a Cleared event on its own."""
        bit = self._bit(worker)
        self._emeta[kernels.M_STAMP] += 1  # the stamp stores give rows: one tick per batch
        if bit < 0:
            errors = [BadEvent.kind] * len(events)
        else:
            errors = []
            first, count = 0, len(events)
            while first < count:  # hot path: one kernel call per run of events
                event = events[first]
                end = first + 1
                if event.tag != "C":
                    tier = event.tier
                    while end < count and events[end].tag != "C" and events[end].tier is tier:
                        end += 1
                if end - first == 1:
                    kind = self._apply_one(bit, event)
                    if kind is not None:
                        errors.append(kind)
                else:
                    errors.extend(self._apply_run(bit, event.tier.rank, *pack_run(events[first:end])))
                first = end
        return self._close_batch(bit, errors, len(events), sent_at)

    def apply_packed(
        self,
        worker: WorkerKey,
        kinds: npt.NDArray[np.uint8],
        tiers: npt.NDArray[np.uint8],
        parents: Table,
        offsets: npt.NDArray[np.int64],
        engine: Table,
        local: Table,
        sent_at: float = 0.0,
        *,
        mixed: bool = True,
    ) -> list[str]:
        """Apply one worker's events packed as a run (``events/packed.py``), as ``apply_batch`` would apply
        them one by one; count them once. Returns the error kinds met, in order.

        The compiled batch path's way in: a whole drain of a stream is one call here, one ``apply_run`` per
        stretch of one tier between clears. ``mixed`` False says there is one stretch, no clear (the decoder
        knows): the run then goes to ``apply_run`` whole, with no array work here, which is most of what a
        drain of one message costs."""
        bit = self._bit(worker)
        self._emeta[kernels.M_STAMP] += 1
        count = kinds.size
        if bit < 0:
            errors = [BadEvent.kind] * count
        else:
            errors = []
            local_at = 0
            for first, end in _stretches(kinds, tiers) if mixed else [(0, count)] if count else []:
                tier = int(tiers[first])
                if kinds[first] == packed.CLEARED:
                    kernels.clear_holder(*self._maps(), bit, tier)
                    continue
                lo, hi = int(offsets[first]), int(offsets[end])
                stretch = offsets[first : end + 1]
                errors.extend(
                    self._apply_run(
                        bit, tier, kinds[first:end], parents[first:end], stretch - lo, engine[lo:hi], local[local_at:]
                    )
                )
                if mixed:  # the next stretch's local hashes start after this one's stores
                    local_at += int(np.sum(np.diff(stretch)[kinds[first:end] != packed.REMOVED]))
        return self._close_batch(bit, errors, count, sent_at)

    def _close_batch(self, bit: int, errors: list[str], events: int, sent_at: float) -> list[str]:
        """A batch's end, by either way in (``apply_batch``, ``apply_packed``): the holder's cached counts
        synced and the errors its evictions caused excused (a known worker only), then the batch counted.
        Returns the errors left."""
        if bit >= 0:
            self._sync_cached(bit)
            if errors:
                errors = self._excuse(bit, errors)
        self._count(events, errors, sent_at)
        return errors

    def touch(self, seqs: npt.NDArray[np.uint64]) -> int:
        """Blocks the front's decisions matched (sequence hashes): each is now the most recently used for
        the cap's order, for every worker of this shard holding it. Nothing without a cap. Returns how
        many distinct blocks were in the table (``seqs`` may repeat one), counted in the shard's
        ``S_TOUCHED``."""
        if not self.budget:
            return 0
        self._emeta[kernels.M_STAMP] += 1
        if not self._matched.size:
            self._settle("table")  # a growth carries the stamps it started with: none
            self._matched = np.zeros(int(self.table[H_CAPACITY]), dtype=np.uint64)
        found = int(kernels.touch(self.table, self._matched, seqs, np.uint64(self._emeta[kernels.M_STAMP])))
        self._block[S_TOUCHED] += np.uint64(found)
        return found

    def count_bad_batch(self) -> None:
        """A message for this shard did not decode: one ``bad_event``, no event applied."""
        self._count(0, [BadEvent.kind])

    def _excuse(self, bit: int, errors: list[str]) -> list[str]:
        """``errors`` without the ones the cap caused: a worker some of whose entries were evicted may name
        an evicted block (its Removed, a Stored under it), which is counted in ``S_AFTER_EVICTION``.

        Approximate on purpose: the writer does not remember what it evicted (that memory would grow with
        the losses the cap exists to bound), so once a worker had an eviction, every unknown block it names
        is taken for an evicted one; a real ``block_not_found`` of that worker then goes uncounted."""
        row = self._rows[bit]
        if not any(row[word] for word in W_EVICTED_BY_REASON):
            return errors
        kept = [kind for kind in errors if kind not in AFTER_EVICTION]
        self._block[S_AFTER_EVICTION] += len(errors) - len(kept)
        return kept

    def _count(self, events: int, errors: list[str], sent_at: float = 0.0) -> None:
        """Bump the shard's counters once per call, not per event: they are shared-memory words. Past
        the shard's budget, evict first (``_evict``): the cap holds at every batch's end."""
        entries = self._rmeta[kernels.M_ENTRIES]
        if self.budget and entries > self.budget:
            self._evict()
            entries = self._rmeta[kernels.M_ENTRIES]
        self._block[S_ENTRIES] = entries
        self.control.count_events(self.shard, events, time.time_ns(), sent_at)
        for kind in errors:
            self.control.count_error(self.shard, kind)
        if self._growths:
            self.advance()

    def _apply(self, worker: WorkerKey, event: RawEvent) -> str | None:
        bit = self._bit(worker)
        if bit < 0:
            return BadEvent.kind
        kind = self._apply_one(bit, event)
        self._sync_cached(bit)
        return kind

    def _apply_one(self, bit: int, event: RawEvent) -> str | None:
        """One event through its own kernel; the caller syncs the worker's cached count."""
        tier = event.tier.rank
        if event.tag == "S":
            self._hold_tier(tier)
            parent = event.parent
            has_parent, parent_word = parent is not None, np.uint64(parent or 0)
            engine, local = _read_only(event.engine), _read_only(event.local)
            status = kernels.store(*self._maps(), bit, tier, has_parent, parent_word, engine, local)
            while status == kernels.NEED_ROOM:
                self._make_room(len(engine))
                status = kernels.store(*self._maps(), bit, tier, has_parent, parent_word, engine, local)
            return _ERRORS.get(status)
        if event.tag == "R":
            return (
                BlockNotFound.kind if kernels.remove(*self._maps(), bit, tier, _read_only(event.engine)) >= 0 else None
            )
        kernels.clear_holder(*self._maps(), bit, tier)
        return None

    def _apply_run(
        self,
        bit: int,
        tier: int,
        kinds: npt.NDArray[np.uint8],
        parents: Table,
        offsets: npt.NDArray[np.int64],
        engine: Table,
        local: Table,
    ) -> list[str]:
        """Stored and Removed events of one tier through ``apply_run``, growing the tables as it asks; error
        kinds in order."""
        self._hold_tier(tier, kinds)
        statuses = np.zeros(kinds.size, dtype=np.int64)
        done = 0
        while True:
            done = kernels.apply_run(*self._maps(), bit, tier, kinds, parents, offsets, engine, local, done, statuses)
            if done == kinds.size:
                break
            self._make_room(int(offsets[done + 1] - offsets[done]))
        return [_ERRORS[status] for status in statuses[np.flatnonzero(statuses)].tolist()]

    def _maps(
        self,
    ) -> tuple[
        npt.NDArray[np.uint64],
        npt.NDArray[np.uint64],
        npt.NDArray[np.int64],
        npt.NDArray[np.uint64],
        npt.NDArray[np.int64],
        npt.NDArray[np.int64],
    ]:
        """The arrays every event kernel takes first: the table, the engine map, refs, cached counts."""
        return self.table, self._emap, self._emeta, self._refs, self._rmeta, self._cached

    def remove_worker(self, worker_id: int) -> None:
        """Forget every dp rank of ``worker_id``: its bits are cleared, then its rows freed for reuse."""
        for worker in [w for w in self._bits if w[0] == worker_id]:
            self.forget(worker)

    def forget(self, worker: WorkerKey) -> None:
        """Forget one (worker, dp_rank): its bits are cleared, then its row freed for reuse."""
        bit = self._bits.pop(worker, None)
        if bit is not None:
            self._clear_bit_everywhere(bit)
            block = self.control.block(self.shard)
            kernels.begin_rows_change(block)  # a reader that walked the old bits walks again
            self.control.worker_rows(self.shard)[bit, W_IN_USE] = 0
            kernels.end_rows_change(block)

    def clear_worker(self, worker: WorkerKey) -> None:
        """Release every block of one (worker, dp_rank) in every tier (an engine restart, a dump about to
        be applied); its row stays."""
        bit = self._bits.get(worker)
        if bit is not None:
            self._clear_bit_everywhere(bit)

    def register(self, worker: WorkerKey) -> int:
        """Give the worker its row now (it is routable with overlap 0 before its first event); returns its
        mask bit, or -1 when every row is taken."""
        return self._bit(worker)

    def engine_hashes(self) -> dict[tuple[WorkerKey, int], set[int]]:
        """Every engine hash the writer's engine map holds, by (worker, tier rank): for tests and debugging
        (the index cap evicts by engine hash; the table shows only what that leaves)."""
        workers = {bit: worker for worker, bit in self._bits.items()}
        held: dict[tuple[WorkerKey, int], set[int]] = {}
        emap = self._emap
        tags = emap[:, kernels.MAP_TAG]
        for row in np.flatnonzero((tags != 0) & (tags != kernels.TOMB)).tolist():
            holder = int(tags[row] & kernels.HOLDER) - 1
            held.setdefault((workers[holder // TIERS], holder % TIERS), set()).add(int(emap[row, kernels.MAP_KEY]))
        return held

    def row(self, worker: WorkerKey) -> npt.NDArray[np.uint64] | None:
        """The worker's row of the control segment (the event plane writes its cursor and counters there)."""
        bit = self._bits.get(worker)
        return None if bit is None else self.control.worker_rows(self.shard)[bit]

    def clear_all_blocks(self, worker_id: int) -> None:
        """Release every block of every dp rank and tier of ``worker_id``; its rows stay."""
        for worker, bit in self._bits.items():
            if worker[0] == worker_id:
                self._clear_bit_everywhere(bit)

    def _clear_bit_everywhere(self, bit: int) -> None:
        for tier in range(TIERS):
            kernels.clear_holder(self.table, self._emap, self._emeta, self._refs, self._rmeta, self._cached, bit, tier)
        self._sync_cached(bit)
        self._block[S_ENTRIES] = self._rmeta[kernels.M_ENTRIES]

    def _sync_cached(self, bit: int) -> None:
        """Copy the worker's per-tier counts into its row: four scalar stores (a fancy-indexed store of the
        column costs a few times more, once per batch)."""
        row, cached = self._rows[bit], self._cached
        for tier, word in enumerate(W_CACHED_BY_TIER):
            row[word] = cached[tier, bit]

    def _evict(self) -> None:
        """Bring the entries down to ``_target`` (``kernels.evict``): workers that are not ``exact`` first,
        then the least recently stored, leaves first; count them per worker and per reason. Not ``exact`` is
        what the plane knows of the trust states (``service/trust.py``): a state other than exact, the stale
        flag, or anything seen that contradicts the registration (``W_SEEN``); the service's own checks (a
        silent topic, an overlap never reused) do not reach the appliers."""
        rows = self._rows
        untrusted = ((rows[:, W_STATE] != WORKER_EXACT) | (rows[:, W_STALE] != 0) | (rows[:, W_SEEN] != 0)).astype(
            np.uint8
        )
        evicted = np.zeros((len(rows), len(EVICT_REASONS)), dtype=np.int64)
        before = int(self._rmeta[kernels.M_ENTRIES])
        # rows deleted: one an entry dropped, and rarely one more (a moved hash); twice that, then counted
        gone = np.empty((2 * (before - self._target) + 64 if self.keep_evicted else 0, 2), dtype=np.uint64)
        _, deleted = kernels.evict(*self._maps(), self._matched, untrusted, before, self._target, evicted, gone)
        if self.keep_evicted:
            self._keep(gone[: min(deleted, len(gone))], deleted - len(gone))
        for bit in np.flatnonzero(evicted.any(axis=1)).tolist():
            for reason, word in enumerate(W_EVICTED_BY_REASON):
                rows[bit, word] += np.uint64(evicted[bit, reason])
            self._sync_cached(bit)
        totals = evicted.sum(axis=0)
        for reason in range(len(EVICT_REASONS)):
            self._block[S_EVICTED + reason] += np.uint64(totals[reason])
        if not self._evicted_once:
            self._evicted_once = True
            log.info(
                "index cap reached shard=%d budget=%d entries=%d evicted_to=%d",
                self.shard,
                self.budget,
                before,
                int(self._rmeta[kernels.M_ENTRIES]),
            )

    def _keep(self, gone: npt.NDArray[np.uint64], unlisted: int) -> None:
        """``kernels.evict``'s ``[holder, engine hash]`` rows, per (worker, tier), for :meth:`take_evicted`."""
        if unlisted > 0:
            self.evictions_unlisted += unlisted
            log.warning("index cap: %d evicted rows not listed for the recording shard=%d", unlisted, self.shard)
        for holder in np.unique(gone[:, 0]).tolist():
            bit, tier = divmod(int(holder), TIERS)
            key = (int(self._rows[bit, W_WORKER_ID]), int(self._rows[bit, W_DP_RANK]))
            self._evictions.append((key, tier, gone[gone[:, 0] == holder, 1].copy()))

    def take_evicted(self) -> list[tuple[WorkerKey, int, npt.NDArray[np.uint64]]]:
        """What the cap evicted since the last call, as (worker, tier, engine hashes): the Removed events
        that would have done the same (``keep_evicted``; the recording tap sends them after each batch)."""
        taken, self._evictions = self._evictions, []
        return taken

    # -- workers ------------------------------------------------------------------------------

    def _bit(self, worker: WorkerKey) -> int:
        """The worker's mask bit, giving it the lowest free row on first sight (-1 when all are taken)."""
        bit = self._bits.get(worker)
        if bit is not None:
            return bit
        rows = self.control.worker_rows(self.shard)
        free = np.flatnonzero(rows[:, W_IN_USE] == 0)
        if free.size == 0:
            log.error("no free worker row shard=%d worker=%s rows=%d", self.shard, worker, len(rows))
            return -1
        bit = int(free[0])
        nwords = int(self.table[H_NWORDS])
        if bit >= nwords * WORD_BITS:  # wider masks, published before the row
            self._widen(nwords * 2, int(self.table[H_TIERS]))
        self._cached[:, bit] = 0
        block = self.control.block(self.shard)
        kernels.begin_rows_change(block)  # the row may be a forgotten worker's: readers mid-walk walk again
        rows[bit, :] = 0
        rows[bit, W_WORKER_ID] = worker[0]
        rows[bit, W_DP_RANK] = worker[1]
        rows[bit, W_LAST_ID] = NO_ID
        rows[bit, W_LAST_EVENT_NS] = time.time_ns()
        history = self._history.pop(worker, None)
        if history is not None:
            rows[bit, HISTORY_WORDS] = history
        rows[bit, W_IN_USE] = 1  # last: a reader that sees the row in use sees the whole row
        kernels.end_rows_change(block)
        self._bits[worker] = bit
        return bit

    # -- growth -------------------------------------------------------------------------------

    @property
    def growing(self) -> bool:
        """Whether a table or map is being rebuilt: the applier then checks on it often (``advance``)."""
        return bool(self._growths)

    def advance(self) -> None:
        """Between batches: publish every growth that is ready, give the others another round. A successor
        is never smaller than the old table, which takes at most ``GROWING_LOAD``: it may be published that
        full, and the next store that passes ``MAX_LOAD`` starts the next growth."""
        for part, growth in list(self._growths.items()):
            if growth.ready():
                self._finish(part)

    def settle(self) -> None:
        """Finish every growth now and let the helpers release the old tables: quiet, for tests and tools."""
        for part in list(self._growths):
            self._settle(part)
        self.release_retired(math.inf)
        self._helper.drain()

    def release_retired(self, now: float) -> None:
        """Hand the old tables whose ``RETIRE_S`` ended before ``now`` (monotonic) to the helpers to unmap:
        the applier's tick."""
        while self._retiring and self._retiring[0][0] <= now:
            self._helper.submit(self._retiring.pop(0)[1].release)

    def _settle(self, part: str) -> None:
        if part in self._growths:
            self._finish(part)

    def _parts(self) -> dict[str, tuple[int, int, int]]:
        """Each growable part's (used, capacity, live) now."""
        table, emeta, rmeta = self.table, self._emeta, self._rmeta
        return {
            "table": (int(table[H_USED]), int(table[H_CAPACITY]), int(table[H_LIVE])),
            "emap": _map_load(emeta),
            "refs": _map_load(rmeta),
        }

    def _make_room(self, new_keys: int) -> None:
        """Before a store of ``new_keys`` blocks: every table and map must take them below its limit, which
        is ``MAX_LOAD`` (past it, a growth starts) or, while one runs, ``GROWING_LOAD`` (past it, the writer
        waits for the growth to end); for the maps ``MAP_MAX_LOAD`` and ``MAP_GROWING_LOAD``."""
        for part in ("table", "emap", "refs"):
            most, most_growing = (MAX_LOAD, GROWING_LOAD) if part == "table" else (MAP_MAX_LOAD, MAP_GROWING_LOAD)
            while True:
                used, capacity, live = self._parts()[part]
                growing = part in self._growths
                if used + new_keys <= capacity * (most_growing if growing else most):
                    break
                if growing:
                    self._finish(part)
                    continue
                # never smaller: the old one may fill to its growing load while this one is built
                rows = max(capacity, capacity_for(live + new_keys, MIN_MAP_ROWS, most))
                if part == "table":
                    self._grow_table(rows, int(self.table[H_NWORDS]), int(self.table[H_TIERS]))
                else:
                    old = (self._emap, self._emeta) if part == "emap" else (self._refs, self._rmeta)
                    self._growths[part] = MapGrowth(self._helper, old, rows)

    def _hold_tier(self, tier: int, kinds: npt.NDArray[np.uint8] | None = None) -> None:
        """Before a store in ``tier`` (or a run of events ``kinds`` there, which may be removes only): the
        table has masks for it (``layout.row_words``). The first store in a slower tier than any before
        widens the table once, for the rest of the shard's life; removes there cannot reach it."""
        if tier < int(self.table[H_TIERS]) or (kinds is not None and not np.any(kinds != packed.REMOVED)):
            return
        self._widen(int(self.table[H_NWORDS]), tier + 1)

    def _widen(self, nwords: int, tiers: int) -> None:
        """A table of the same size with wider slots, published before the caller goes on: a copy the
        writer waits for, once per doubling of the workers or new tier, never per event."""
        self._settle("table")
        capacity = max(int(self.table[H_CAPACITY]), capacity_for(int(self.table[H_LIVE]), MIN_CAPACITY, MAX_LOAD))
        self._grow_table(capacity, nwords, tiers)
        self._settle("table")

    def _grow_table(self, capacity: int, nwords: int, tiers: int) -> None:
        epoch = self.control.epoch(self.shard) + 1
        name = shard_name(self.owner_pid, self.shard, epoch)
        self._growths["table"] = TableGrowth(
            self._helper,
            self._segment,
            self._matched,
            name,
            capacity=capacity,
            nwords=nwords,
            tiers=tiers,
            epoch=epoch,
        )

    def _finish(self, part: str) -> None:
        """Reconcile and publish one growth: the new segment for readers, or the new map for the kernels."""
        growth = self._growths.pop(part)
        if isinstance(growth, TableGrowth):
            new = growth.finish()
            self.control.publish_segment(self.shard, new.name, growth.epoch, int(new.words[H_NWORDS]))
            self._segment, self._matched = new, growth.matched
            capacity = int(new.words[H_CAPACITY])
            growth.retire()
            self._retiring.append((time.monotonic() + RETIRE_S, growth))
        else:
            assert isinstance(growth, MapGrowth)
            rows, meta = growth.finish()
            if part == "emap":
                self._emap, self._emeta = rows, meta
            else:
                self._refs, self._rmeta = rows, meta
            capacity = len(rows)
            self._helper.submit(growth.release)
        log.info(
            "shard grown shard=%d part=%s capacity=%d rounds=%d reconciled=%d",
            self.shard,
            part,
            capacity,
            growth.rounds,
            growth.reconciled,
        )

    def close(self, *, unlink: bool) -> None:
        for growth in self._growths.values():
            growth.abandon()
        self._growths.clear()
        self.release_retired(math.inf)
        self._helper.close()
        name = self._segment.name
        self._segment.close()
        if unlink:
            unlink_segment(name)
