"""The compiled loops of the shared-memory index: table writes under a per-slot seqlock, and the walk.

Everything here runs once per block, so it is numba, over arrays laid out by ``layout.py``
(``docs/shm-engine.md``). Rules that hold for every function in this file:

- numpy arrays in; scalars or preallocated arrays out; no Python objects, no logging. Two exceptions,
  both on the read side: the query kernels take the reader's context (``CTX_*``), an ``int64`` array of
  the addresses of the tables, the control segment and the reader's buffers, rebuilt here with
  ``carray`` (numba dispatches read-only ``memoryview`` arrays, and tuples of them, on its slow path:
  1.1-1.3 µs a call against 0.4); and ``match_words`` / ``match_shards`` build ``find_matches``' dict
  through the CPython API (``_dict_new`` / ``_dict_set`` / ``_dict_put``), so they hold the GIL;
- integers taken from u64 words become ``np.int64`` explicitly: numba keeps ``int(u64)`` unsigned, and
  a u64 unified with a signed value (a ``-1`` "absent") silently becomes float64;
- no allocation inside a per-block loop;
- a shard table has one writer (its applier); every store to a slot a reader may see sits between the
  slot's version going odd and going even again, with a fence on each side (``_seqlocked_store``);
- every shared word a reader looks at, and every word the writer stores under the seqlock, goes through
  ``_load`` / ``_store`` (atomic acquire / release): plain loads from a read-only array may be treated as
  invariant and hoisted out of the retry loop;
- readers never write to a shard table, not even a counter; a read is version, fence, data, fence,
  version, retried while the versions differ or are odd; when the version stays odd for
  ``STUCK_SPINS`` reads the kernel returns to its caller, which asks whether the shard's writer is still
  alive (``index/reader.py``): a dead writer's shard is reported recovering at once, a live one that was
  preempted mid-write is waited for, up to ``MAX_STUCK_READS`` reads in all;
- while a table or private map is being copied into its successor (``growth.Growth``), every write to
  one of its slots or rows also sets that slot's or row's bit in the writer's dirty bitmap (``_mark``:
  word 0 counts the bits set, bit ``i`` of word ``1 + i // 64`` is slot or row ``i``), so the copy can
  run beside the writer and be corrected afterwards for exactly what the writer changed
  (``reconcile_slots`` / ``reconcile_rows``); the bitmap's address is the table's ``H_DIRTY`` word or the
  map's ``M_DIRTY``, 0 when no growth runs (while the successor is still being populated, the marks go to a
  bitmap the copy then discards);
- which worker a mask bit names (the shard's worker rows, in the control segment) changes only inside
  the shard's rows generation window (``begin_rows_change`` / ``end_rows_change``: odd, rows, even). A
  reader copies the rows once per generation (``read_rows``: generation, rows, same generation) into its
  bit map, and ``query_shards`` / ``overlap_shards`` accept a walk only when the generation read before
  and after it is the map's: a walk's bits are never attributed to a row's next owner.

The fences compile to no instruction on x86-64 (TSO keeps loads with loads and stores with stores in
order); they stop LLVM from moving the data accesses across the version accesses, and emit the needed
barriers on AArch64 (``spec/shm-engine.md`` §3.5).

The applier's private maps are open addressing tables of ``[key, tag, value, stamp, parent]`` rows: the
engine map, engine hash → sequence hash, and ``refs``, the count of a holder's engine hashes naming one
sequence, kept only where that count is 2 or more (a set mask bit is the count of 1). A holder is
``bit * TIERS + tier``: one worker in one tier of this shard. The tag is ``holder + 1`` in its low
``HOLDER_BITS`` (a tag of 0: an empty row; ``TOMB``: a deleted one) and, in the engine map, the row's links
above them (``HAS_PARENT``: it has a parent; ``CHILDREN``: how many of the holder's rows name it as
parent). Stamp, parent and links serve the index cap (``evict``), and only in the engine map: when the row
was last stored (``emeta[M_STAMP]``, the writer's batch count) and the engine hash it was stored under.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import typeof, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.numpy_support import carray

from .._jit import holds_gil, inlined, kernel
from ..events.packed import REMOVED, STORED_UNDER
from ..hashing._xxh3 import chain_step
from .layout import (
    C_ROWS,
    C_SHARDS,
    GROWING_LOAD,
    H_CAPACITY,
    H_DIRTY,
    H_EPOCH,
    H_LIVE,
    H_NWORDS,
    H_TIERS,
    H_TOMBS,
    H_USED,
    HEADER_WORDS,
    MAP_GROWING_LOAD,
    MAP_MAX_LOAD,
    MAX_LOAD,
    S_EPOCH,
    S_NWORDS,
    S_ROWS_GEN,
    SHARD_BLOCK_WORDS,
    SLOT_MASKS,
    SLOT_VERSION,
    TIERS,
    W_DP_RANK,
    W_IN_USE,
    W_WORKER_ID,
    WORKER_ROW_WORDS,
    ZERO_KEY,
)

__all__ = [
    "ASK",
    "BLOCK_NOT_FOUND",
    "CHILD",
    "CHILDREN",
    "CTX_ANSWER",
    "CTX_BIT_KEYS",
    "CTX_BIT_SLOTS",
    "CTX_CONTROL",
    "CTX_FOUND",
    "CTX_KEYS",
    "CTX_KEY_HASHES",
    "CTX_MAPPED",
    "CTX_NWORDS",
    "CTX_QUERY",
    "CTX_ROWS",
    "CTX_SCRATCH",
    "CTX_SHARDS",
    "CTX_STATE",
    "CTX_TABLES",
    "CTX_WORK",
    "EVICT_LRU",
    "EVICT_UNTRUSTED",
    "GENERATION",
    "HAS_PARENT",
    "HOLDER",
    "HOLDER_BITS",
    "INVALID_SEQUENCE",
    "LIST_REFUSED",
    "MAP_ROW_WORDS",
    "MAP_TAG",
    "MAX_READ_RETRIES",
    "MAX_STUCK_READS",
    "META_WORDS",
    "M_CAPACITY",
    "M_DIRTY",
    "M_ENTRIES",
    "M_STAMP",
    "M_TOMBS",
    "M_USED",
    "NEED_ROOM",
    "OK",
    "PARENT_NOT_FOUND",
    "ROWS_CHANGED",
    "ROWS_MOVING",
    "ROWS_RETRIES",
    "SLOT_STUCK",
    "STALE_TABLE",
    "STATUS",
    "STUCK_SPINS",
    "apply_run",
    "begin_rows_change",
    "clear_holder",
    "copy_rows",
    "copy_slots",
    "end_rows_change",
    "evict",
    "init_map",
    "lookup",
    "match_list",
    "match_shards",
    "match_words",
    "overlap_shards",
    "query_shards",
    "read_rows",
    "reconcile_rows",
    "reconcile_slots",
    "remove",
    "scratch_words",
    "store",
    "touch",
    "walk",
]


Table = npt.NDArray[np.uint64]
Map = npt.NDArray[np.uint64]
Meta = npt.NDArray[np.int64]
Counts = npt.NDArray[np.int64]
TierCounts = npt.NDArray[np.int64]
"""The writer's cached blocks, ``[TIERS, rows]``: ``cached[tier, bit]`` distinct blocks (sequence hashes)
the holder ``bit * TIERS + tier`` holds, i.e. its set mask bits in that tier's masks. Kept for every tier
(layout 3): a count bumped only where a mask bit flips costs nothing on the common path either way."""


OK: Final = 0
PARENT_NOT_FOUND: Final = 1
INVALID_SEQUENCE: Final = 2
NEED_ROOM: Final = 3
"""``store`` changed nothing: a table or map would pass ``MAX_LOAD``; the caller grows it and calls again."""
BLOCK_NOT_FOUND: Final = 4
"""``apply_run``'s status of a Removed event naming a hash the holder does not have."""
MAX_STUCK_READS: Final = 1 << 27
"""Reads that see one slot at the same odd version before the reader gives the shard up even though its
writer is alive, about half a second. A live writer holds a slot odd for nanoseconds, but the scheduler
can preempt it inside that window for a time slice or more (a million reads, a few milliseconds, was
seen to be too few on a loaded 2-core machine). A dead writer's shard is given up at the first check."""
STUCK_SPINS: Final = 1 << 12
"""Reads at one odd version (of a slot, or of the rows generation) after which the kernel returns to the
reader to check the shard's writer: tens of microseconds, far beyond a live writer's window, and short
enough that a dead writer costs a query almost nothing."""
ROWS_RETRIES: Final = 64
"""Copies ``read_rows`` makes while the rows generation keeps moving under it (workers joining and leaving
faster than one copy, which a real fleet never does) before it returns ``ROWS_MOVING``. A query whose walks
keep meeting ``ROWS_CHANGED`` reads the rows and walks again, up to ``reader.PATIENT_QUERIES`` times."""
SLOT_STUCK: Final = -1
"""A shard's query status when a slot stayed at one odd version for ``STUCK_SPINS`` reads."""
ROWS_MOVING: Final = -2
"""... when the rows generation stayed odd for ``STUCK_SPINS`` reads (``read_rows``: or moved
``ROWS_RETRIES`` times)."""
STALE_TABLE: Final = -3
"""... when the table is not the shard's current one: the reader remaps and asks again."""
ROWS_CHANGED: Final = -4
"""... when the rows generation is not the one the reader's bit map was read at, or moved during the walk
(a worker joined or left): the reader reads the rows again (``read_rows``) and asks again."""
GENERATION, ASK, STATUS = 0, 1, 2
"""Columns of the reader's per-shard ``state`` given to ``query_shards`` / ``overlap_shards``: the rows
generation its bit map was read at, whether to walk the shard, and the shard's answer (``OK`` or a
failure code)."""
MAX_READ_RETRIES: Final = 1 << 28
"""Retries of one slot whose version keeps moving (a live writer rewriting it flat out) before the reader
gives up anyway: seconds of starvation, a bound rather than an expectation."""

M_CAPACITY, M_USED, M_TOMBS, M_STAMP, M_ENTRIES, M_DIRTY = 0, 1, 2, 3, 4, 5
"""Private map meta words: capacity, used rows (live + deleted), deleted rows, (engine map) the stamp
stores write into rows, (the refs' meta, which ``_hold`` and ``_release`` take anyway) the shard's
(holder, block) entries, the sum of ``cached``: counted where a mask bit flips, so the writer never sums
it in Python; and the address of the dirty bitmap while the map is being copied (0 otherwise)."""
META_WORDS: Final = 6
MAP_KEY, MAP_TAG, MAP_VALUE, MAP_STAMP, MAP_PARENT = range(5)
"""Private map row words (see the module docstring)."""
MAP_ROW_WORDS: Final = 5
"""40 bytes a row: the links share the holder's word. A sixth word of their own made the engine map, most
of the index's memory, a sixth larger."""
HOLDER_BITS: Final = 20
HOLDER: Final = np.uint64((1 << HOLDER_BITS) - 1)
"""``MAP_TAG`` mask: ``holder + 1`` (at most ``WORKER_ROWS * TIERS``, below the mask's all-ones of ``TOMB``)."""
HAS_PARENT: Final = np.uint64(1 << 63)
"""``MAP_TAG`` flag: ``MAP_PARENT`` names the engine hash the row was stored under."""
CHILD: Final = np.uint64(1 << HOLDER_BITS)
CHILDREN: Final = np.uint64((1 << 63) - (1 << HOLDER_BITS))
"""``MAP_TAG`` mask: rows of the holder stored under this one, in units of ``CHILD``; 0 makes the row a
leaf, evicted first."""
TOMB: Final = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
_ONE: Final = np.uint64(1)
_ZERO: Final = np.uint64(0)
_KEY_MIX: Final = np.uint64(0x9E37_79B9_7F4A_7C15)
_SEED: Final = np.uint64(1337)
_ZERO_KEY: Final = np.uint64(ZERO_KEY)


def _fence_typer(typingctx: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("acq_rel")
        return context.get_dummy_value()

    return types.none(), codegen


_fence = cast(Callable[[], None], intrinsic(_fence_typer))


def _load_typer(typingctx: Any, array: Any, index: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]])  # type: ignore[no-untyped-call]
        return builder.load_atomic(pointer, "acquire", 8)

    return array.dtype(array, index), codegen


def _store_typer(typingctx: Any, array: Any, index: Any, value: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]])  # type: ignore[no-untyped-call]
        builder.store_atomic(args[2], pointer, "release", 8)
        return context.get_dummy_value()

    return types.none(array, index, array.dtype), codegen


_load = cast(Callable[[Table, int], np.uint64], intrinsic(_load_typer))
"""An acquire load of one shared word: never merged with another load or hoisted out of a retry loop
(numba marks a read-only array's plain loads invariant, which let LLVM spin on one stale version)."""
_store = cast(Callable[[Table, int, np.uint64], None], intrinsic(_store_typer))
"""A release store of one shared word: the writer's side of the same protocol."""


def _prefetch_typer(typingctx: Any, array: Any, index: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]])  # type: ignore[no-untyped-call]
        i32 = ir.IntType(32)
        prefetch = ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32])
        intrinsic_ = cgutils.get_or_insert_function(builder.module, prefetch, "llvm.prefetch.p0")  # type: ignore[no-untyped-call]
        builder.call(intrinsic_, [pointer, i32(0), i32(3), i32(1)])  # read, keep in every cache level, data
        return context.get_dummy_value()

    return types.none(array, index), codegen


_prefetch_line = cast(Callable[[npt.NDArray[Any], int], None], intrinsic(_prefetch_typer))
"""A hint to bring one word's cache line in: unlike a load it never holds up the instructions after it
(a load that misses does, once the reorder buffer fills, which a few chained hashes do)."""


def _lowest_bit_typer(typingctx: Any, word: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        cttz = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i64, [i64, ir.IntType(1)]), "llvm.cttz.i64"
        )  # type: ignore[no-untyped-call]
        return builder.call(cttz, [args[0], ir.IntType(1)(1)])  # nonzero word: the result is defined

    return types.int64(types.uint64), codegen


_lowest_bit = cast(Callable[[np.uint64], int], intrinsic(_lowest_bit_typer))
"""The index of the lowest set bit of a nonzero word (one ``tzcnt``/``bsf``)."""
_i64 = cast(Callable[[object], int], np.int64)
"""``np.int64``, typed for mypy as returning ``int`` (numba sees the numpy type itself)."""


# -- shard table ------------------------------------------------------------------------------


@inlined
def _tiers(table: Table) -> int:
    """The tiers the table's slots have masks for (``layout.row_words``); a slower one is empty."""
    return _i64(table[H_TIERS])


@inlined
def _row_words(table: Table) -> int:
    return SLOT_MASKS + _tiers(table) * _i64(table[H_NWORDS])


@inlined
def _table_key(seq: np.uint64) -> np.uint64:
    return seq if seq != _ZERO else _ZERO_KEY


@inlined
def _find(table: Table, key: np.uint64) -> int:
    """The writer's probe (no seqlock: it is the only writer). -1 when absent."""
    mask = np.uint64(table[H_CAPACITY] - _ONE)
    width = _row_words(table)
    slot = _i64(key & mask)
    while True:
        found = table[HEADER_WORDS + slot * width]
        if found == key:
            return slot
        if found == _ZERO:
            return -1
        slot = _i64((np.uint64(slot) + _ONE) & mask)


@inlined
def _is_tomb(table: Table, base: int, width: int) -> bool:
    for w in range(base + SLOT_MASKS, base + width):  # noqa: SIM110 (numba compiles no generator)
        if table[w] != _ZERO:
            return False
    return True


@inlined
def _claim(table: Table, key: np.uint64) -> int:
    """The slot of ``key``, inserting it (into the first tombstone passed, else the empty slot ending the
    probe) when absent. The caller has made sure the table has room."""
    mask = np.uint64(table[H_CAPACITY] - _ONE)
    width = _row_words(table)
    slot = _i64(key & mask)
    reuse = -1
    while True:
        base = HEADER_WORDS + slot * width
        found = table[base]
        if found == key:
            return slot
        if found == _ZERO:
            break
        if reuse < 0 and _is_tomb(table, base, width):
            reuse = slot
        slot = _i64((np.uint64(slot) + _ONE) & mask)
    if reuse >= 0:
        slot = reuse
        table[H_TOMBS] -= _ONE
    else:
        table[H_USED] += _ONE
    base = HEADER_WORDS + slot * width
    _seqlocked_store(table, base, base, key)
    return slot


@inlined
def _seqlocked_store(table: Table, base: int, word: int, value: np.uint64) -> None:
    """Write one word of the slot at ``base`` inside its version window: odd, the word, even again."""
    version = table[base + SLOT_VERSION]
    _store(table, base + SLOT_VERSION, version + _ONE)
    _fence()
    _store(table, word, value)
    _fence()
    _store(table, base + SLOT_VERSION, version + np.uint64(2))
    dirty = _i64(table[H_DIRTY])
    if dirty != 0:
        _mark(dirty, (base - HEADER_WORDS) // _row_words(table))


@inlined
def _mark(dirty: int, index: int) -> None:
    """Set slot or row ``index``'s bit in the dirty bitmap at address ``dirty`` (module rules)."""
    word = 1 + index // 64
    bits = carray(_words_at(dirty), (word + 1,))
    bit = _ONE << np.uint64(index % 64)
    if bits[word] & bit == _ZERO:
        bits[word] |= bit
        bits[0] += _ONE


@inlined
def _map_mark(meta: Meta, row: int) -> None:
    """A private map's row was written: its dirty bit, while the map is being copied."""
    if meta[M_DIRTY] != 0:
        _mark(meta[M_DIRTY], row)


@inlined
def _limit(dirty: int) -> float:
    """The load a table may be filled to: ``GROWING_LOAD`` while its successor is being built."""
    return GROWING_LOAD if dirty != 0 else MAX_LOAD


@inlined
def _map_limit(dirty: int) -> float:
    """The load a private map may be filled to (``layout.MAP_MAX_LOAD``)."""
    return MAP_GROWING_LOAD if dirty != 0 else MAP_MAX_LOAD


@inlined
def _set_bit(table: Table, slot: int, tier: int, bit: int) -> None:
    width = _row_words(table)
    base = HEADER_WORDS + slot * width
    was_tomb = _is_tomb(table, base, width)
    word = base + SLOT_MASKS + tier * _i64(table[H_NWORDS]) + bit // 64
    _seqlocked_store(table, base, word, table[word] | (_ONE << np.uint64(bit % 64)))
    if was_tomb:
        table[H_LIVE] += _ONE


@inlined
def _clear_bit(table: Table, slot: int, tier: int, bit: int) -> None:
    width = _row_words(table)
    base = HEADER_WORDS + slot * width
    word = base + SLOT_MASKS + tier * _i64(table[H_NWORDS]) + bit // 64
    _seqlocked_store(table, base, word, table[word] & ~(_ONE << np.uint64(bit % 64)))
    if _is_tomb(table, base, width):  # the soft tombstone: key kept, no holder left
        table[H_LIVE] -= _ONE
        table[H_TOMBS] += _ONE


@inlined
def _release_bit(table: Table, seq: np.uint64, tier: int, bit: int) -> None:
    slot = _find(table, _table_key(seq))
    if slot >= 0:
        _clear_bit(table, slot, tier, bit)


# -- private maps -----------------------------------------------------------------------------


@inlined
def _map_home(key: np.uint64, holder: int, mask: np.uint64) -> int:
    mixed = (key ^ (np.uint64(holder + 1) * _KEY_MIX)) * _KEY_MIX
    return _i64((mixed ^ (mixed >> np.uint64(29))) & mask)


@inlined
def _map_find(rows: Map, meta: Meta, key: np.uint64, holder: int) -> int:
    mask = np.uint64(meta[M_CAPACITY] - 1)
    tag = np.uint64(holder + 1)
    row = _map_home(key, holder, mask)
    while True:
        owner = rows[row, MAP_TAG]
        if owner == _ZERO:
            return -1
        if owner & HOLDER == tag and rows[row, MAP_KEY] == key:
            return row
        row = _i64((np.uint64(row) + _ONE) & mask)


@inlined
def _map_insert(rows: Map, meta: Meta, key: np.uint64, holder: int, value: np.uint64) -> int:
    """Insert a key known to be absent, into the first deleted or empty row of its probe."""
    mask = np.uint64(meta[M_CAPACITY] - 1)
    row = _map_home(key, holder, mask)
    while rows[row, MAP_TAG] != _ZERO and rows[row, MAP_TAG] != TOMB:
        row = _i64((np.uint64(row) + _ONE) & mask)
    if rows[row, MAP_TAG] == TOMB:
        meta[M_TOMBS] -= 1
    else:
        meta[M_USED] += 1
    rows[row, MAP_KEY] = key
    rows[row, MAP_TAG] = np.uint64(holder + 1)  # no links yet
    rows[row, MAP_VALUE] = value
    _map_mark(meta, row)
    return row


@inlined
def _map_delete(rows: Map, meta: Meta, row: int) -> None:
    rows[row, MAP_TAG] = TOMB
    meta[M_TOMBS] += 1
    _map_mark(meta, row)


@kernel
def init_map(rows: Map, meta: Meta) -> None:
    """An empty map over ``rows``, which the caller has zeroed (fresh anonymous pages, ``np.zeros``); its
    length a power of two. Clearing it again here was a memset of the whole map on every growth."""
    meta[M_CAPACITY] = rows.shape[0]
    meta[M_USED] = 0
    meta[M_TOMBS] = 0


@inlined
def _mask_word(table: Table, slot: int, tier: int, bit: int) -> int:
    return HEADER_WORDS + slot * _row_words(table) + SLOT_MASKS + tier * _i64(table[H_NWORDS]) + bit // 64


@inlined
def _holds(table: Table, slot: int, tier: int, bit: int) -> bool:
    return bool((table[_mask_word(table, slot, tier, bit)] >> np.uint64(bit % 64)) & _ONE == _ONE)


@inlined
def _hold(table: Table, refs: Map, rmeta: Meta, cached: TierCounts, seq: np.uint64, bit: int, tier: int) -> None:
    """One more of the holder's engine hashes names ``seq``. The first sets the mask bit; only a second
    (the same content under two engine hashes, rare) needs a count, kept in ``refs``: stores touch
    nothing but the table in the common case."""
    slot = _claim(table, _table_key(seq))
    if not _holds(table, slot, tier, bit):
        _set_bit(table, slot, tier, bit)
        cached[tier, bit] += 1
        rmeta[M_ENTRIES] += 1
        return
    holder = bit * TIERS + tier
    row = _map_find(refs, rmeta, seq, holder)
    if row < 0:
        _map_insert(refs, rmeta, seq, holder, np.uint64(2))
    else:
        refs[row, 2] += _ONE
        _map_mark(rmeta, row)


@inlined
def _release(table: Table, refs: Map, rmeta: Meta, cached: TierCounts, seq: np.uint64, bit: int, tier: int) -> None:
    """One fewer of the holder's engine hashes names ``seq``; the last one clears the mask bit."""
    if rmeta[M_USED] > rmeta[M_TOMBS]:  # some content is held twice somewhere: look for a count
        holder = bit * TIERS + tier
        row = _map_find(refs, rmeta, seq, holder)
        if row >= 0:
            if refs[row, 2] > np.uint64(2):
                refs[row, 2] -= _ONE
                _map_mark(rmeta, row)
            else:
                _map_delete(refs, rmeta, row)
            return
    slot = _find(table, _table_key(seq))
    if slot >= 0 and _holds(table, slot, tier, bit):
        _clear_bit(table, slot, tier, bit)
        cached[tier, bit] -= 1
        rmeta[M_ENTRIES] -= 1


# -- events -----------------------------------------------------------------------------------


@kernel
def store(
    table: Table,
    emap: Map,
    emeta: Meta,
    refs: Map,
    rmeta: Meta,
    cached: TierCounts,
    bit: int,
    tier: int,
    has_parent: bool,
    parent: np.uint64,
    engine: npt.NDArray[np.uint64],
    local: npt.NDArray[np.uint64],
) -> int:
    """A Stored event of one holder: validated whole first, then applied (all or nothing).

    Returns ``OK``, ``PARENT_NOT_FOUND``, ``INVALID_SEQUENCE`` (the parent is one of the blocks, or an
    engine hash repeats) or ``NEED_ROOM`` (checked first, so nothing is half applied).
    """
    return _store_event(table, emap, emeta, refs, rmeta, cached, bit, tier, has_parent, parent, engine, local)


@inlined
def _store_event(
    table: Table,
    emap: Map,
    emeta: Meta,
    refs: Map,
    rmeta: Meta,
    cached: TierCounts,
    bit: int,
    tier: int,
    has_parent: bool,
    parent: np.uint64,
    engine: npt.NDArray[np.uint64],
    local: npt.NDArray[np.uint64],
) -> int:
    """``store``'s body, shared with ``apply_run``."""
    holder = bit * TIERS + tier
    n = engine.size
    if (
        _i64(table[H_USED]) + n > _i64(table[H_CAPACITY]) * _limit(_i64(table[H_DIRTY]))
        or emeta[M_USED] + n > emeta[M_CAPACITY] * _map_limit(emeta[M_DIRTY])
        or rmeta[M_USED] + n > rmeta[M_CAPACITY] * _map_limit(rmeta[M_DIRTY])
    ):
        return NEED_ROOM
    ordered = np.sort(engine)
    for i in range(n):
        if (has_parent and engine[i] == parent) or (i > 0 and ordered[i] == ordered[i - 1]):
            return INVALID_SEQUENCE
    seq = _ZERO
    stamp = np.uint64(emeta[M_STAMP])
    above = -1  # the row the next block is stored under
    if has_parent:
        above = _map_find(emap, emeta, parent, holder)
        if above < 0:
            return PARENT_NOT_FOUND
        seq = emap[above, 2]
        emap[above, MAP_STAMP] = stamp  # a store under it: the engine just used its prefix
        _map_mark(emeta, above)
    seqs = np.empty(n, dtype=np.uint64)
    for i in range(n):
        seq = chain_step(seq, local[i], _SEED) if (has_parent or i > 0) else local[i]
        seqs[i] = seq
    _prefetch(table, emap, emeta, engine, seqs, holder)
    linked, above_hash = has_parent, parent
    for i in range(n):  # hot path: a few probes per block, their cache lines already on their way
        seq = seqs[i]
        row = _map_find(emap, emeta, engine[i], holder)
        if row >= 0:
            emap[row, MAP_STAMP] = stamp
            _map_mark(emeta, row)
            previous = emap[row, 2]
            if previous != seq:  # the engine re-used the hash: it moved
                emap[row, 2] = seq
                _hold(table, refs, rmeta, cached, seq, bit, tier)
                _release(table, refs, rmeta, cached, previous, bit, tier)
                _unlink(emap, emeta, row, holder)
                _link(emap, emeta, row, linked, above_hash, above)
        else:
            row = _map_insert(emap, emeta, engine[i], holder, seq)
            emap[row, MAP_STAMP] = stamp
            _link(emap, emeta, row, linked, above_hash, above)
            _hold(table, refs, rmeta, cached, seq, bit, tier)
        linked, above_hash, above = True, engine[i], row
    return OK


@inlined
def _link(emap: Map, emeta: Meta, row: int, linked: bool, above_hash: np.uint64, above: int) -> None:
    """Record that ``row`` was stored under ``above_hash`` (at ``above``, -1 if absent), or under no parent.
    The caller marked ``row`` already."""
    if linked:
        emap[row, MAP_PARENT] = above_hash
        emap[row, MAP_TAG] |= HAS_PARENT
        if above >= 0:
            emap[above, MAP_TAG] += CHILD
            _map_mark(emeta, above)
    else:
        emap[row, MAP_TAG] &= ~HAS_PARENT


@inlined
def _unlink(emap: Map, emeta: Meta, row: int, holder: int) -> int:
    """``row`` leaves its parent (removed, evicted or moved): one child fewer there. Returns the parent's row
    if that made it a leaf, else -1. A parent removed and stored again starts at 0 children while older
    children still name it, so a count never goes below 0 (it may read low: a row taken for a leaf early)."""
    if emap[row, MAP_TAG] & HAS_PARENT == _ZERO:
        return -1
    above = _map_find(emap, emeta, emap[row, MAP_PARENT], holder)
    if above < 0 or emap[above, MAP_TAG] & CHILDREN == _ZERO:
        return -1
    emap[above, MAP_TAG] -= CHILD
    _map_mark(emeta, above)
    return above if emap[above, MAP_TAG] & CHILDREN == _ZERO else -1


@inlined
def _prefetch(
    table: Table, emap: Map, emeta: Meta, engine: npt.NDArray[np.uint64], seqs: npt.NDArray[np.uint64], holder: int
) -> None:
    """Prefetch every block's home row in the engine map and home slot in the table in one pass, so their
    cache misses overlap instead of queueing behind each other (spec §3.3). Prefetches, not loads: a load
    that misses holds up what follows once the reorder buffer fills, and 80 blocks' 160 misses fill it
    (``tools/bench_ingest.py``'s workload in process, six interleaved pairs: from 2 % more to 9 % less a block)."""
    map_mask = np.uint64(emeta[M_CAPACITY] - 1)
    table_mask = np.uint64(table[H_CAPACITY] - _ONE)
    width = _row_words(table)
    rows = emap.reshape(emap.size)
    for i in range(engine.size):
        _prefetch_line(rows, _map_home(engine[i], holder, map_mask) * MAP_ROW_WORDS + MAP_TAG)
        if seqs.size:
            _prefetch_line(table, HEADER_WORDS + _i64(_table_key(seqs[i]) & table_mask) * width)


@kernel
def remove(
    table: Table,
    emap: Map,
    emeta: Meta,
    refs: Map,
    rmeta: Meta,
    cached: TierCounts,
    bit: int,
    tier: int,
    engine: npt.NDArray[np.uint64],
) -> int:
    """A Removed event: every known hash released; returns the index of the first unknown one, or -1."""
    return _remove_event(table, emap, emeta, refs, rmeta, cached, bit, tier, engine)


@inlined
def _remove_event(
    table: Table,
    emap: Map,
    emeta: Meta,
    refs: Map,
    rmeta: Meta,
    cached: TierCounts,
    bit: int,
    tier: int,
    engine: npt.NDArray[np.uint64],
) -> int:
    """``remove``'s body, shared with ``apply_run``."""
    holder = bit * TIERS + tier
    _prefetch(table, emap, emeta, engine, engine[:0], holder)
    first_missing = -1
    for i in range(engine.size):
        row = _map_find(emap, emeta, engine[i], holder)
        if row < 0:
            if first_missing < 0:
                first_missing = i
            continue
        seq = emap[row, 2]
        _unlink(emap, emeta, row, holder)
        _map_delete(emap, emeta, row)
        _release(table, refs, rmeta, cached, seq, bit, tier)
    return first_missing


@kernel
def apply_run(
    table: Table,
    emap: Map,
    emeta: Meta,
    refs: Map,
    rmeta: Meta,
    cached: TierCounts,
    bit: int,
    tier: int,
    kinds: npt.NDArray[np.uint8],
    parents: npt.NDArray[np.uint64],
    offsets: npt.NDArray[np.int64],
    engine: npt.NDArray[np.uint64],
    local: npt.NDArray[np.uint64],
    start: int,
    statuses: Counts,
) -> int:
    """Several Stored and Removed events of one holder in one call, from event ``start`` on, each exactly
    as ``store`` or ``remove`` would apply it: one call instead of one per event where engines send many
    small events (SGLang's one page per event, vLLM's multi-event batches).

    Event ``i`` is ``kinds[i]`` (``events/packed.py``: no ``CLEARED``) with ``parents[i]``, its engine hashes
    ``engine[offsets[i]:offsets[i + 1]]``; ``local`` holds the Stored events' local hashes, concatenated
    in order (a Removed event has none). ``statuses[i]`` gets ``store``'s status for a Stored event, and
    for a Removed one ``OK`` or ``BLOCK_NOT_FOUND`` (some hash unknown; the known ones are released).
    Returns the index of the first event that needs room (nothing of it applied: the caller grows the
    tables and calls again from there), or the number of events.
    """
    n = kinds.size
    first_local = 0
    for i in range(start):
        if kinds[i] != REMOVED:
            first_local += offsets[i + 1] - offsets[i]
    for i in range(start, n):
        blocks = engine[offsets[i] : offsets[i + 1]]
        if kinds[i] == REMOVED:
            missing = _remove_event(table, emap, emeta, refs, rmeta, cached, bit, tier, blocks)
            statuses[i] = OK if missing < 0 else BLOCK_NOT_FOUND
            continue
        hashes = local[first_local : first_local + blocks.size]
        status = _store_event(
            table,
            emap,
            emeta,
            refs,
            rmeta,
            cached,
            bit,
            tier,
            kinds[i] == STORED_UNDER,
            parents[i],
            blocks,
            hashes,
        )
        if status == NEED_ROOM:
            return i
        statuses[i] = status
        first_local += blocks.size
    return n


@kernel
def clear_holder(
    table: Table, emap: Map, emeta: Meta, refs: Map, rmeta: Meta, cached: TierCounts, bit: int, tier: int
) -> None:
    """Release everything one holder has (Cleared, clear_all_blocks, remove_worker): two scans of the maps."""
    tag = np.uint64(bit * TIERS + tier + 1)
    for row in range(refs.shape[0]):
        if refs[row, MAP_TAG] & HOLDER == tag:
            _map_delete(refs, rmeta, row)
    for row in range(emap.shape[0]):
        if emap[row, MAP_TAG] & HOLDER == tag:
            _map_delete(emap, emeta, row)
            _release(table, refs, rmeta, cached, emap[row, 2], bit, tier)


EVICT_UNTRUSTED, EVICT_LRU = 0, 1
"""Columns of ``evict``'s per-row counts: the entry went because its worker was not ``exact``, or because
it was the least recently stored among the rest."""


@inlined
def _heap_push(keys: Counts, rows: Counts, n: int, key: int, row: int) -> int:
    """Push onto the binary min-heap of ``n`` entries in ``keys`` / ``rows``; returns the new size."""
    i = n
    while i > 0:
        up = (i - 1) >> 1
        if keys[up] <= key:
            break
        keys[i], rows[i] = keys[up], rows[up]
        i = up
    keys[i], rows[i] = key, row
    return n + 1


@inlined
def _heap_pop(keys: Counts, rows: Counts, n: int) -> int:
    """Drop the heap's top (the caller read ``rows[0]``); returns the new size."""
    n -= 1
    key, row = keys[n], rows[n]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and keys[child + 1] < keys[child]:
            child += 1
        if keys[child] >= key:
            break
        keys[i], rows[i] = keys[child], rows[child]
        i = child
    keys[i], rows[i] = key, row
    return n


@inlined
def _recency(table: Table, emap: Map, matched: Table, row: int) -> int:
    """When the row was last stored (or stored under), or its block last matched, whichever is later."""
    stamp = emap[row, MAP_STAMP]
    if matched.size == 0:  # nothing was ever matched (``ShardWriter._matched``)
        return _i64(stamp)
    slot = _find(table, _table_key(emap[row, 2]))
    if slot >= 0 and matched[slot] > stamp:
        stamp = matched[slot]
    return _i64(stamp)


@kernel
def touch(table: Table, matched: Table, seqs: npt.NDArray[np.uint64], stamp: np.uint64) -> int:
    """Blocks a decision matched: each sequence hash's slot gets ``stamp`` in ``matched`` (the writer's
    private array beside the table, one word per slot). Returns how many distinct blocks were found.

    ``seqs`` may name a block more than once (the chains of prompts sharing a system prompt, as the front
    sends them): every call has a stamp of its own, so a slot already at ``stamp`` is a repeat and is
    counted once. Deduplicating here, a compare per block, is what let the front stop sorting the chains
    on its event loop (``Service.feed_matches``)."""
    found = 0
    for i in range(seqs.size):  # hot path: one probe per block
        slot = _find(table, _table_key(seqs[i]))
        if slot >= 0 and matched[slot] != stamp:
            matched[slot] = stamp
            found += 1
            if table[H_DIRTY] != _ZERO:  # the copy carries match stamps too
                _mark(_i64(table[H_DIRTY]), slot)
    return found


@kernel
def evict(
    table: Table,
    emap: Map,
    emeta: Meta,
    refs: Map,
    rmeta: Meta,
    cached: TierCounts,
    matched: Table,
    untrusted: npt.NDArray[np.uint8],
    entries: int,
    target: int,
    evicted: Counts,
    gone: Table,
) -> tuple[int, int]:
    """Drop (holder, block) entries until at most ``target`` remain of ``entries``, as a Removed event would
    (under the slots' seqlock, ``_release``): leaves first (rows no other row of the holder was stored
    under), of holders with ``untrusted[bit]`` set first, then the least recently stored or matched (the
    later of the row's stamp and ``matched[slot]``, its block's slot's last match, ``touch``). A leaf's parent
    becomes a candidate once its last child goes, so chains shrink from the tip and a prefix stays
    matchable to the end. Should a class's leaves run out first (only possible when moved hashes made
    the links circular), a second pass takes its oldest rows whatever their links: the bound always holds.

    ``evicted[bit, EVICT_UNTRUSTED | EVICT_LRU]`` counts the entries dropped (a row whose sequence another
    engine hash of the holder still names drops none). Every row deleted is also listed in ``gone`` as
    ``[holder, engine hash]`` (``holder = bit * TIERS + tier``), as far as it has rows: what a Removed event
    of that engine hash would name, for the recording (``ShardWriter.take_evicted``); an empty ``gone``
    lists nothing. Up to four scans of the engine map (untrusted leaves, untrusted rows, trusted leaves,
    trusted rows; a class with no entries is skipped) and one heap, allocated per call, not per block.
    Returns (the entries left, the rows deleted: more than ``gone`` holds when it was too short).
    """
    size = emap.shape[0]
    keys = np.empty(size, dtype=np.int64)
    rows = np.empty(size, dtype=np.int64)
    present = np.zeros(2, dtype=np.bool_)
    deleted = 0
    for bit in range(cached.shape[1]):
        for tier in range(TIERS):
            if cached[tier, bit] > 0:
                present[0 if untrusted[bit] else 1] = True
    for phase in range(4):
        trusted, leaves_only = phase // 2, phase % 2 == 0
        if entries <= target:
            break
        if not present[trusted]:
            continue
        n = 0
        for row in range(size):
            owner = emap[row, MAP_TAG]
            if owner == _ZERO or owner == TOMB:  # noqa: SIM109 (numba)
                continue
            if (untrusted[(_i64(owner & HOLDER) - 1) // TIERS] == 0) != (trusted == 1):
                continue
            if not (leaves_only and owner & CHILDREN != _ZERO):
                n = _heap_push(keys, rows, n, _recency(table, emap, matched, row), row)
        while n > 0 and entries > target:  # hot path: one heap pop and one release per entry
            row = rows[0]
            n = _heap_pop(keys, rows, n)
            holder = _i64(emap[row, MAP_TAG] & HOLDER) - 1
            bit, tier = holder // TIERS, holder % TIERS
            above = _unlink(emap, emeta, row, holder)
            if leaves_only and above >= 0:
                n = _heap_push(keys, rows, n, _recency(table, emap, matched, above), above)
            seq = emap[row, 2]
            if deleted < gone.shape[0]:
                gone[deleted, 0] = np.uint64(holder)
                gone[deleted, 1] = emap[row, MAP_KEY]
            deleted += 1
            _map_delete(emap, emeta, row)
            before = cached[tier, bit]
            _release(table, refs, rmeta, cached, seq, bit, tier)
            if cached[tier, bit] != before:
                entries -= 1
                evicted[bit, EVICT_LRU if trusted else EVICT_UNTRUSTED] += 1
    return entries, deleted


# -- growth -----------------------------------------------------------------------------------
# A table or map grows into a successor twice its size, built on the writer's helper threads while the
# writer goes on writing the old one (``growth.Growth``): ``copy_*`` copies every live slot or row and
# notes where it went (``where``, -1: nowhere); the writer's writes meanwhile mark their slots and rows
# dirty (``_mark``); ``reconcile_*`` then makes the successor agree with the old one on exactly those, in
# two passes, first dropping what was copied of each, then copying each again as it is now. The copy may
# read a slot or row mid-write: it is dirty, so the reconciliation overwrites what was read. A slot
# dropped in the first pass stays as a key without holders (a soft tombstone), which a later claim of
# that key reuses. Rounds repeat on the helpers while the writer dirties more (each shorter than
# the last); the writer reconciles the last, small one itself and publishes.


@inlined
def _next_dirty(word: int, bits: np.uint64) -> tuple[int, np.uint64]:
    """The index of the lowest bit of ``bits`` (word ``word`` of the bitmap) and the bits left after it."""
    return (word - 1) * 64 + _lowest_bit(bits), bits & (bits - _ONE)


@kernel
def copy_slots(
    old: Table, new: Table, old_matched: Table, new_matched: Table, where: Counts, start: int, end: int
) -> None:
    """Copy every live key of old slots ``start``...``end - 1`` with its masks and match stamp into the not
    yet published table ``new`` (which may have wider masks), noting each one's new slot in ``where``;
    tombstones are dropped, which is the compaction. Empty match arrays: no block was ever matched, nothing
    to carry. A whole copy is every range in turn (``growth.COPY_CHUNK``), the first into an empty ``new``."""
    old_width, new_width = _row_words(old), _row_words(new)
    carry = old_matched.size > 0
    for slot in range(start, end):
        base = HEADER_WORDS + slot * old_width
        key = old[base]
        if key == _ZERO or _is_tomb(old, base, old_width):
            continue
        moved = _place(new, key)
        where[slot] = moved
        _copy_mask_words(old, new, base, HEADER_WORDS + moved * new_width)
        if carry:
            new_matched[moved] = old_matched[slot]
    new[H_LIVE] = new[H_USED]  # each key placed was live when read; one read mid-write may count one too many,
    # which at worst delays a compaction


@inlined
def _place(new: Table, key: np.uint64) -> int:
    """The first copy's claim: ``key``'s slot in ``new``, which has no tombstones yet (nothing was dropped
    from it) and no reader (it is not published), so no tombstone test and no seqlock."""
    mask = np.uint64(new[H_CAPACITY] - _ONE)
    width = _row_words(new)
    slot = _i64(key & mask)
    while True:
        found = new[HEADER_WORDS + slot * width]
        if found == key:  # a second copy of a key read mid-write: its slot is dirty, fixed by a round
            return slot
        if found == _ZERO:
            new[HEADER_WORDS + slot * width] = key
            new[H_USED] += _ONE
            return slot
        slot = _i64((np.uint64(slot) + _ONE) & mask)


@inlined
def _copy_mask_words(old: Table, new: Table, base: int, dest: int) -> None:
    """The masks of the old slot at ``base`` into the new slot at ``dest`` (whose masks may be wider)."""
    old_words, new_words = _i64(old[H_NWORDS]), _i64(new[H_NWORDS])
    for tier in range(_tiers(old)):  # the new table has every tier of the old
        for w in range(old_words):
            new[dest + SLOT_MASKS + tier * new_words + w] = old[base + SLOT_MASKS + tier * old_words + w]


@inlined
def _copy_slot(old: Table, new: Table, old_matched: Table, new_matched: Table, slot: int) -> int:
    """Claim the old slot's key in ``new`` (a round's copy: tombstones may be there) and give it the slot's
    masks and match stamp, counting it live if it now is; returns where."""
    base = HEADER_WORDS + slot * _row_words(old)
    moved = _claim(new, old[base])
    dest = HEADER_WORDS + moved * _row_words(new)
    was_tomb = _is_tomb(new, dest, _row_words(new))
    _copy_mask_words(old, new, base, dest)
    if was_tomb and not _is_tomb(new, dest, _row_words(new)):
        new[H_LIVE] += _ONE
    if old_matched.size:
        new_matched[moved] = old_matched[slot]
    return moved


RECONCILE_BATCH: Final = 32
"""Dirty slots or rows a round takes at a time (``_gather``): a round's slots lie scattered over a table of
up to millions, a cache miss or more each, and asking for a batch's lines together overlaps their misses.
A round of 8,000 to 20,000 fresh slots of a 1 M-slot table growing to 2 M (256 workers; a helper's round,
timed alone): 257-342 ns a slot against 503-544 one slot at a time (257-261 once ``_gather`` also asked for
the ``where`` entries of the copying pass, six runs). In a 256-worker burst the eight rounds of the last
growth then shrank from 7 ms to 0.9, where they had stayed at 4-5 ms after the first two."""


@inlined
def _gather(
    dirty: Table, word: int, bits: np.uint64, batch: Counts, where: Counts, clear: bool
) -> tuple[int, np.uint64, int]:
    """The next dirty slots after bit ``bits`` of word ``word`` (start at 0, 0), up to a batch, each one's
    ``where`` entry asked for (both passes read it): returns where the next gather starts and how many it
    put in ``batch``; ``clear`` zeroes each word as it is read."""
    n = 0
    while n < batch.size:
        while bits == _ZERO:
            word += 1
            if word >= dirty.size:
                return word, bits, n
            bits = dirty[word]
            if clear:
                dirty[word] = _ZERO
        batch[n], bits = _next_dirty(word, bits)
        _prefetch_line(where, batch[n])
        n += 1
    return word, bits, n


@kernel
def reconcile_slots(
    old: Table, new: Table, old_matched: Table, new_matched: Table, where: Counts, dirty: Table, most: int
) -> int:
    """Bring ``new`` up to date with ``old`` for every slot marked in ``dirty``, and clear it; returns how
    many slots that was, or -1, leaving ``new`` unusable, when that would take it past ``most`` used slots
    (a slot dropped stays a key without holders, and heavy churn during a growth can pile them up: the
    writer then copies afresh, ``Growth.settle``). Every drop comes before every copy (module rules), each
    pass a ``RECONCILE_BATCH`` at a time, its lines asked for first."""
    new_width, old_width = _row_words(new), _row_words(old)
    new_mask = np.uint64(new[H_CAPACITY] - _ONE)
    batch = np.empty(RECONCILE_BATCH, dtype=np.int64)
    word, bits = 0, _ZERO
    while True:
        word, bits, n = _gather(dirty, word, bits, batch, where, False)
        if n == 0:
            break
        for i in range(n):
            if where[batch[i]] >= 0:
                _prefetch_line(new, HEADER_WORDS + where[batch[i]] * new_width)
        for i in range(n):
            moved = where[batch[i]]
            if moved < 0:
                continue
            where[batch[i]] = -1
            dest = HEADER_WORDS + moved * new_width
            if not _is_tomb(new, dest, new_width):
                new[H_LIVE] -= _ONE
                new[H_TOMBS] += _ONE
            new[dest + SLOT_MASKS : dest + new_width] = _ZERO
            if new_matched.size:
                new_matched[moved] = _ZERO
    done = 0
    word, bits = 0, _ZERO
    while True:
        word, bits, n = _gather(dirty, word, bits, batch, where, True)
        if n == 0:
            break
        for i in range(n):
            _prefetch_line(old, HEADER_WORDS + batch[i] * old_width)
        for i in range(n):
            key = old[HEADER_WORDS + batch[i] * old_width]
            if key != _ZERO:
                _prefetch_line(new, HEADER_WORDS + _i64(key & new_mask) * new_width)
        for i in range(n):
            slot = batch[i]
            done += 1
            base = HEADER_WORDS + slot * old_width
            if old[base] != _ZERO and not _is_tomb(old, base, old_width):
                if _i64(new[H_USED]) >= most:
                    return -1
                where[slot] = _copy_slot(old, new, old_matched, new_matched, slot)
    dirty[0] = _ZERO
    return done


@kernel
def copy_rows(old: Map, new: Map, new_meta: Meta, where: Counts, start: int, end: int) -> None:
    """Copy the live rows among ``start``...``end - 1`` of ``old`` into the map ``new`` (growth, and dropping
    deleted rows), noting each one's new row in ``where``; as ``copy_slots``, a range at a time."""
    for row in range(start, end):
        owner = old[row, MAP_TAG]
        if owner != _ZERO and owner != TOMB:
            where[row] = _copy_row(old, new, new_meta, row)


@inlined
def _copy_row(old: Map, new: Map, new_meta: Meta, row: int) -> int:
    moved = _map_insert(new, new_meta, old[row, MAP_KEY], _i64(old[row, MAP_TAG] & HOLDER) - 1, old[row, MAP_VALUE])
    new[moved, MAP_TAG] = old[row, MAP_TAG]  # the links with the holder
    new[moved, MAP_STAMP] = old[row, MAP_STAMP]
    new[moved, MAP_PARENT] = old[row, MAP_PARENT]
    return moved


@kernel
def reconcile_rows(old: Map, new: Map, new_meta: Meta, where: Counts, dirty: Table, most: int) -> int:
    """Bring ``new`` up to date with ``old`` for every row marked in ``dirty``, and clear it; returns how
    many rows that was, or -1 past ``most`` used rows (as ``reconcile_slots``, a batch at a time)."""
    mask = np.uint64(new_meta[M_CAPACITY] - 1)
    old_words, new_words = old.reshape(old.size), new.reshape(new.size)
    batch = np.empty(RECONCILE_BATCH, dtype=np.int64)
    word, bits = 0, _ZERO
    while True:
        word, bits, n = _gather(dirty, word, bits, batch, where, False)
        if n == 0:
            break
        for i in range(n):
            if where[batch[i]] >= 0:
                _prefetch_line(new_words, where[batch[i]] * MAP_ROW_WORDS + MAP_TAG)
        for i in range(n):
            if where[batch[i]] >= 0:
                _map_delete(new, new_meta, where[batch[i]])
                where[batch[i]] = -1
    done = 0
    word, bits = 0, _ZERO
    while True:
        word, bits, n = _gather(dirty, word, bits, batch, where, True)
        if n == 0:
            break
        for i in range(n):
            _prefetch_line(old_words, batch[i] * MAP_ROW_WORDS + MAP_TAG)
        for i in range(n):
            owner = old[batch[i], MAP_TAG]
            if owner != _ZERO and owner != TOMB:
                home = _map_home(old[batch[i], MAP_KEY], _i64(owner & HOLDER) - 1, mask)
                _prefetch_line(new_words, home * MAP_ROW_WORDS + MAP_TAG)
        for i in range(n):
            row = batch[i]
            done += 1
            owner = old[row, MAP_TAG]
            if owner != _ZERO and owner != TOMB:
                if new_meta[M_USED] >= most:
                    return -1
                where[row] = _copy_row(old, new, new_meta, row)
    dirty[0] = _ZERO
    return done


# -- reads ------------------------------------------------------------------------------------


@inlined
def _lookup(table: Table, key: np.uint64, ntiers: int, masks: Table, cols: Table, ncols: int) -> int:
    """Find ``key`` and copy its first ``ntiers`` masks, each OR-ed with the faster tiers', into ``masks``,
    all from one consistent version of the slot: the words of the ``ncols`` mask columns listed in ``cols``
    (a column: the same word of every tier). 1: found; 0: absent; -1: a slot stayed mid-write for
    ``STUCK_SPINS`` reads (its writer died there, or was preempted) or was rewritten for
    ``MAX_READ_RETRIES`` reads in a row."""
    nwords = _i64(table[H_NWORDS])
    width = _row_words(table)
    tiers = _tiers(table)
    mask = np.uint64(table[H_CAPACITY] - _ONE)
    slot = _i64(key & mask)
    while True:
        base = HEADER_WORDS + slot * width
        tries = stuck = 0
        while True:
            before = _load(table, base + SLOT_VERSION)
            _fence()
            current = _load(table, base)
            if current == key:
                for c in range(ncols):
                    w = _i64(cols[c])
                    for t in range(ntiers):
                        held = _load(table, base + SLOT_MASKS + t * nwords + w) if t < tiers else _ZERO
                        masks[t * nwords + w] = held if t == 0 else held | masks[(t - 1) * nwords + w]
            _fence()
            after = _load(table, base + SLOT_VERSION)
            if before == after and (before & _ONE) == _ZERO:
                break
            stuck = stuck + 1 if before == after else 0
            tries += 1
            if stuck > STUCK_SPINS or tries > MAX_READ_RETRIES:
                return -1
        if current == key:
            return 1
        if current == _ZERO:
            return 0
        slot = _i64((np.uint64(slot) + _ONE) & mask)


@kernel
def lookup(table: Table, key: np.uint64, ntiers: int, masks: Table) -> int:
    """``_lookup`` of every column, for callers outside this module (the seqlock stress test); the walk
    inlines it."""
    nwords = _i64(table[H_NWORDS])
    return _lookup(table, key, ntiers, masks, np.arange(nwords).astype(np.uint64), nwords)


PREFETCH_AHEAD: Final = 16
"""Blocks whose slots the walk prefetches ahead of the probe: enough misses in flight to fill the core's
line-fill buffers, without chaining and touching a long query the walk will never reach."""
PREFETCH_FIRST: Final = 64
"""Blocks whose slots the walk prefetches before its first probe, all of a 64-block query. Right after
another program ran (the benchmark's reference) the slots are far away, TLB misses included, and 16
ahead was too short a lead: measured interleaved with the reference at 256 workers, a 64-block query's
p50 went down about 0.7-1.3 µs, a 512-block one's 0.5-0.7 (its extra chaining past the walk's end is
still ``PREFETCH_AHEAD``). Prefetching 64 ahead all along instead cost 512-block queries 1.8 µs."""


@inlined
def scratch_words(ntiers: int, nwords: int, blocks: int) -> int:
    """Words of ``walk``'s scratch for masks ``nwords`` wide and a query of ``blocks`` blocks."""
    return 3 * ntiers * nwords + nwords + 1 + blocks


@inlined
def _first(scratch: Table, ntiers: int, nwords: int) -> Table:
    """``walk``'s record of the bits holding the query's first block, per tier (see ``walk``)."""
    return scratch[2 * ntiers * nwords : 3 * ntiers * nwords]


@kernel
def walk(table: Table, local: npt.NDArray[np.uint64], ntiers: int, scores: Counts, scratch: Table) -> int:
    """Per worker bit and tier, the leading query blocks held in that tier or a faster one.

    ``local`` holds the query's local hashes; the sequence hashes are chained here, only as far as the
    walk goes. ``scores`` is ``[ntiers, nwords * 64]``; ``scratch`` holds ``scratch_words`` words (running
    masks, the first block's masks, the mask columns still live, sequence hashes). After the first block
    a probe reads and ANDs only the columns (a word of every tier) with a worker left: at 1,024 workers
    and four tiers a slot's masks are 64 words on nine cache lines, of which 16 holders touch four. Only
    the bits holding the first block get a score (every one of them, at least 1), and ``_first(scratch,
    ...)`` says which: the callers read those and nothing else, so no score is zeroed and no bit of a
    wide, mostly idle fleet scanned (at 4,096 workers that was 16,384 words zeroed and scanned per shard
    and query). Returns the blocks walked, or
    -1 when a slot stayed mid-write. The walk ends at the first block the shard does not hold, or as soon
    as no worker of the shard is left.
    """
    nwords = _i64(table[H_NWORDS])
    width = _row_words(table)
    last = SLOT_MASKS + min(ntiers, _tiers(table)) * nwords - 1  # the last word a probe reads of its slot
    mask = np.uint64(table[H_CAPACITY] - _ONE)
    n = local.size
    alive = scratch[: ntiers * nwords]
    seen = scratch[ntiers * nwords : 2 * ntiers * nwords]
    first = _first(scratch, ntiers, nwords)
    cols = scratch[3 * ntiers * nwords : 3 * ntiers * nwords + nwords]
    seqs = scratch[3 * ntiers * nwords + nwords : 3 * ntiers * nwords + nwords + n]
    alive[:] = _ZERO
    first[:] = _ZERO
    for w in range(nwords):  # the first probe reads every column; later ones only those with a worker left
        cols[w] = np.uint64(w)
    ncols = nwords
    chained = 0
    for i in range(n):  # hot path: one seqlocked probe per block
        while chained < n and (chained <= i + PREFETCH_AHEAD or chained < PREFETCH_FIRST):
            seq = local[0] if chained == 0 else chain_step(seqs[chained - 1], local[chained], _SEED)
            seqs[chained] = seq
            base = HEADER_WORDS + _i64(_table_key(seq) & mask) * width
            _prefetch_line(table, base)  # the misses of the next blocks overlap, without holding up this one
            _prefetch_line(table, base + last)
            chained += 1
        status = _lookup(table, _table_key(seqs[i]), ntiers, seen, cols, ncols)
        if status < 0:
            return -1
        if status == 0:
            _finish(alive, scores, ntiers, nwords, i)
            return i
        kept = 0
        for c in range(ncols):
            w = _i64(cols[c])
            left = False
            for t in range(ntiers):
                j = t * nwords + w
                before_mask = seen[j] if i == 0 else alive[j]
                now = before_mask & seen[j]
                if i > 0:
                    _drop(scores, t, w * 64, before_mask & ~now, i)
                else:
                    first[j] = now
                alive[j] = now
                if now != _ZERO:
                    left = True
            if left:
                cols[kept] = np.uint64(w)
                kept += 1
        ncols = kept
        if ncols == 0:
            return i + 1
    _finish(alive, scores, ntiers, nwords, n)
    return n


@inlined
def _walk_shard(
    table: Table,
    control: Table,
    shard: int,
    local: npt.NDArray[np.uint64],
    ntiers: int,
    generation: int,
    scores: Counts,
    scratch: Table,
) -> int:
    """``walk`` one shard for ``query_shards`` / ``overlap_shards``, into ``scores`` (``[ntiers, bits]`` of the
    table's bits; only the bits ``_first`` names are written). ``OK`` when the walk ran inside rows
    generation ``generation`` (the one the reader's bit map was read at, so the bits name the rows the map
    holds) or the shard has no live key (no bit named); else ``STALE_TABLE`` (``table`` is not the
    shard's current one), ``ROWS_CHANGED`` (the generation is not ``generation``, or moved during the
    walk), ``ROWS_MOVING`` (odd for ``STUCK_SPINS`` reads) or ``SLOT_STUCK``, with ``scores`` meaningless."""
    block = HEADER_WORDS + shard * SHARD_BLOCK_WORDS
    epoch = _load(table, H_EPOCH)
    odd = 0
    while True:
        current = _load(control, block + S_ROWS_GEN)
        if (current & _ONE) == _ZERO:
            break
        odd += 1  # a row is being rewritten: its writer is between two stores
        if odd > STUCK_SPINS:
            return ROWS_MOVING
    if _load(control, block + S_EPOCH) != epoch:
        return STALE_TABLE
    if _i64(current) != generation:
        return ROWS_CHANGED
    if _load(table, H_LIVE) == _ZERO:
        _first(scratch, ntiers, _i64(table[H_NWORDS]))[:] = _ZERO  # no bit holds anything
        return OK
    _fence()
    if walk(table, local, ntiers, scores, scratch) < 0:
        return SLOT_STUCK
    _fence()
    if _load(control, block + S_ROWS_GEN) != current:
        return ROWS_CHANGED
    return OK


# -- the reader's context: every array a query touches, by address --------------------------

CTX_SHARDS, CTX_ROWS, CTX_NWORDS = 0, 1, 2
"""Context words: shards (0 once the reader closed: a query walks nothing), rows per shard, and the widest
mask (words) of the tables the context names (the work buffers' size)."""
CTX_CONTROL, CTX_STATE, CTX_BIT_KEYS, CTX_BIT_SLOTS, CTX_FOUND = 3, 5, 6, 7, 8
"""Addresses of the control segment's words (its length follows it), and of the reader's ``state``
(``[shards, 3]``), ``bit_keys`` and ``bit_slots`` (``shards * rows``) and ``found`` (``3 * TIERS * shards *
rows``) arrays."""
CTX_WORK, CTX_SCRATCH = 9, 11
"""Address and length of the preallocated scores (``int64``) and walk scratch (``uint64``) buffers."""
CTX_KEYS, CTX_ANSWER = 13, 14
"""``id()`` of the reader's list of worker keys (``bit_keys`` indexes it) and of the one-item list the
matching kernels put their answer dict in."""
CTX_QUERY = 15
"""Address and length of the reader's query buffer (``uint64``), where ``match_list`` converts a list."""
CTX_KEY_HASHES = 17
"""Address of the reader's ``hash()`` of each worker key (``int64``, beside ``CTX_KEYS``' list)."""
CTX_MAPPED = 18
"""The ``WorkerSlots.version`` the bit -> slot maps follow (unique to one numbering), 0 before the first
map and once the reader closed: a caller walking by ``ctx`` alone (the router's decision) checks it and
goes through the reader when it is not its numbering's."""
CTX_TABLES = 19
"""Shard ``k``'s table: address at ``CTX_TABLES + 2 * k``, length in words after it."""
LIST_REFUSED: Final = -(1 << 62)
"""``match_list``'s answer for a list it did not convert (an item not an int in [0, 2**64), or more items
than the query buffer holds): the caller converts it itself (and raises)."""


def _pointer_typer(dtype: Any) -> Callable[[Any, Any], Any]:
    def typer(typingctx: Any, address: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return types.CPointer(dtype)(types.int64), codegen  # type: ignore[no-untyped-call]

    return typer


_words_at = cast(Callable[[int], Any], intrinsic(_pointer_typer(types.uint64)))
"""The ``uint64`` words at an address (for ``carray``): a table or the control segment, mapped by the
reader, which keeps the mapping open while its address is in the context."""
_counts_at = cast(Callable[[int], Any], intrinsic(_pointer_typer(types.int64)))
"""The ``int64`` words at an address: one of the reader's own arrays."""
_floats_at = cast(Callable[[int], Any], intrinsic(_pointer_typer(types.float64)))
"""The ``float64`` words at an address: one of the router's arrays (``routing/_kernels.py``)."""

_OBJECT = ir.IntType(8).as_pointer()
"""``PyObject *`` as LLVM sees it."""


def _c_api(builder: Any, name: str, result: Any, arguments: list[Any]) -> Any:
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, arguments), name)  # type: ignore[no-untyped-call]
    return function


_PRESIZED = hasattr(ctypes.pythonapi, "_PyDict_NewPresized")
_KNOWN_HASH = hasattr(ctypes.pythonapi, "_PyDict_SetItem_KnownHash")
"""CPython's private dict constructors (exported in 3.11 and 3.12): a dict sized for its answer, and an
insert that takes the key's hash (the reader's, computed once per rows generation) instead of hashing
the tuple, its ints and their cache lines per query. Where an interpreter lacks them the public
``PyDict_New`` and ``PyDict_SetItem`` stand in."""


def _dict_new_typer(typingctx: Any, size: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        if _PRESIZED:
            new = _c_api(builder, "_PyDict_NewPresized", _OBJECT, [ir.IntType(64)])
            return builder.ptrtoint(builder.call(new, [args[0]]), ir.IntType(64))
        return builder.ptrtoint(builder.call(_c_api(builder, "PyDict_New", _OBJECT, []), []), ir.IntType(64))

    return types.int64(types.int64), codegen


def _dict_set_typer(typingctx: Any, answer: Any, keys: Any, index: Any, value: Any, hashed: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64, i32 = ir.IntType(64), ir.IntType(32)
        get_item = _c_api(builder, "PyList_GetItem", _OBJECT, [_OBJECT, i64])
        from_int = _c_api(builder, "PyLong_FromLongLong", _OBJECT, [i64])
        if _KNOWN_HASH:
            set_item = _c_api(builder, "_PyDict_SetItem_KnownHash", i32, [_OBJECT, _OBJECT, _OBJECT, i64])
            hashed_ = [args[4]]
        else:
            set_item, hashed_ = _c_api(builder, "PyDict_SetItem", i32, [_OBJECT, _OBJECT, _OBJECT]), []
        decref = _c_api(builder, "Py_DecRef", ir.VoidType(), [_OBJECT])
        key = builder.call(get_item, [builder.inttoptr(args[1], _OBJECT), args[2]])  # borrowed
        number = builder.call(from_int, [args[3]])  # new reference, NULL when out of memory
        status = cgutils.alloca_once_value(builder, i32(-1))  # type: ignore[no-untyped-call]
        fine = builder.and_(cgutils.is_not_null(builder, key), cgutils.is_not_null(builder, number))  # type: ignore[no-untyped-call]
        with builder.if_then(fine, likely=True):
            builder.store(builder.call(set_item, [builder.inttoptr(args[0], _OBJECT), key, number, *hashed_]), status)
        with builder.if_then(cgutils.is_not_null(builder, number), likely=True):  # type: ignore[no-untyped-call]
            builder.call(decref, [number])  # the dict holds its own reference
        return builder.sext(builder.load(status), i64)

    return types.int64(types.int64, types.int64, types.int64, types.int64, types.int64), codegen


def _dict_put_typer(typingctx: Any, holder: Any, answer: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        set_item = _c_api(builder, "PyList_SetItem", ir.IntType(32), [_OBJECT, ir.IntType(64), _OBJECT])
        holder_, answer_ = builder.inttoptr(args[0], _OBJECT), builder.inttoptr(args[1], _OBJECT)
        return builder.sext(builder.call(set_item, [holder_, ir.IntType(64)(0), answer_]), ir.IntType(64))

    return types.int64(types.int64, types.int64), codegen


def _dict_drop_typer(typingctx: Any, answer: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.call(_c_api(builder, "PyErr_Clear", ir.VoidType(), []), [])
        builder.call(_c_api(builder, "Py_DecRef", ir.VoidType(), [_OBJECT]), [builder.inttoptr(args[0], _OBJECT)])
        return context.get_dummy_value()

    return types.none(types.int64), codegen


def _list_words_typer(typingctx: Any, items: Any, dest: Any, room: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        size = _c_api(builder, "PyList_Size", i64, [_OBJECT])
        get_item = _c_api(builder, "PyList_GetItem", _OBJECT, [_OBJECT, i64])
        as_word = _c_api(builder, "PyLong_AsUnsignedLong", i64, [_OBJECT])
        occurred = _c_api(builder, "PyErr_Occurred", _OBJECT, [])
        clear = _c_api(builder, "PyErr_Clear", ir.VoidType(), [])
        items_ = builder.inttoptr(args[0], _OBJECT)
        words = builder.inttoptr(args[1], i64.as_pointer())
        n = builder.call(size, [items_])
        result = cgutils.alloca_once_value(builder, i64(LIST_REFUSED))  # type: ignore[no-untyped-call]
        with builder.if_then(builder.icmp_signed("<=", n, args[2]), likely=True):
            with cgutils.for_range(builder, n) as loop:
                item = builder.call(get_item, [items_, loop.index])  # borrowed; the list cannot change under the GIL
                builder.store(builder.call(as_word, [item]), builder.gep(words, [loop.index]))
            failed = cgutils.is_not_null(builder, builder.call(occurred, []))  # type: ignore[no-untyped-call]
            with builder.if_else(failed, likely=False) as (then, otherwise):
                with then:
                    builder.call(clear, [])  # the caller converts again and raises InvalidHashInput
                with otherwise:
                    builder.store(n, result)
        return builder.load(result)

    return types.int64(types.int64, types.int64, types.int64), codegen


_list_words = cast(Callable[[int, int, int], int], intrinsic(_list_words_typer))
"""Convert a Python list of ints (by address) into ``room`` u64 words at ``dest``, as ``array('L')`` does
(``PyLong_AsUnsignedLong``: an int in [0, 2**64), no ``__index__``): the count, or ``LIST_REFUSED``.
Every item is converted before the one error check, so a bad item anywhere refuses the list."""
_dict_new = cast(Callable[[int], int], intrinsic(_dict_new_typer))
"""A new dict with room for ``size`` items (``_PyDict_NewPresized``): its address, 0 when out of memory."""
_dict_set = cast(Callable[[int, int, int, int, int], int], intrinsic(_dict_set_typer))
"""``answer[keys[index]] = value`` on a dict and a list given by address, the key's ``hash()`` given;
0, or -1 on failure."""
_dict_put = cast(Callable[[int, int], int], intrinsic(_dict_put_typer))
"""``holder[0] = answer``, the dict's reference moving into the list; 0, or -1 on failure."""
_dict_drop = cast(Callable[[int], None], intrinsic(_dict_drop_typer))
"""Forget a failed dict build: clear the Python error, release the dict."""


@inlined
def _table(ctx: Meta, at: int) -> Table:
    return carray(_words_at(ctx[at]), (ctx[at + 1],))


@inlined
def _scores(table: Table, ntiers: int, work: Counts) -> Counts:
    """``work``'s head viewed as ``[ntiers, bits]`` for the table's mask width."""
    bits = _i64(table[H_NWORDS]) * 64
    return work[: ntiers * bits].reshape((ntiers, bits))


@inlined
def _buffers(ctx: Meta, n: int, ntiers: int) -> tuple[Counts, Table]:
    """Scores and ``walk``'s scratch: the reader's, unless the query is longer than its scratch holds
    (then allocated for this call)."""
    nwords = ctx[CTX_NWORDS]
    work = carray(_counts_at(ctx[CTX_WORK]), (ctx[CTX_WORK + 1],))
    scratch = carray(_words_at(ctx[CTX_SCRATCH]), (ctx[CTX_SCRATCH + 1],))
    if work.size < ntiers * nwords * 64:
        work = np.empty(ntiers * nwords * 64, dtype=np.int64)
    if scratch.size < scratch_words(ntiers, nwords, n):
        scratch = np.empty(scratch_words(ntiers, nwords, n), dtype=np.uint64)
    return work, scratch


@inlined
def _query(ctx: Meta, local: npt.NDArray[np.uint64], ntiers: int) -> int:
    """``query_shards``' body, inlined into each kernel that answers ``find_matches``."""
    shards, rows = ctx[CTX_SHARDS], ctx[CTX_ROWS]
    control = _table(ctx, CTX_CONTROL)
    state = carray(_counts_at(ctx[CTX_STATE]), (max(shards, 1), 3))
    bit_keys = carray(_counts_at(ctx[CTX_BIT_KEYS]), (shards * rows,))
    cap = TIERS * shards * rows
    found = carray(_counts_at(ctx[CTX_FOUND]), (3 * cap,))
    work, scratch = _buffers(ctx, local.size, ntiers)
    count = 0
    failed = False
    for shard in range(shards):  # hot path: one walk per shard, no Python step between
        if state[shard, ASK] == 0:
            continue
        table = _table(ctx, CTX_TABLES + 2 * shard)
        scores = _scores(table, ntiers, work)
        code = _walk_shard(table, control, shard, local, ntiers, state[shard, GENERATION], scores, scratch)
        state[shard, STATUS] = code
        if code != OK:
            failed = True
            continue
        first = shard * rows
        nwords = _i64(table[H_NWORDS])
        held = _first(scratch, ntiers, nwords)
        for tier in range(ntiers):
            for word in range(nwords):
                bits = held[tier * nwords + word]
                while bits != _ZERO:  # only the bits holding the first block have a score
                    bit = word * 64 + _lowest_bit(bits)
                    bits &= bits - _ONE
                    if bit_keys[first + bit] >= 0:
                        found[count] = bit_keys[first + bit]
                        found[cap + count] = scores[tier, bit]
                        found[2 * cap + count] = tier
                        count += 1
    found[count : 2 * count] = found[cap : cap + count]
    found[2 * count : 3 * count] = found[2 * cap : 2 * cap + count]
    return -1 - count if failed else count


@kernel
def query_shards(ctx: Meta, local: npt.NDArray[np.uint64], ntiers: int) -> int:
    """``walk`` every shard whose ``state[k, ASK]`` is set, in one call, with the answer in ``found``: per
    worker and tier holding a block, its key (``bit_keys[k * rows + bit]``, the caller's number for the
    worker of shard ``k``'s row ``bit``; bits with -1 are skipped), then the depths, then the tiers, each
    run ``n`` long: ``found[:n]`` keys, ``found[n:2n]`` depths, ``found[2n:3n]`` tiers.

    ``ctx`` is the reader's context (``CTX_*``): the tables, the control segment's words, and the reader's
    arrays, by address; ``state[k, GENERATION]`` is the rows generation ``bit_keys`` was read at
    (``read_rows``). ``state[k, STATUS]`` gets ``OK`` or the shard's failure (``_walk_shard``); a failed
    shard adds nothing. Returns ``n`` when every asked shard answered, else ``-1 - n``.
    """
    return _query(ctx, local, ntiers)


@inlined
def _match(ctx: Meta, local: npt.NDArray[np.uint64]) -> int:
    """``query_shards`` on device, and when every shard answered, the answer as a dict
    ``{keys[found[i]]: found[n + i]}`` put in the reader's answer list. A dict that could not be built
    (out of memory) is reported as a failed query, which the reader builds again from ``found``."""
    count = _query(ctx, local, 1)
    if count < 0:
        return count
    answer = _dict_new(count)
    if answer == 0:
        _dict_drop(answer)
        return -1 - count
    found, keys = carray(_counts_at(ctx[CTX_FOUND]), (2 * count,)), ctx[CTX_KEYS]
    hashes = carray(_counts_at(ctx[CTX_KEY_HASHES]), (ctx[CTX_SHARDS] * ctx[CTX_ROWS],))
    for i in range(count):
        if _dict_set(answer, keys, found[i], found[count + i], hashes[found[i]]) != 0:
            _dict_drop(answer)
            return -1 - count
    if _dict_put(ctx[CTX_ANSWER], answer) != 0:
        _dict_drop(0)
        return -1 - count
    return count


@holds_gil  # the matching kernels call the CPython API
def match_shards(ctx: Meta, local: npt.NDArray[np.uint64]) -> int:
    """``find_matches`` in one call: ``_match`` for a ``uint64`` array."""
    return _match(ctx, local)


@holds_gil
def match_words(ctx: Meta, address: int, n: int) -> int:
    """``find_matches`` in one call: ``_match`` for ``n`` ``uint64`` words at ``address`` (an ``array``'s
    buffer, which the caller keeps alive): no numpy array is made for the query."""
    return _match(ctx, carray(_words_at(address), (n,)))


def compiled(kernel: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``kernel``'s compiled function for the types of ``args`` (compiled, or loaded from numba's cache, now),
    called without numba's dispatch: it types every argument and looks the signature up on each call, 0.3
    µs of a 64-block ``find_matches``, about 0.5 µs once the caller's other work evicted it. The caller must
    pass arguments of exactly those types: the compiled wrapper unboxes them, it does not check them."""
    signature = tuple(typeof(arg) for arg in args)  # type: ignore[no-untyped-call]
    return cast(Callable[..., Any], kernel.compile(signature))  # type: ignore[attr-defined]


@holds_gil
def match_list(ctx: Meta, items: int) -> int:
    """``find_matches`` in one call from the list whose ``id()`` is ``items``: converted into the reader's
    query buffer here (no ``array`` or numpy array made), then ``_match``. ``LIST_REFUSED`` when the list
    is too long for the buffer or holds an item that is not a u64 int."""
    n = _list_words(items, ctx[CTX_QUERY], ctx[CTX_QUERY + 1])
    if n < 0:
        return LIST_REFUSED
    return _match(ctx, carray(_words_at(ctx[CTX_QUERY]), (n,)))


@kernel
def overlap_shards(ctx: Meta, local: npt.NDArray[np.uint64], ntiers: int, out: Counts) -> int:
    """``query_shards`` with the answer dense: ``out[tier, bit_slots[k * rows + bit]] = depth`` for every bit
    of an asked shard that holds a block (bits whose slot is -1 skipped); ``out`` is ``[ntiers, slots]``,
    zeroed by the caller. Returns how many asked shards failed (their status says why)."""
    return _overlap_shards(ctx, local, ntiers, out, out[0, :0])[0]  # an empty view: notes nothing


@inlined
def _overlap_shards(
    ctx: Meta, local: npt.NDArray[np.uint64], ntiers: int, out: Counts, written: Counts
) -> tuple[int, int]:
    """``overlap_shards``, also noting in ``written`` the slot of every column written (one entry per
    slot: its slowest tier is written whenever a faster one is, the masks being cumulative), so a caller
    keeping ``out`` can zero those columns again instead of all of it. Returns ``(failed shards, entries
    noted)``; -1 entries when ``written`` was too short (the caller zeroes all of ``out``). An empty
    ``written`` notes nothing. Inlined into the router's decision (``routing/_kernels.py``)."""
    shards, rows = ctx[CTX_SHARDS], ctx[CTX_ROWS]
    control = _table(ctx, CTX_CONTROL)
    state = carray(_counts_at(ctx[CTX_STATE]), (max(shards, 1), 3))
    bit_slots = carray(_counts_at(ctx[CTX_BIT_SLOTS]), (shards * rows,))
    work, scratch = _buffers(ctx, local.size, ntiers)
    failed = noted = 0
    for shard in range(shards):  # hot path: one walk per shard, no Python step between
        if state[shard, ASK] == 0:
            continue
        table = _table(ctx, CTX_TABLES + 2 * shard)
        scores = _scores(table, ntiers, work)
        code = _walk_shard(table, control, shard, local, ntiers, state[shard, GENERATION], scores, scratch)
        state[shard, STATUS] = code
        if code != OK:
            failed += 1
            continue
        first = shard * rows
        nwords = _i64(table[H_NWORDS])
        held = _first(scratch, ntiers, nwords)
        for tier in range(ntiers):
            for word in range(nwords):
                bits = held[tier * nwords + word]
                while bits != _ZERO:  # only the bits holding the first block have a score
                    bit = word * 64 + _lowest_bit(bits)
                    bits &= bits - _ONE
                    slot = bit_slots[first + bit]
                    if slot >= 0:
                        out[tier, slot] = scores[tier, bit]
                        if tier == ntiers - 1 and written.size and noted >= 0:
                            if noted < written.size:
                                written[noted] = slot
                                noted += 1
                            else:
                                noted = -1
    return failed, noted


@kernel
def read_rows(control: Table, shard: int, out: npt.NDArray[np.uint64]) -> tuple[int, int]:
    """Copy the worker rows of ``shard`` that can own a mask bit as ``[in use, worker id, dp rank]`` into
    ``out`` (``[rows, 3]``), all from one rows generation (read before the first row and after the last,
    read again when it moved). Returns ``(generation, rows copied)``, or ``(ROWS_MOVING, 0)`` when the
    generation stayed odd for ``STUCK_SPINS`` reads or moved ``ROWS_RETRIES`` times.

    Only the current table's bits are copied (``S_NWORDS * 64`` rows, read after the generation): the
    writer widens the table before it registers a row past its bits, so no row beyond is in use at this
    generation, and a small fleet's copy is a few cache lines, not all ``rows``."""
    block = HEADER_WORDS + shard * SHARD_BLOCK_WORDS
    rows = _i64(control[C_ROWS])
    first = HEADER_WORDS + _i64(control[C_SHARDS]) * SHARD_BLOCK_WORDS + shard * rows * WORKER_ROW_WORDS
    moved = odd = 0
    while True:
        generation = _load(control, block + S_ROWS_GEN)
        if generation & _ONE:
            odd += 1
            if odd > STUCK_SPINS:
                return ROWS_MOVING, 0
            continue
        count = min(rows, _i64(_load(control, block + S_NWORDS)) * 64)
        _fence()
        for row in range(count):
            base = first + row * WORKER_ROW_WORDS
            used = _load(control, base + W_IN_USE)
            out[row, 0] = used
            out[row, 1] = _load(control, base + W_WORKER_ID) if used != _ZERO else _ZERO
            out[row, 2] = _load(control, base + W_DP_RANK) if used != _ZERO else _ZERO
        _fence()
        if _load(control, block + S_ROWS_GEN) == generation:
            return _i64(generation), count
        moved += 1
        if moved > ROWS_RETRIES:
            return ROWS_MOVING, 0


@kernel
def begin_rows_change(block: Table) -> None:
    """The writer is about to change which worker a row names: the rows generation goes odd (from a
    dead predecessor's odd value too), then a fence, so no row store passes it."""
    generation = block[S_ROWS_GEN]
    _store(block, S_ROWS_GEN, generation + (np.uint64(2) if generation & _ONE else _ONE))
    _fence()


@kernel
def end_rows_change(block: Table) -> None:
    """The rows are written: a fence, then the generation goes even, one past ``begin_rows_change``."""
    _fence()
    _store(block, S_ROWS_GEN, block[S_ROWS_GEN] + _ONE)


@inlined
def _drop(scores: Counts, tier: int, first_bit: int, dropped: np.uint64, depth: int) -> None:
    """``scores[tier, first_bit + b] = depth`` for each set bit ``b`` of ``dropped``: one step per set bit
    (a shift per bit position cost up to 64 steps a word, most of a walk's time at 256 workers)."""
    while dropped != _ZERO:
        scores[tier, first_bit + _lowest_bit(dropped)] = depth
        dropped &= dropped - _ONE


@inlined
def _finish(alive: Table, scores: Counts, ntiers: int, nwords: int, depth: int) -> None:
    for j in range(ntiers * nwords):
        _drop(scores, j // nwords, (j % nwords) * 64, alive[j], depth)
