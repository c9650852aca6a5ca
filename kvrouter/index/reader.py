"""``IndexReader``: overlap queries over every shard, from any process, without a lock or a message.

A reader maps the control segment and each shard's current segment read-only, and answers a query with
one compiled call over every shard (``kernels.match_words`` for a list, ``match_shards`` for an array,
``overlap_shards`` for the dense answer). The kernels get one ``int64`` context array of addresses
(``kernels.CTX_*``: the tables, the control segment, the reader's state, bit maps and preallocated
buffers), so a call is dispatched in about 0.4 µs: numba types a read-only array over a ``memoryview``,
and a tuple of them, on its slow path (1.1-1.3 µs a call). The reader keeps every mapping whose address
is in the context open: a remap puts the new address in, then closes the old segment. A list of local
hashes goes in by its ``id()``: the kernel converts it into the reader's query buffer as ``array('L')``
would (a list it refuses goes through ``local_hash_words``, which raises), and that kernel is called
through its compiled function (``kernels.compiled``), with no dispatch at all. Each shard's walk is checked
against the shard's epoch and rows generation, and ``find_matches``' dict is built inside the kernel
(``_PyDict_SetItem_KnownHash`` of the reader's worker-key tuples, their ``hash()`` taken once per rows
generation) and handed back through ``_answer``: about 4 µs a 64-block query at 16 workers, 8 at 256.
The rejected alternatives: one compiled call per shard returning ``[tier, worker, rank, depth]`` rows and
a Python loop building the dict (10-20 µs a 64-block query at 16 workers around a 4 µs walk), then one
call writing ``(key, depth)`` into an array and ``dict(zip(map(keys.__getitem__, ...)))`` in Python (2-6 µs
for 15-45 workers, as much as the walk). ``find_matches_by_tier`` and the retry path still build their
dicts in Python from ``found``.

Which worker a mask bit names is read once per rows generation, not per query: the reader copies a
shard's worker rows (``kernels.read_rows``, between two equal reads of the generation) into a bit map
(bit -> worker key for ``find_matches``; bit -> ``WorkerSlots`` slot for ``overlaps``, also rebuilt when
the slots' ``version`` moves), and the kernels accept a walk only when the generation before and after it
is the map's (else ``ROWS_CHANGED``: the rows are read again, the shard walked again). So a walk's bits
are never attributed to a row's next owner, and a query costs no row reads at all.

A slot (or the rows generation) left odd for ``kernels.STUCK_SPINS`` reads brings the walk back here,
where the reader asks whether the shard's writer still lives: its pid in the control block, checked
with ``kill(pid, 0)`` and ``/proc/<pid>/stat`` (a killed applier is a zombie until reaped). A dead writer's
shard is given up at once and reported recovering; a live writer, preempted in the middle of a store,
is waited for (yielding the CPU to it), up to ``kernels.MAX_STUCK_READS`` reads in all. The rejected
alternative, spinning in the kernel until that bound, cost every query half a second after an applier
died mid-write. A reader in another pid namespace cannot see the applier and treats it as dead: it
reports the shard recovering for that query rather than waiting. Shards that answered keep their answer
while the others are asked again (only they: ``state[k, ASK]``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, EngineError
from ..events.model import TIERS_IN_ORDER, StorageTier, WorkerKey
from ..hashing import local_hash_array
from ..hashing.chain import local_hash_words
from . import _kernels as kernels
from .dense import WorkerSlots
from .layout import H_NWORDS, HEADER_WORDS, STATUS_RECOVERING, STATUS_STOPPED, TIERS, Control, Segment

__all__ = ["DecisionWalk", "IndexReader", "ListMatch"]

log = logging.getLogger(__name__)

REMAP_ATTEMPTS: Final = 8
"""Tries to open a shard's newest segment while its writer may be replacing it again in between."""
PATIENT_QUERIES: Final = kernels.MAX_STUCK_READS // kernels.STUCK_SPINS
"""Compiled queries one shard gets, each spinning ``STUCK_SPINS`` reads, while its live writer is stuck
mid-write (or its table keeps being replaced) before the reader gives the shard up for this query."""
SCRATCH_BLOCKS: Final = 4096
"""Query blocks the preallocated walk scratch holds; a longer query's kernel allocates its own."""
_ROW_USED, _ROW_ID, _ROW_RANK = 0, 1, 2
"""Columns of ``kernels.read_rows``' copy of a shard's rows."""

Table = npt.NDArray[np.uint64]


class DecisionWalk(NamedTuple):
    """What a router needs to walk the index inside its own compiled decision (``routing/_kernels.py``).

    The router calls the kernel on ``ctx`` itself, under ``lock``, while ``given_up`` is empty and
    ``ctx[kernels.CTX_MAPPED]`` is its numbering's version (which the kernel checks); otherwise, and when a
    shard fails the walk, it calls ``overlaps_and``, which maps the numbering, raises once the reader
    closed, and mends late shards. Why not always ``overlaps_and``: its frame (a lock, three checks, the
    call) cost a 16-worker decision about a microsecond once the caller's other work evicted it, a tenth
    of the decision."""

    ctx: npt.NDArray[np.int64]
    lock: threading.Lock
    given_up: set[int]
    """The shards the reader's last query gave up on (read only): while any, ``overlaps_and`` asks again
    and clears them."""
    overlaps_and: Callable[..., tuple[tuple[Any, ...], bool]]


class ListMatch(NamedTuple):
    """What :meth:`find_matches` does with a list, for a caller that holds the reader's lock and calls the
    kernel itself: ``match(ctx, id(items))`` (``kernels.match_list``, compiled); when that returns ``count
    >= 0`` and ``torn`` is empty, the answer is ``answer[0]``, else ``finish(items, count)``. Why: the
    reader's frame, around the engine's, cost a 64-block query about 0.6 µs of its 8 once the caller's
    other work evicted it (``tools/bench_index.py``'s alternating figure)."""

    match: Callable[[npt.NDArray[np.int64], int], int]
    ctx: npt.NDArray[np.int64]
    answer: list[dict[WorkerKey, int]]
    torn: set[int]
    finish: Callable[[list[int], int], dict[WorkerKey, int]]


class IndexReader:
    """Answers ``find_matches`` / ``find_matches_by_tier`` like ``RadixIndex``, and ``overlaps`` as arrays by
    ``WorkerSlots`` slot, from shared memory. Not thread-safe: one thread at a time per reader, but for
    :meth:`overlaps_and` and the router's walk by the context (:meth:`decision_walk`), which take ``lock``
    (the engine's query lock, so that the router can walk without a method of the engine around it)."""

    def __init__(self, control_name: str, lock: threading.Lock | None = None) -> None:
        self._lock = threading.Lock() if lock is None else lock
        self._closed = False
        self.control = Control.attach(control_name)
        shards, rows = self.control.shards, self.control.rows
        self._rows = rows
        self._words: Table = self.control.segment.words
        self._segments: list[Segment | None] = [None] * shards
        self._epochs = [0] * shards
        self._no_table: Table = np.zeros(HEADER_WORDS, dtype=np.uint64)
        """Stands for a shard before its first segment: epoch 0 (as the control block's), no live key."""
        self._state = np.zeros((shards, 3), dtype=np.int64)
        """Per shard: the rows generation its bit maps were read at (-1: not yet), ask, answer."""
        self._state[:, kernels.GENERATION] = -1
        self._state[:, kernels.ASK] = 1
        self._copy = np.zeros((rows, 3), dtype=np.uint64)
        self._used: list[tuple[list[int], list[WorkerKey]]] = [([], [])] * shards
        """Per shard, the rows in use at the generation read: their bits and workers."""
        self._keys: list[WorkerKey | None] = [None] * (shards * rows)
        """Per shard and bit (``shard * rows + bit``), the worker its row names at the generation read."""
        self._key_hashes = np.zeros(shards * rows, dtype=np.int64)
        """``hash()`` of each of ``_keys``, for the kernel's dict inserts (a tuple does not cache its hash)."""
        self._bit_keys = np.full(shards * rows, -1, dtype=np.int64)
        """``find_matches``' bit map: the index into ``_keys`` of a bit whose row is in use, else -1."""
        self._bit_slots = np.full(shards * rows, -1, dtype=np.int64)
        """``overlaps``' bit map: the slot in ``_slots`` of the worker a bit names, -1 for none."""
        self._slots: WorkerSlots | None = None
        self._slots_version = -1
        self._found = np.empty(3 * TIERS * shards * rows, dtype=np.int64)
        """``query_shards``' answer: ``(tier, key, depth)`` triples, at most one per tier and row in use."""
        self._answer: list[dict[WorkerKey, int]] = [{}]
        """Where ``match_words`` / ``match_shards`` put the answer dict they build."""
        nwords = -(-rows // 64)
        self._work = np.empty(TIERS * nwords * 64, dtype=np.int64)
        self._scratch = np.empty(kernels.scratch_words(TIERS, nwords, SCRATCH_BLOCKS), dtype=np.uint64)
        self._query = np.empty(SCRATCH_BLOCKS, dtype=np.uint64)
        """Where ``match_list`` converts a list query."""
        self._nwords = [0] * shards
        """Per shard, the mask words of its mapped table (0 before the first)."""
        self._ctx = np.zeros(kernels.CTX_TABLES + 2 * shards, dtype=np.int64)
        """What every query kernel reads, by address (``kernels.CTX_*``): one array argument instead of a
        tuple of read-only mappings, which numba's dispatcher types slowly (1.1-1.3 µs a call, against 0.4)."""
        ctx = self._ctx
        ctx[kernels.CTX_SHARDS], ctx[kernels.CTX_ROWS] = shards, rows
        ctx[kernels.CTX_CONTROL], ctx[kernels.CTX_CONTROL + 1] = self._words.ctypes.data, self._words.size
        for at, array in (
            (kernels.CTX_STATE, self._state),
            (kernels.CTX_BIT_KEYS, self._bit_keys),
            (kernels.CTX_BIT_SLOTS, self._bit_slots),
            (kernels.CTX_FOUND, self._found),
            (kernels.CTX_KEY_HASHES, self._key_hashes),
        ):
            ctx[at] = array.ctypes.data
        ctx[kernels.CTX_WORK], ctx[kernels.CTX_WORK + 1] = self._work.ctypes.data, self._work.size
        ctx[kernels.CTX_SCRATCH], ctx[kernels.CTX_SCRATCH + 1] = self._scratch.ctypes.data, self._scratch.size
        ctx[kernels.CTX_KEYS], ctx[kernels.CTX_ANSWER] = id(self._keys), id(self._answer)
        ctx[kernels.CTX_QUERY], ctx[kernels.CTX_QUERY + 1] = self._query.ctypes.data, self._query.size
        for shard in range(shards):
            self._set_table(shard, self._no_table)
        self._torn: set[int] = set()
        self._match_list = kernels.compiled(kernels.match_list, self._ctx, id(self._answer))
        """``match_list`` for this context and a list's ``id()``, without numba's dispatch."""
        self.writer_checks = 0
        """How often a walk met a slot left mid-write and the reader asked whether the shard's writer lives."""

    # -- queries ------------------------------------------------------------------------------

    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> dict[WorkerKey, int]:
        """Per worker, the leading query blocks it holds on device. ``early_exit`` never changes the answer."""
        if type(local_hashes) is list:  # hot path: one compiled call converts, walks and builds the dict
            if not local_hashes:
                return {}
            count = self._match_list(self._ctx, id(local_hashes))
            if count >= 0 and not self._torn:
                return self._answer[0]
            return self.list_answer(local_hashes, count)
        local = local_hash_array(local_hashes)
        if local.size == 0:
            return {}
        return self._answer_of(local, kernels.match_shards(self._ctx, local))

    def list_answer(self, local_hashes: list[int], count: int) -> dict[WorkerKey, int]:
        """The rest of a list query after ``kernels.match_list`` returned ``count`` (:class:`ListMatch`): a
        list it refused is converted here (which raises on a bad item), failed shards are asked again."""
        if count == kernels.LIST_REFUSED:  # too long for the query buffer, or not all u64 ints (raises)
            words = local_hash_words(local_hashes)
            address, n = words.buffer_info()
            return self._answer_of(np.frombuffer(words, dtype=np.uint64), kernels.match_words(self._ctx, address, n))
        return self._answer_of(self._query[: len(local_hashes)].copy() if count < 0 else self._query, count)

    def _answer_of(self, local: npt.NDArray[np.uint64], count: int) -> dict[WorkerKey, int]:
        """The dict a matching kernel that returned ``count`` put in ``_answer``, or, when shards failed, the
        answer built again with them asked again (``local`` must outlive the next query: a copy)."""
        if count >= 0:
            if self._torn:
                self._torn.clear()
            return self._answer[0]
        keys, depths, _ = self._query_again(local, 1, count)
        return dict(zip(keys, depths, strict=True))

    def find_matches_by_tier(self, local_hashes: Sequence[int]) -> dict[StorageTier, dict[WorkerKey, int]]:
        """Per tier, per worker, the leading query blocks held in that tier or a faster one."""
        results: list[dict[WorkerKey, int]] = [{} for _ in TIERS_IN_ORDER]
        if len(local_hashes) > 0:
            local = local_hash_array(local_hashes)
            count = kernels.query_shards(self._ctx, local, TIERS)
            if count >= 0 and self._torn:
                self._torn.clear()
            for key, depth, tier in zip(*self._query_again(local, TIERS, count), strict=True):
                results[tier][key] = depth
        return dict(zip(TIERS_IN_ORDER, results, strict=True))

    def overlaps(self, local: npt.NDArray[np.uint64], slots: WorkerSlots, ntiers: int) -> npt.NDArray[np.int64]:
        """``(ntiers, len(slots))``: per tier, per slot, the leading blocks of ``local`` held in that tier or a
        faster one (what ``find_matches_by_tier`` says), 0 for slots no shard holds.

        One compiled call over every shard, no per-worker Python object; a shard's bit -> slot map is
        rebuilt only when its rows generation or ``slots.version`` moved. A shard given up (its writer
        died mid-write) contributes nothing and is reported by :meth:`recovering`.

        Args:
            local: the query's local hashes (a ``uint64`` array; any integer sequence is converted).
            slots: the numbering of the answer's columns; workers without a slot are left out.
            ntiers: tiers answered, from device (1) to all of ``StorageTier`` (4).

        Raises:
            ConfigError: ``ntiers`` outside 1..4.
            InvalidHashInput: ``local`` is not 1-d integers in [0, 2**64).
        """
        if not 1 <= ntiers <= TIERS:
            raise ConfigError(f"overlaps ntiers: expected 1 to {TIERS}, got {ntiers}")
        out = np.zeros((ntiers, len(slots)), dtype=np.int64)
        if len(local) == 0 or len(slots) == 0:
            return out
        hashes = local_hash_array(local)
        self._follow(slots)
        if kernels.overlap_shards(self._ctx, hashes, ntiers, out):
            self._retry(lambda: kernels.overlap_shards(self._ctx, hashes, ntiers, out))
        elif self._torn:
            self._torn.clear()
        return out

    def overlaps_and(
        self,
        kernel: Callable[..., tuple[Any, ...]],
        local: npt.NDArray[np.uint64],
        slots: WorkerSlots,
        ntiers: int,
        out: npt.NDArray[np.int64],
        args: tuple[Any, ...] = (),
    ) -> tuple[tuple[Any, ...], bool]:
        """:meth:`overlaps` into ``out`` and the caller's work on it in one compiled call: ``kernel(ctx,
        local, ntiers, out, *args)`` must start with ``failed = overlap_shards(ctx, local, ntiers, out)``
        (which zeroes nothing: the kernel zeroes ``out`` first, or the columns it knows the last call
        wrote) and return a tuple starting with ``failed``. The router's decision is such a kernel (with
        ``ctx`` and ``out`` bound to it beforehand): one call and one dispatch where two cost twice the
        fixed price (``routing/_kernels.py``).

        Returns:
            The kernel's tuple, and whether shards failed and were mended into ``out`` afterwards (the
            caller's work then saw a partial ``out`` and must be redone on the mended one).

        Raises:
            EngineError: the reader is closed (its engine closed).
        """
        with self._lock:
            if self._closed:
                raise EngineError("the engine is not running: its index reader is closed")
            self._follow(slots)
            result = kernel(self._ctx, local, ntiers, out, *args)  # args a tuple: packed once, by the router
            if result[0]:
                self._retry(lambda: kernels.overlap_shards(self._ctx, local, ntiers, out))
                return result, True
            if self._torn:
                self._torn.clear()
            return result, False

    def decision_walk(self) -> DecisionWalk:
        """What the router walks this index with, inside its decision (:class:`DecisionWalk`)."""
        return DecisionWalk(self._ctx, self._lock, self._torn, self.overlaps_and)

    def list_match(self) -> ListMatch:
        """How :meth:`Engine.find_matches` answers a list without a frame of the reader's (:class:`ListMatch`)."""
        return ListMatch(self._match_list, self._ctx, self._answer, self._torn, self.list_answer)

    def unanswered(self) -> frozenset[int]:
        """The shards the last query gave up on (a slot or the rows left mid-write by a dead writer): their
        workers had overlap 0 in its answer, whatever they hold."""
        return frozenset(self._torn)

    def recovering(self) -> set[int]:
        """Shards whose status says recovering, or whose last walk gave up on a slot left mid-write."""
        marked = {k for k in range(self.control.shards) if self.control.status(k) == STATUS_RECOVERING}
        return marked | self._torn

    def _taken(self, count: int) -> tuple[list[WorkerKey], list[int], list[int]]:
        """The workers, depths and tiers a ``query_shards`` call returning ``count`` wrote."""
        n = count if count >= 0 else -1 - count
        found = self._found[: 3 * n].tolist()
        return list(map(self._keys.__getitem__, found[:n])), found[n : 2 * n], found[2 * n :]  # type: ignore[arg-type]

    def _query_again(
        self, local: npt.NDArray[np.uint64], ntiers: int, count: int
    ) -> tuple[list[WorkerKey], list[int], list[int]]:
        """What ``query_shards`` returning ``count`` wrote, with the shards that failed it asked again until
        they answered or were given up (``_retry``): workers, depths, tiers."""
        keys, depths, tiers = self._taken(count)
        if count < 0:

            def again() -> None:
                more = self._taken(kernels.query_shards(self._ctx, local, ntiers))
                keys.extend(more[0])
                depths.extend(more[1])
                tiers.extend(more[2])

            self._retry(again)
        return keys, depths, tiers

    # -- shards that did not answer -----------------------------------------------------------

    def _retry(self, ask: Callable[[], Any]) -> None:
        """Mend every shard whose last answer was a failure and ``ask`` again, only those, until each
        answered or was given up; shards that answered keep what they wrote."""
        state = self._state
        try:
            for _ in range(PATIENT_QUERIES):
                pending = False
                for shard in range(self.control.shards):
                    if not state[shard, kernels.ASK]:
                        continue
                    code = int(state[shard, kernels.STATUS])
                    if code == kernels.OK:
                        self._torn.discard(shard)
                        state[shard, kernels.ASK] = 0
                    elif self._mend(shard, code):
                        pending = True
                    else:
                        state[shard, kernels.ASK] = 0
                if not pending:
                    return
                ask()
            for shard in range(self.control.shards):
                if state[shard, kernels.ASK] and state[shard, kernels.STATUS] != kernels.OK:
                    self._give_up(shard, "writer-stuck")
        finally:
            state[:, kernels.ASK] = 1

    def _mend(self, shard: int, code: int) -> bool:
        """Act on one shard's failure; False when the shard is given up for this query."""
        if code == kernels.STALE_TABLE:
            self._remap(shard)  # the writer published a new table since the tables were taken
            return True
        if code == kernels.ROWS_CHANGED and self._read_rows(shard):
            return True  # workers joined or left: named through the new rows, asked again (up to PATIENT_QUERIES)
        self.writer_checks += 1  # a slot or the rows left mid-write
        if not self._writer_alive(shard):
            self._give_up(shard, "writer-dead")
            return False
        os.sched_yield()  # on a small machine the preempted writer may need this core
        return True

    def _give_up(self, shard: int, reason: str) -> None:
        if shard not in self._torn:
            log.warning("shard unreadable shard=%d reason=%s", shard, reason)
        self._torn.add(shard)

    def _writer_alive(self, shard: int) -> bool:
        """Whether the shard's applier, as its control block names it, is a live process."""
        pid = self.control.pid(shard)
        if pid <= 0 or self.control.status(shard) == STATUS_STOPPED:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # alive, owned by someone else
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")  # killed, not yet reaped
        return True

    # -- tables and bit maps ------------------------------------------------------------------

    def _remap(self, shard: int) -> None:
        """Map the shard's newest table when its epoch moved."""
        for _ in range(REMAP_ATTEMPTS):
            epoch = self.control.epoch(shard)
            if epoch == self._epochs[shard]:
                return
            try:
                segment = Segment.attach(self.control.segment_name(shard), writable=False)
            except FileNotFoundError:
                continue  # replaced again between reading the name and opening it
            current = self._segments[shard]
            self._segments[shard], self._epochs[shard] = segment, epoch
            self._set_table(shard, segment.words)
            if current is not None:
                current.close()  # its address left the context above: no kernel reads it again
            return
        log.warning("shard segment kept moving shard=%d attempts=%d", shard, REMAP_ATTEMPTS)

    def _read_rows(self, shard: int) -> bool:
        """Copy the shard's rows at one generation into the bit maps; False when the generation kept moving.
        Only the rows in use before and now are touched: with workers joining fast, this sits between a
        shard's walks."""
        generation, count = kernels.read_rows(self._words, shard, self._copy)
        if generation < 0:
            return False
        copy, first = self._copy[:count], shard * self._rows
        bits = np.flatnonzero(copy[:, _ROW_USED])
        workers = list(zip(copy[bits, _ROW_ID].tolist(), copy[bits, _ROW_RANK].tolist(), strict=True))
        keys, bit_keys = self._keys, self._bit_keys
        for bit in self._used[shard][0]:
            keys[first + bit] = None
            bit_keys[first + bit] = -1
        key_hashes = self._key_hashes
        for bit, worker in zip(bits.tolist(), workers, strict=True):
            keys[first + bit] = worker
            key_hashes[first + bit] = hash(worker)
            bit_keys[first + bit] = first + bit
        self._used[shard] = (bits.tolist(), workers)
        if self._slots is not None:
            self._map_slots(shard)
        self._state[shard, kernels.GENERATION] = generation
        return True

    def _follow(self, slots: WorkerSlots) -> None:
        """Make every shard's bit -> slot map follow ``slots``, and say so in the context, unless they do
        already (a version names one numbering: ``WorkerSlots``)."""
        if slots.version == self._slots_version:
            return
        self._slots, self._slots_version = slots, slots.version
        for shard in range(self.control.shards):
            self._map_slots(shard)
        self._ctx[kernels.CTX_MAPPED] = slots.version

    def _map_slots(self, shard: int) -> None:
        """The shard's bit -> slot map from its rows as last read, for the current ``WorkerSlots``."""
        assert self._slots is not None
        first = shard * self._rows
        bit_slots = self._bit_slots[first : first + self._rows]
        bit_slots[:] = -1
        get = self._slots.get
        for bit, worker in zip(*self._used[shard], strict=True):
            slot = get(worker)
            if slot is not None:
                bit_slots[bit] = slot

    def _set_table(self, shard: int, words: Table) -> None:
        """Name ``words`` as the shard's table in the context, with the work buffers wide enough for it."""
        self._nwords[shard] = int(words[H_NWORDS])
        nwords = max(self._nwords)
        if self._work.size < TIERS * nwords * 64 or self._scratch.size < kernels.scratch_words(
            TIERS, nwords, SCRATCH_BLOCKS
        ):
            self._work = np.empty(TIERS * nwords * 64, dtype=np.int64)
            self._scratch = np.empty(kernels.scratch_words(TIERS, nwords, SCRATCH_BLOCKS), dtype=np.uint64)
            ctx = self._ctx
            ctx[kernels.CTX_WORK], ctx[kernels.CTX_WORK + 1] = self._work.ctypes.data, self._work.size
            ctx[kernels.CTX_SCRATCH], ctx[kernels.CTX_SCRATCH + 1] = self._scratch.ctypes.data, self._scratch.size
        self._ctx[kernels.CTX_NWORDS] = nwords
        at = kernels.CTX_TABLES + 2 * shard
        self._ctx[at], self._ctx[at + 1] = words.ctypes.data, words.size

    def close(self) -> None:
        with self._lock:  # a decision walking on another thread ends before the mappings go
            self._closed = True
            self._ctx[kernels.CTX_MAPPED] = 0  # a router walking by the context alone comes to overlaps_and
        self._ctx[kernels.CTX_SHARDS] = 0  # a query after close walks nothing and reads no mapping
        for shard, segment in enumerate(self._segments):
            self._set_table(shard, self._no_table)
            if segment is not None:
                segment.close()
        self._segments = [None] * self.control.shards
        self._words = self._no_table
        self.control.close()
