"""Growth that no one waits for: a shard table or private map rebuilt beside its writer.

Rules:

1. The successor is made and filled on the writer's helper threads (``Helper``, ``HELPER_THREADS``):
   the new segment or map, populated in 2 MB steps (``populate_in_steps``), then ``copy_slots`` /
   ``copy_rows`` a ``COPY_CHUNK`` at a time, the thread yielding its core after each step. The compiled
   calls hold no GIL,
   so the writer goes on applying batches to the old table meanwhile, and readers go on reading it. A
   growth has one task on the helpers at a time.
2. From the moment the copy starts (the writer starts it between batches, once the successor is
   populated), every write to the old table or map marks its slot or row in a dirty bitmap
   (``_kernels._mark``); what it wrote before, the copy reads. When the helper is done, the writer swaps in
   a clean bitmap and hands the dirty one back to the helper for a round of ``reconcile_*``; rounds repeat
   while the writer keeps dirtying more than ``FINAL_DIRTY`` slots or rows in one, up to ``MAX_ROUNDS``.
3. The last round is the writer's own, between two batches, with nothing running beside it: the
   successor then equals the old table exactly, and only then is it published (``Growth.finish``).
4. Until then the old table or map takes the writer's new keys up to ``GROWING_LOAD``; past it the writer
   waits for the growth to end (``ShardWriter._make_room``), which only a burst of new keys faster than
   the copy causes. The successor is never smaller than the old one, so it holds whatever the old took.

Why: a table that doubled in the writer's loop stalled the shard for the whole copy (at 2 M entries, a
0.15 s segment, a 0.15 s copy, 0.1 s per new map, then rehashing each map: 1.2-1.8 s in
``tools/bench_growth.py``), and every event waited behind it. Here the writer pays a branch per write while
a growth runs and a final round bounded by ``FINAL_DIRTY``; the copy (about 25 ns a slot: it reads the old
table in order and writes the new one near the same place) and the rounds (about 0.3 µs a scattered slot,
``_kernels.RECONCILE_BATCH``) run on the helpers. The old table or map is freed on a helper too
(``release``, ``drop_pages``).

Rejected: incremental rehashing with both tables live (Redis's dict): every kernel, the readers' walk
included, would probe two tables during a growth; pre-sizing to the index cap: over 1.2 GiB from the
first event (``docs/shm-engine.md``); growing on a forked child: the maps are private to the writer, and
a copy on write of the whole table is the stall again.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt

from . import _kernels as kernels
from .layout import (
    H_CAPACITY,
    H_DIRTY,
    H_EPOCH,
    H_MAGIC,
    H_NWORDS,
    H_TIERS,
    SHARD_MAGIC,
    Segment,
    shard_words,
    unlink_segment,
)

__all__ = [
    "FINAL_DIRTY",
    "MAX_ROUNDS",
    "Growth",
    "Helper",
    "MapGrowth",
    "TableGrowth",
    "capacity_for",
    "new_map",
    "new_table",
]

FINAL_DIRTY: Final = 512
"""Dirty slots or rows the writer reconciles itself, between two batches (0.1-0.4 µs each: at most 0.2 ms);
more go back to the helper for another round. It was 4,096 (up to 1-2 ms of the writer's, on every
growth); interleaved pairs on 2026-12-07 (``bench_ingest.py --wire``'s workload, 1 shard and 16 publishers
unless said) with 512: the steady 300k blocks/s p99 from send to visible in the index (a reader polling
``find_matches``) 2.3 against 2.8 ms, on ``/query`` 5.1 against 5.5 ms (medians of six); bursts of 64
publishers 1.72-1.77 against 1.62-1.70 M blocks/s, 2 shards 2.32-2.34 against 2.07-2.33, 16 publishers
the same; at 1 M and 100k blocks/s no worse; ``tools/bench_growth.py``'s longest call 28 against 53 ms."""
MAX_ROUNDS: Final = 8
"""Rounds on the helper after which the writer takes the last one whatever its size: a writer dirtying
as fast as the helper reconciles would otherwise never publish."""
GROWN_SHARE: Final = 0.75
"""The share of its ``MAX_LOAD`` a successor may start at: room for a third more keys before the next
growth (a table full at 0.5 doubles to 0.25)."""
FULL_LOAD: Final = 0.9
"""The used share a successor may not pass while reconciled: past it the writer copies afresh
(``Growth.settle``), so a probe always meets an empty slot."""
PAGE_CHUNK: Final = 2 << 20
"""Bytes per ``madvise`` call of ``populate_in_steps`` and ``drop_pages``. Each call holds the memory-map
lock for reading while it runs: about 0.7 ms for 2 MB here, against 11-14 ms for 32 MB (more when the
helper is preempted holding it). A thread that needs the lock for writing meanwhile (libzmq's I/O thread
growing its heap with ``mprotect``) waits, and every page fault queues behind that writer: with 32 MB the
I/O thread stalled 15-41 ms in single calls, and the steady 300k blocks/s run of ``bench_ingest.py --wire``
saw a p99 send-to-visible lag of 31-178 ms in most runs, 7-9 ms with 2 MB. The total is the same."""
COPY_CHUNK: Final = 1 << 15
"""Old slots or rows per compiled copy call (1.6 ms for a map's, 70 % full). After each, and after each
``madvise`` step, the helper yields its core (``os.sched_yield``): the scheduler then runs a woken writer or
front at once, where it had let them wait out the helper's time slice (1-4 ms drains and 3-7 ms ``/query``
answers while a growth ran, at a steady 300k blocks/s). ``bench_ingest.py --wire``'s steady 300k run, 1
shard, interleaved pairs, p99 medians of six: 3.9 against 4.2 ms with the ``madvise`` steps yielding, 4.2
against 5.2 with the copies too, and this code against the code before it 3.7 against 5.7 (better in each of
the six pairs); with the benchmark's growth reader process querying beside it, two more sets gave 7.1
against 5.7 and 4.7 against 5.5 (22 of the 30 pairs better in all). Bursts unchanged: 1 shard 1.83, 2.00
and 2.10 against 1.94, 2.00 and 2.13 M blocks/s in three sets of six pairs, 2 shards 2.13 against 2.13. A
yield with nothing else to run returns at once."""
_MADV_DONTNEED: Final = 4
_MADV_POPULATE_WRITE: Final = 23
"""Linux 5.14 and later; before, ``madvise`` refuses it and the pages fault in as they are first written."""
_libc = ctypes.CDLL(None, use_errno=True)

_T = TypeVar("_T")

Map = tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]


def capacity_for(keys: int, minimum: int, max_load: float) -> int:
    """The smallest power of two holding ``keys`` below ``GROWN_SHARE`` of ``max_load``: a full table
    doubles, one that is mostly tombstones is rebuilt at its own size (never smaller,
    ``ShardWriter._make_room``)."""
    return max(minimum, 1 << math.ceil(math.log2(max(1, keys) / (GROWN_SHARE * max_load))))


HELPER_THREADS: Final = 2
"""Two, so that the shared table's copy never queues behind the engine map's, which grows at the same
time (one row per held block, as the table has one slot per block): with one thread, the writer at full
speed filled the table to ``GROWING_LOAD`` before its turn came and waited (``tools/bench_growth.py``:
the longest call 150-240 ms, against 75-96 with two)."""


def _in_background() -> None:
    """A helper thread's start: ``SCHED_BATCH``, which the scheduler takes for CPU-bound work and mildly
    disfavours at wake-ups, so the writer, woken by each message, is rarely kept off a core by a copy; the
    copy keeps its share of the CPU. Four interleaved pairs of ``bench_ingest.py --wire``'s steady 300k
    blocks/s run (1 shard): p99 lag 8.4-10.6 ms as ordinary threads, 6.7-8.2 as batch, the burst's rate
    unchanged (1.15-1.52 against 1.38-1.65 M blocks/s). Rejected: ``nice`` 19, which made a burst slower
    (1.70 against 1.55 M blocks/s at the median of six pairs: the copy starves), and 10 (no better than 0 in
    either). Also rejected (2026-12-07, interleaved pairs against batch, 1 shard and 16 publishers unless
    said): ``SCHED_IDLE``, which bursts starve as they do ``nice`` 19; idle until the writer's keys pass a
    fifth of a growth's room, then promoted to batch, which only a privileged thread may do (steady 300k
    p99 5.5 against 7.5 ms at the median of six, but bursts 5-10 % slower with 2 shards or 64 publishers,
    three of three); the same, idle only while the applier had spare time (no steady gain left); growth in
    steps handed from idle threads to batch ones, which needs no privilege, but an idle thread's step in
    progress starved up to 100 ms in a burst, and at 1 M blocks/s the p99 doubled; shorter time slices
    (``sched_setattr``) for the appliers and fronts instead (no change). Where the policy is missing, nothing
    changes."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: this thread (Linux)


class Helper:
    """The writer's helper threads, started on the first growth (an applier is forked with no thread)."""

    def __init__(self, executor: Executor | None = None) -> None:
        self._executor = executor
        self._submitted: list[Future[Any]] = []

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=HELPER_THREADS, thread_name_prefix="kvrouter-growth", initializer=_in_background
            )
        future = self._executor.submit(fn, *args)
        self._submitted = [f for f in self._submitted if not f.done()] + [future]
        return future

    def drain(self) -> None:
        """Wait for everything submitted so far (old tables released included)."""
        for future in self._submitted:
            future.result()
        self._submitted = []

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def populate_in_steps(array: npt.NDArray[np.uint64]) -> None:
    """Populate a fresh mapping ``PAGE_CHUNK`` bytes at a time, as ``MAP_POPULATE`` would in one go.

    ``MAP_POPULATE`` holds the process's memory-map lock while it populates the whole mapping, and the
    writer's own next ``mmap`` or page fault waited for it: ``tools/bench_growth.py``'s longest call was
    1.0-1.9 s with it, 75-120 ms without. One step holds the lock for one chunk."""
    _advise(array, _MADV_POPULATE_WRITE)


def drop_pages(array: npt.NDArray[np.uint64]) -> None:
    """Free the pages of a mapped array ``PAGE_CHUNK`` bytes at a time before it is unmapped: ``munmap``
    frees them all under the memory-map lock, which the writer's next ``mmap`` would wait for."""
    _advise(array, _MADV_DONTNEED)


def _advise(array: npt.NDArray[np.uint64], advice: int) -> None:
    """``madvise`` over a mapped array, ``PAGE_CHUNK`` bytes per call (ctypes releases the GIL)."""
    base, size = array.ctypes.data, array.nbytes
    for offset in range(0, size, PAGE_CHUNK):
        length = min(PAGE_CHUNK, size - offset)
        _libc.madvise(ctypes.c_void_p(base + offset), ctypes.c_size_t(length), advice)
        os.sched_yield()  # COPY_CHUNK says why


def _bitmap(rows: int) -> npt.NDArray[np.uint64]:
    """A dirty bitmap for ``rows`` slots or rows: word 0 counts the bits set (``_kernels._mark``)."""
    return np.zeros(1 + (rows + 63) // 64, dtype=np.uint64)


class Growth:
    """One table or map being rebuilt on the helper (module rules). Subclasses say how to make the
    successor, copy into it, reconcile it, and where the old one keeps its dirty bitmap's address."""

    def __init__(self, helper: Helper, rows: int, capacity: int) -> None:
        self._helper = helper
        self.capacity = capacity
        """The successor's slots or rows."""
        self._bitmaps = (_bitmap(rows), _bitmap(rows))
        self._marking = 0
        """Which bitmap the writer's writes mark now; the other is the helper's."""
        self._rows = rows
        self.where = np.empty(0, dtype=np.int64)
        """Where each old slot or row's copy is in the successor (-1: not copied); made on the helper."""
        self.rounds = 0
        self.reconciled = 0
        """Slots or rows the reconciling rounds brought up to date (the writer logs it)."""
        self.overfull = False
        """A round would have passed ``FULL_LOAD``: the successor is copied afresh when settled."""
        self._copying = False
        """Whether the copy has started: until then the successor is being made and populated."""
        self._mark_into(self._bitmaps[0])  # the old table's growing load applies from now
        self._future: Future[None] = helper.submit(self._prepare)

    def ready(self) -> bool:
        """Whether the successor can be published now: the helper is idle and the writer's bitmap is small
        (else the helper is given another round). Called by the writer between batches."""
        if not self._future.done():
            return False
        self._future.result()  # a failure on the helper is the writer's
        if not self._copying:
            self._start_copy()
            return False
        marked = self._bitmaps[self._marking]
        if self.overfull or int(marked[0]) <= FINAL_DIRTY or self.rounds >= MAX_ROUNDS:
            return True
        self.rounds += 1
        self._marking ^= 1
        self._mark_into(self._bitmaps[self._marking])
        self._future = self._helper.submit(self._reconcile, marked)
        return False

    def settle(self) -> None:
        """The last round, the writer's own, once the helper's round ended (waiting for it if need be):
        stop marking, reconcile what was marked. The caller publishes."""
        self._future.result()
        if not self._copying:
            self._start_copy()
            self._future.result()
        self._mark_into(None)
        self._reconcile(self._bitmaps[self._marking])
        if self.overfull:  # nothing writes the old one now: a fresh copy is exact
            self._discard()
            self._build()

    def abandon(self) -> None:
        """Stop marking and let the helper finish; the successor is dropped (the writer is closing)."""
        self._mark_into(None)
        self._future.exception()

    def _build(self) -> None:
        """A whole successor at once, for a writer that waits for it anyway (``settle``)."""
        self._prepare()
        self._in_chunks(self._copier())

    def _prepare(self) -> None:
        """The successor, empty and populated, and the notes of where each slot or row goes."""
        self.where = np.full(self._rows, -1, dtype=np.int64)  # tens of MB: not on the writer's thread
        self._make()

    def _start_copy(self) -> None:
        """Between batches, once the successor is populated: the copy reads every slot or row after this, so
        what the writer marked while it was populated (a third to a half of a growth's time, in a burst)
        need not be reconciled (a 256-worker burst of ``bench_ingest.py``'s workload: 188k slots and rows
        reconciled instead of 450k). The writer marks into the other bitmap from now; the helper clears the
        first before it copies. Until then the writer marks into that first one all the same: a set
        address is what tells the kernels that the old table may fill to its growing load."""
        self._copying = True
        stale = self._bitmaps[self._marking]
        self._marking ^= 1
        self._mark_into(self._bitmaps[self._marking])
        self._future = self._helper.submit(self._copy, stale)

    def _copy(self, stale: npt.NDArray[np.uint64]) -> None:
        stale[:] = 0
        self._in_chunks(self._copier())

    def release(self) -> None:
        """Drop the old table or map, run on the helper after the writer published the successor: unmapping
        hundreds of MB takes milliseconds the writer need not wait."""
        self.where = np.empty(0, dtype=np.int64)

    def _reconcile(self, dirty: npt.NDArray[np.uint64]) -> None:
        if self.overfull:
            return
        done = self._reconcile_into(dirty, int(self.capacity * FULL_LOAD))
        if done < 0:
            self.overfull = True
        else:
            self.reconciled += done

    def _make(self) -> None:
        raise NotImplementedError

    def _copier(self) -> Callable[[int, int], None]:
        """The compiled copy of old slots or rows ``start``...``end - 1`` into the successor."""
        raise NotImplementedError

    def _in_chunks(self, copy: Callable[[int, int], None]) -> None:
        """``copy(start, end)`` over every old slot or row, ``COPY_CHUNK`` at a time, yielding the core after
        each."""
        for start in range(0, self._rows, COPY_CHUNK):
            copy(start, min(self._rows, start + COPY_CHUNK))
            os.sched_yield()

    def _reconcile_into(self, dirty: npt.NDArray[np.uint64], most: int) -> int:
        raise NotImplementedError

    def _discard(self) -> None:
        """Drop the successor built so far."""

    def _mark_into(self, bitmap: npt.NDArray[np.uint64] | None) -> None:
        raise NotImplementedError


class TableGrowth(Growth):
    """A shard table into a new segment: more slots, or wider masks, or more tiers, or only fewer tombstones."""

    def __init__(
        self,
        helper: Helper,
        old: Segment,
        matched: npt.NDArray[np.uint64],
        name: str,
        *,
        capacity: int,
        nwords: int,
        tiers: int,
        epoch: int,
    ) -> None:
        self.old, self.old_matched = old, matched
        self._name, self._nwords, self._tiers, self.epoch = name, nwords, tiers, epoch
        self.new: Segment | None = None
        self.matched = np.zeros(0, dtype=np.uint64)
        """The successor's match stamps (``ShardWriter._matched``), carried slot by slot."""
        super().__init__(helper, int(old.words[H_CAPACITY]), capacity)

    def _make(self) -> None:
        new = new_table(self._name, self.capacity, self._nwords, self._tiers, self.epoch, populate=False)
        populate_in_steps(new.words)
        self.new = new
        self.matched = np.zeros(self.capacity if self.old_matched.size else 0, dtype=np.uint64)

    def _copier(self) -> Callable[[int, int], None]:
        assert self.new is not None
        return partial(kernels.copy_slots, self.old.words, self.new.words, self.old_matched, self.matched, self.where)

    def _reconcile_into(self, dirty: npt.NDArray[np.uint64], most: int) -> int:
        assert self.new is not None
        return int(
            kernels.reconcile_slots(
                self.old.words, self.new.words, self.old_matched, self.matched, self.where, dirty, most
            )
        )

    def _discard(self) -> None:
        if self.new is not None:
            self.new.close()
            unlink_segment(self.new.name)
            self.new = None

    def _mark_into(self, bitmap: npt.NDArray[np.uint64] | None) -> None:
        self.old.words[H_DIRTY] = 0 if bitmap is None else bitmap.ctypes.data

    def finish(self) -> Segment:
        """The successor, reconciled and stamped: the caller publishes it, then retires the old one."""
        self.settle()
        assert self.new is not None
        self.new.words[H_MAGIC] = SHARD_MAGIC
        return self.new

    def retire(self) -> None:
        """Once the successor is published: the old segment's name goes (readers find the new one in the
        control segment, and a start's sweep has nothing left to find), its memory stays mapped here until
        :meth:`release`."""
        unlink_segment(self.old.name)

    def release(self) -> None:
        """Unmap the old segment, retired before: the last process to unmap it frees its pages (a few ms per
        100 MB)."""
        super().release()
        self.old_matched = np.empty(0, dtype=np.uint64)
        drop_pages(self.old.words)
        self.old.close()

    def abandon(self) -> None:
        super().abandon()
        self._discard()


class MapGrowth(Growth):
    """A private map (engine map or refs) into a bigger one."""

    def __init__(self, helper: Helper, old: Map, rows: int) -> None:
        self.old_rows, self.old_meta = old
        self.new: Map | None = None
        super().__init__(helper, self.old_rows.shape[0], rows)

    def release(self) -> None:
        super().release()
        drop_pages(self.old_rows)
        self.old_rows = np.empty((0, kernels.MAP_ROW_WORDS), dtype=np.uint64)

    def _make(self) -> None:
        rows, meta = new_map(self.capacity, populate=False)
        populate_in_steps(rows)
        self.new = rows, meta

    def _copier(self) -> Callable[[int, int], None]:
        assert self.new is not None
        return partial(kernels.copy_rows, self.old_rows, *self.new, self.where)

    def _reconcile_into(self, dirty: npt.NDArray[np.uint64], most: int) -> int:
        assert self.new is not None
        return int(kernels.reconcile_rows(self.old_rows, *self.new, self.where, dirty, most))

    def _discard(self) -> None:
        self.new = None

    def _mark_into(self, bitmap: npt.NDArray[np.uint64] | None) -> None:
        self.old_meta[kernels.M_DIRTY] = 0 if bitmap is None else bitmap.ctypes.data

    def finish(self) -> Map:
        """The successor, reconciled, with the old meta's stamp clock and entry count carried over."""
        self.settle()
        assert self.new is not None
        rows, meta = self.new
        meta[kernels.M_STAMP] = self.old_meta[kernels.M_STAMP]
        meta[kernels.M_ENTRIES] = self.old_meta[kernels.M_ENTRIES]
        return rows, meta


def new_map(rows: int, *, populate: bool = True) -> Map:
    """An empty private map (engine map or refs) in pre-faulted memory (see ``layout.Segment.create`` for
    why, and for ``populate``), zero from the kernel. Rejected: transparent huge pages (``MADV_HUGEPAGE``,
    against the map's TLB misses): ``bench_ingest.py``'s in-process rate was 1.82 M blocks/s with them
    against 2.25 without (medians of three, kvrouter frames, 16 workers), and populating a 2 MB page took
    0.3-4.5 ms (4.5 when the kernel had to compact memory for it) against 0.6-0.7 ms for small pages."""
    width = kernels.MAP_ROW_WORDS
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0)
    memory = mmap.mmap(-1, rows * width * 8, flags=flags)
    table = np.frombuffer(memory, dtype=np.uint64).reshape(rows, width)
    meta = np.zeros(kernels.META_WORDS, dtype=np.int64)
    kernels.init_map(table, meta)
    return table, meta


def new_table(name: str, capacity: int, nwords: int, tiers: int, epoch: int, *, populate: bool = True) -> Segment:
    """A new, empty shard segment with its header written, all but the magic (set when it is complete)."""
    segment = Segment.create(name, shard_words(capacity, nwords, tiers), populate=populate)
    words = segment.words
    words[H_CAPACITY] = capacity
    words[H_NWORDS] = nwords
    words[H_TIERS] = tiers
    words[H_EPOCH] = epoch
    return segment
