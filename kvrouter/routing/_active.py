"""The slot manager's compiled tables: how often each slot's active requests hold a sequence hash, and
which slots hold it at all.

Rules (those of ``index/_kernels.py``): arrays in, scalars or preallocated arrays out; no allocation and
no Python object in a per-block loop; the caller makes room before a call could fill a table
(:func:`room`), so no kernel fails for space.

Two open-addressing tables of ``uint64`` rows, linear probing, deletion by backward shift: no tombstones,
so a table under endless booking and freeing never degrades and never needs a sweep.

- ``pairs``: ``[sequence hash, slot + 1, count]``, the number of the slot's active requests holding the
  hash (a row is empty while its slot word is 0). Booking and freeing go through it.
- ``holders``: ``[sequence hash, holder count, bitset...]``, the slots holding the hash as a bitset
  ``ceil(slots / 64)`` words wide (empty while the count is 0). The decision goes through it.

Why a bitset per held hash: a new prompt's walk (:func:`leading`) needs, per block, which slots still in
the running hold it (one AND per bitset word still matching), and the first block's holders as a list
(one pass over its words). The cost is a table probe per block plus one AND per (word still matching,
block) and one bit scan per slot where its run ends: linear in the matched blocks, nothing for workers
holding none of the prompt.
Memory is one bit per slot per active hash, the layout of the shard index's own table, so it never
exceeds what the index spends on the same blocks once they are cached. Rejected: the first version, a
Python dict of big-int bitsets (13 µs for a 64-block prompt at 16 workers: a dict probe and a big-int AND
per block in the interpreter); a sorted holder list per hash (a membership test becomes a search, and a
prefix held by 4,096 workers a merge of 4,096 entries per block).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, cast

import numpy as np
import numpy.typing as npt

from .._jit import inlined, kernel
from ..index._kernels import _lowest_bit, _prefetch_line  # the reader's intrinsics, as the decision kernel takes them

__all__ = ["add", "held_run", "holder_table", "leading", "pair_table", "remove", "room", "widen"]

Rows = npt.NDArray[np.uint64]
Slots = npt.NDArray[np.int64]


_i64 = cast(Callable[[object], int], np.int64)
"""``np.int64``, typed for mypy as returning ``int`` (numba sees the numpy type itself)."""

PAIR_WORDS: Final = 3
K_HASH: Final = 0
K_SLOT: Final = 1
"""``slot + 1``; 0 marks an empty row."""
K_COUNT: Final = 2
H_HASH: Final = 0
H_COUNT: Final = 1
"""Slots holding the hash; 0 marks an empty row."""
H_BITS: Final = 2
HOLDER_WORDS: Final = 2
"""Words of a ``holders`` row before its bitset."""
MIN_ROWS: Final = 64
PREFETCH_AHEAD: Final = 8
"""Blocks whose home row :func:`leading` asks the cache for before it probes them: the prompt's hashes are
known in advance, so their probes' misses can overlap instead of following one another."""
MAX_LOAD: Final = 0.5
"""Rows in use over capacity beyond which :func:`room` doubles a table: linear probing stays short."""

_ZERO = np.uint64(0)
_ONE = np.uint64(1)
_MIX = np.uint64(0x9E3779B97F4A7C15)
"""Spreads the slot over a pair's home row (the hash alone would put a shared hash's pairs side by side)."""


def pair_table(rows: int = MIN_ROWS) -> Rows:
    return np.zeros((rows, PAIR_WORDS), dtype=np.uint64)


def holder_table(rows: int = MIN_ROWS, words: int = 1) -> Rows:
    return np.zeros((rows, HOLDER_WORDS + words), dtype=np.uint64)


def room(table: Rows, used: int, more: int, *, pairs: bool) -> Rows:
    """``table``, or a larger copy when ``used + more`` rows would pass ``MAX_LOAD``."""
    rows = table.shape[0]
    if used + more <= MAX_LOAD * rows:
        return table
    while used + more > MAX_LOAD * rows:
        rows *= 2
    grown = np.zeros((rows, table.shape[1]), dtype=np.uint64)
    rehash(table, grown, pairs)
    return grown


def widen(holders: Rows, slots: int) -> Rows:
    """``holders``, or a copy with bitsets wide enough for ``slots`` slots (rows keep their places: the
    home row depends on the hash alone)."""
    words = (slots + 63) // 64
    if HOLDER_WORDS + words <= holders.shape[1]:
        return holders
    wider = np.zeros((holders.shape[0], HOLDER_WORDS + max(words, 2 * (holders.shape[1] - HOLDER_WORDS))), np.uint64)
    wider[:, : holders.shape[1]] = holders
    return wider


@inlined
def _pair_home(seq: np.uint64, slot: int, mask: np.uint64) -> int:
    return _i64((seq ^ (np.uint64(slot + 1) * _MIX)) & mask)


@inlined
def _home(table: Rows, row: int, mask: np.uint64, pairs: bool) -> int:
    """Where the key in ``row`` would be stored in an empty table."""
    if pairs:
        return _pair_home(table[row, K_HASH], _i64(table[row, K_SLOT]) - 1, mask)
    return _i64(table[row, H_HASH] & mask)


@kernel
def _delete(table: Rows, row: int, pairs: bool) -> None:
    """Empty ``row``, moving back every later row of its probe run that may not sit past the hole. Column
    1 (a pair's slot, a holder row's count) is 0 only in an empty row."""
    mask = np.uint64(table.shape[0] - 1)
    hole = row
    at = row
    while True:
        at = _i64((np.uint64(at) + _ONE) & mask)
        if table[at, 1] == _ZERO:
            break
        home = _home(table, at, mask, pairs)
        # the row at `at` may stay when its home lies cyclically in (hole, at]
        if (hole < at and hole < home <= at) or (hole > at and (home > hole or home <= at)):
            continue
        table[hole, :] = table[at, :]
        hole = at
    table[hole, :] = _ZERO


@inlined
def _pair(pairs: Rows, seq: np.uint64, slot: int) -> int:
    """The row of ``(seq, slot)``, or the empty row where it would go."""
    mask = np.uint64(pairs.shape[0] - 1)
    row = _pair_home(seq, slot, mask)
    tag = np.uint64(slot + 1)
    while pairs[row, K_SLOT] != _ZERO and (pairs[row, K_HASH] != seq or pairs[row, K_SLOT] != tag):
        row = _i64((np.uint64(row) + _ONE) & mask)
    return row


@inlined
def _holder(holders: Rows, seq: np.uint64) -> int:
    """The row of ``seq``, or the empty row where it would go."""
    mask = np.uint64(holders.shape[0] - 1)
    row = _i64(seq & mask)
    while holders[row, H_COUNT] != _ZERO and holders[row, H_HASH] != seq:
        row = _i64((np.uint64(row) + _ONE) & mask)
    return row


@kernel
def add(pairs: Rows, holders: Rows, used: Slots, seqs: Rows, slot: int) -> int:
    """Count a request's sequence hashes on ``slot``. ``used`` is ``[pair rows, holder rows]`` in use,
    kept up to date. Returns how many hashes the slot did not hold before (its new distinct blocks)."""
    added = 0
    word = HOLDER_WORDS + slot // 64
    bit = _ONE << np.uint64(slot % 64)
    for i in range(seqs.size):  # hot path: once per block of a booked request
        seq = seqs[i]
        row = _pair(pairs, seq, slot)
        if pairs[row, K_SLOT] != _ZERO:
            pairs[row, K_COUNT] += _ONE
            continue
        pairs[row, K_HASH] = seq
        pairs[row, K_SLOT] = np.uint64(slot + 1)
        pairs[row, K_COUNT] = _ONE
        used[0] += 1
        at = _holder(holders, seq)
        if holders[at, H_COUNT] == _ZERO:
            holders[at, H_HASH] = seq
            used[1] += 1
        holders[at, H_COUNT] += _ONE
        holders[at, word] |= bit
        added += 1
    return added


@kernel
def remove(pairs: Rows, holders: Rows, used: Slots, seqs: Rows, slot: int) -> int:
    """Take back what :func:`add` counted for the same hashes. Returns the blocks the slot no longer holds."""
    released = 0
    word = HOLDER_WORDS + slot // 64
    bit = _ONE << np.uint64(slot % 64)
    for i in range(seqs.size):
        seq = seqs[i]
        row = _pair(pairs, seq, slot)
        if pairs[row, K_SLOT] == _ZERO:
            continue  # not counted: a caller freeing what it never added
        if pairs[row, K_COUNT] > _ONE:
            pairs[row, K_COUNT] -= _ONE
            continue
        _delete(pairs, row, True)
        used[0] -= 1
        at = _holder(holders, seq)
        holders[at, word] &= ~bit
        holders[at, H_COUNT] -= _ONE
        if holders[at, H_COUNT] == _ZERO:
            _delete(holders, at, False)
            used[1] -= 1
        released += 1
    return released


@kernel
def rehash(old: Rows, new: Rows, pairs: bool) -> None:
    """Insert every row of ``old`` into the empty, larger ``new`` of the same width."""
    mask = np.uint64(new.shape[0] - 1)
    for row in range(old.shape[0]):
        if old[row, 1] == _ZERO:
            continue
        at = _home(old, row, mask, pairs)
        while new[at, 1] != _ZERO:
            at = _i64((np.uint64(at) + _ONE) & mask)
        new[at, :] = old[row, :]


@kernel
def held_run(pairs: Rows, seqs: Rows, slot: int) -> int:
    """How many leading hashes of ``seqs`` the active requests of ``slot`` hold."""
    for i in range(seqs.size):
        if pairs[_pair(pairs, seqs[i], slot), K_SLOT] == _ZERO:
            return i
    return seqs.size


@kernel
def leading(holders: Rows, seqs: Rows, out: Slots, touched: Slots, alive: Slots) -> int:
    """Per slot, the leading blocks of the prompt ``seqs`` its active requests hold, written to ``out`` for
    the slots holding the first block (the others are left as they are: 0). Those slots go to
    ``touched``, their number is returned, so the caller can zero them again. ``touched`` holds at least
    as many entries as there are slots; ``alive``, scratch, as many and at least 2.

    The slots still matching are kept a bitset word at a time, as ``(word, bits)`` pairs in ``alive`` (at
    most one pair per 64 slots, so they fit): a block costs one probe and one AND per word still
    matching, and a bit scan only for the slots that stop there. Testing each slot's bit instead cost a
    test per slot per block, most of a 16-worker decision's time in the walk."""
    if seqs.size == 0:
        return 0
    rows = holders.reshape(holders.size)
    width = holders.shape[1]
    mask = np.uint64(holders.shape[0] - 1)
    for depth in range(min(PREFETCH_AHEAD, seqs.size)):
        _prefetch_line(rows, _i64(seqs[depth] & mask) * width)
    at = _holder(holders, seqs[0])
    if holders[at, H_COUNT] == _ZERO:
        return 0
    n = 0
    live = 0
    for w in range(holders.shape[1] - HOLDER_WORDS):
        bits = holders[at, HOLDER_WORDS + w]
        if bits == _ZERO:
            continue
        alive[2 * live] = w
        alive[2 * live + 1] = _i64(bits)
        live += 1
        while bits != _ZERO:
            touched[n] = w * 64 + _lowest_bit(bits)
            n += 1
            bits &= bits - _ONE
    for depth in range(1, seqs.size):  # hot path: one probe a block, one AND per word still matching
        if depth + PREFETCH_AHEAD < seqs.size:
            _prefetch_line(rows, _i64(seqs[depth + PREFETCH_AHEAD] & mask) * width)
        at = _holder(holders, seqs[depth])
        held = holders[at, H_COUNT] != _ZERO
        kept = 0
        for k in range(live):
            w = alive[2 * k]
            bits = np.uint64(alive[2 * k + 1])
            still = bits & holders[at, HOLDER_WORDS + w] if held else _ZERO
            gone = bits ^ still
            while gone != _ZERO:  # these slots' runs end here
                out[w * 64 + _lowest_bit(gone)] = depth
                gone &= gone - _ONE
            if still != _ZERO:
                alive[2 * kept] = w
                alive[2 * kept + 1] = _i64(still)
                kept += 1
        live = kept
        if live == 0:
            return n
    for k in range(live):
        w = alive[2 * k]
        bits = np.uint64(alive[2 * k + 1])
        while bits != _ZERO:
            out[w * 64 + _lowest_bit(bits)] = seqs.size
            bits &= bits - _ONE
    return n
