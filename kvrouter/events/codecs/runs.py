"""Compiled decoder of engine batches straight into an apply run: many messages, one call, no objects.

Why: the Python decoder (:mod:`._engine`) costs 18-50 µs a vLLM message of 80 blocks, and the objects it
builds cost as much again in the applier (``RawEvent``, ``Unit``, a run packed per message). This pass
reads a whole drain of one stream's payloads, concatenated, in one numba call: it parses the msgpack of
both encodings (``"type"`` maps and tag-first arrays), re-hashes each store's tokens into local hashes
(:func:`~kvrouter.hashing._xxh3.hash_blocks`), and writes every event into the run arrays of
``events/packed.py``, ready for the table kernels.

It decodes only what it decodes exactly as :class:`._engine.EngineDecoder` would, and gives up on a message
at the first thing it does not (a LoRA name, extra keys, a cache salt, EAGLE pairs, a block size not the
router's, a store with blocks past its tokens, a removal of nothing, an unknown medium or tag, another
dp rank, a map or an ext value or a non-ASCII string anywhere, a duplicate key, trailing bytes). It never
reports an error: a message it gives up on goes to the Python decoder, which applies it or names what is
wrong with it, so the error messages and counters of bad input cannot differ. The messages before it
are kept. ``tests/plane/test_batch_path.py`` holds both paths equal on generated batches.

Rejected alternative: a complete decoder, errors included, in numba. It would hold a second copy of every
field check and message; the cost of giving up is one wasted parse of a message that is rare by nature.

Rules for every function here: numpy arrays in, integers out, no Python objects, no allocation.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Final

import numpy as np
import numpy.typing as npt

from ...hashing._xxh3 import hash_blocks
from ..model import TIER_NAMES
from ..packed import CLEARED, REMOVED, STORED, STORED_UNDER
from ._engine import I32_MAX, MAIN_ATTENTION_KINDS, Dialect
from ._fields import U32_MAX
from ._prescan import Bytes, _header, _kernel, _uint

__all__ = [
    "C_EVENTS",
    "C_MIXED",
    "C_NEXT",
    "C_SKIPPED",
    "DONE",
    "GAVE_UP",
    "NEED_ROOM",
    "RunDecoder",
    "decode_kvrouter_runs",
    "decode_runs",
]

DONE: Final = 0
"""Every message from ``first`` on is in the run."""
GAVE_UP: Final = 1
"""Message ``counts[C_NEXT]`` is not one this pass decodes: the Python decoder takes it."""
NEED_ROOM: Final = 2
"""The run arrays are full at message ``counts[C_NEXT]``: apply what is there, then call again from it."""

C_NEXT, C_EVENTS, C_BLOCKS, C_LOCAL, C_SKIPPED, C_LAST, C_MIXED = 0, 1, 2, 3, 4, 5, 6
"""Words of ``counts``: the first message not in the run, then the run's events, engine hashes, local
hashes, the engine events skipped (another attention group, as ``RawBatch.skipped_events``), the last
event id taken (kvrouter batches, whose events carry ids), and 1 when the run holds a clear or more than one
tier (0: the table kernels can take it whole, in one call)."""

F_TYPE, F_HASHES, F_PARENT, F_TOKENS, F_SIZE, F_LORA_NAME, F_EXTRA_KEYS, F_MEDIUM = 0, 1, 2, 3, 4, 5, 6, 7
F_GROUP, F_KIND, F_SALT = 8, 9, 10
FIELDS: Final = (
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_name",
    "extra_keys",
    "medium",
    "group_idx",
    "kv_cache_spec_kind",
    "cache_salt",
)
"""The fields this pass reads, by their ``F_*`` code; any other key is skipped, as the Python decoder
ignores it."""
TAGS: Final = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
T_STORED, T_REMOVED, T_CLEARED = len(FIELDS), len(FIELDS) + 1, len(FIELDS) + 2
MAIN_KINDS_AT: Final = len(FIELDS) + len(TAGS)
TIERS_AT: Final = MAIN_KINDS_AT + len(MAIN_ATTENTION_KINDS)
_NAMES: Final = (*FIELDS, *TAGS, *sorted(MAIN_ATTENTION_KINDS), *TIER_NAMES)

INITIAL_EVENTS: Final = 1 << 12
INITIAL_BLOCKS: Final = 1 << 16
"""A stream's first run arrays: a drain of 256 vLLM messages of 80 blocks fits (1 MiB of hashes)."""

_NIL: Final = 0xC0
_SEED: Final = np.uint64(1337)
"""The hashing seed of a block with neither LoRA name nor salt (``hashing/blocks.py``): all this pass hashes."""


class RunNames:
    """The strings a kernel compares, as arrays it can take: every name, concatenated, with its bounds; each
    medium's tier rank; and an engine dialect's array layouts as field codes (-1: a position not read)."""

    def __init__(self, names: tuple[str, ...], dialect: Dialect | None = None) -> None:
        encoded = [name.encode() for name in names]
        self.names = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self.bounds = np.cumsum([0, *map(len, encoded)]).astype(np.int64)
        self.tiers = np.array([tier.rank for tier in TIER_NAMES.values()], dtype=np.int64)
        self.stored = _layout(dialect.stored_fields if dialect else ())
        self.removed = _layout(dialect.removed_fields if dialect else ())
        self.salted = bool(dialect and dialect.extra_keys_salted)


def _layout(fields: tuple[str, ...]) -> npt.NDArray[np.int64]:
    return np.array([FIELDS.index(f) if f in FIELDS else -1 for f in fields], dtype=np.int64)


@_kernel
def _name(buf: Bytes, pos: int, names: Bytes, bounds: npt.NDArray[np.int64], lo: int, hi: int) -> int:
    """The index in ``[lo, hi)`` of the name the string at ``pos`` is; -1 for none, -2 when it is not a
    string, or is one the Python decoder might refuse (non-ASCII: it could be invalid UTF-8)."""
    kind, count, head = _header(buf, pos)
    if kind != 3:
        return -2
    start = pos + head
    if start + count > buf.size:
        return -2
    for i in range(lo, hi):
        at = bounds[i]
        if bounds[i + 1] - at != count:
            continue
        same = True
        for k in range(count):
            if buf[start + k] != names[at + k]:
                same = False
                break
        if same:
            return i
    for k in range(start, start + count):
        if buf[k] >= 0x80:
            return -2
    return -1


@_kernel
def _skip(buf: Bytes, pos: int) -> int:
    """The position after the value at ``pos``, or -1 when it holds what the Python decoder might read
    differently or refuse: a map (its keys might not be hashable), an ext, a non-ASCII string."""
    remaining = 1
    while remaining > 0:
        kind, count, head = _header(buf, pos)
        if kind < 0 or kind == 2:
            return -1
        if kind == 3:
            if pos + head + count > buf.size:
                return -1
            for k in range(pos + head, pos + head + count):
                if buf[k] >= 0x80:
                    return -1
        pos += head
        if kind == 1:
            remaining += count
        else:
            pos += count
        remaining -= 1
        if pos > buf.size:
            return -1
    return pos


@_kernel
def _int(buf: Bytes, pos: int) -> tuple[int, np.uint64, bool]:
    """(position after it, the integer cast to u64, whether it is negative) of the integer at ``pos``;
    position -1 when it is not an integer."""
    end = buf.size
    if pos >= end:
        return -1, np.uint64(0), False
    b = int(buf[pos])
    if b <= 0x7F:
        return pos + 1, np.uint64(b), False
    if b >= 0xE0:
        return pos + 1, ~np.uint64(255 - b), True  # a negative fixint, b - 256, in two's complement
    if 0xCC <= b <= 0xD3:
        size = 1 << ((b - 0xCC) & 3)
        if pos + 1 + size > end:
            return -1, np.uint64(0), False
        word = np.uint64(0)
        for k in range(size):
            word = (word << np.uint64(8)) | np.uint64(buf[pos + 1 + k])
        negative = b >= 0xD0 and buf[pos + 1] >= 0x80
        if negative and size < 8:  # sign-extend to 64 bits
            word |= ~((np.uint64(1) << np.uint64(8 * size)) - np.uint64(1))
        return pos + 1 + size, word, negative
    return -1, np.uint64(0), False


@_kernel
def _tokens(buf: Bytes, pos: int, out: npt.NDArray[np.uint32]) -> tuple[int, int]:
    """(position after it, count) of the array of u32 token ids at ``pos``, written to ``out``; position -1
    when it is not one (or ``out`` cannot hold it). One pass, for the unsigned encodings only: a token is
    never negative, so anything else is not a token."""
    kind, count, head = _header(buf, pos)
    if kind != 1 or count > out.size:
        return -1, 0
    p = pos + head
    end = buf.size
    for k in range(count):  # hot path: every token of the batch
        if p >= end:
            return -1, 0
        b = buf[p]
        if b <= 0x7F:
            out[k] = b
            p += 1
        elif b == 0xCD and p + 3 <= end:
            out[k] = (np.uint32(buf[p + 1]) << np.uint32(8)) | np.uint32(buf[p + 2])
            p += 3
        elif b == 0xCE and p + 5 <= end:
            out[k] = (
                (np.uint32(buf[p + 1]) << np.uint32(24))
                | (np.uint32(buf[p + 2]) << np.uint32(16))
                | (np.uint32(buf[p + 3]) << np.uint32(8))
                | np.uint32(buf[p + 4])
            )
            p += 5
        elif b == 0xCC and p + 2 <= end:
            out[k] = buf[p + 1]
            p += 2
        else:
            return -1, 0
    return p, count


@_kernel
def _hashes(buf: Bytes, pos: int, out: npt.NDArray[np.uint64], at: int) -> tuple[int, int]:
    """(position after it, count) of the array of integer hashes at ``pos``, cast to u64 into ``out[at:]``;
    position -1 when it is not one, -2 when ``out`` has no room for it."""
    kind, count, head = _header(buf, pos)
    if kind != 1:
        return -1, 0
    if at + count > out.size:
        return -2, 0
    p = pos + head
    end = buf.size
    for k in range(count):  # hot path: every engine hash of the batch
        if p + 9 <= end and buf[p] == 0xCF:  # a u64: what engines send for nearly every hash
            word = np.uint64(0)
            for i in range(1, 9):
                word = (word << np.uint64(8)) | np.uint64(buf[p + i])
            out[at + k] = word
            p += 9
            continue
        p, value, _ = _int(buf, p)
        if p < 0:
            return -1, 0
        out[at + k] = value
    return p, count


@_kernel
def _number(buf: Bytes, pos: int, word: npt.NDArray[np.uint64], real: npt.NDArray[np.float64]) -> tuple[int, float]:
    """(position after it, value) of the number at ``pos`` (an integer or a float, as ``expect_float``
    takes); position -1 otherwise. ``word`` and ``real`` are one 8-byte scratch word, seen two ways."""
    if pos >= buf.size:
        return -1, 0.0
    b = int(buf[pos])
    if b == 0xCB or b == 0xCA:
        size = 8 if b == 0xCB else 4
        if pos + 1 + size > buf.size:
            return -1, 0.0
        if size == 8:
            word[0] = np.uint64(_uint(buf, pos + 1, 8))
            return pos + 9, real[0]
        word[0] = np.uint64(_uint(buf, pos + 1, 4))
        return pos + 5, float(word.view(np.float32)[0])  # little-endian: the low half is the f32
    after, value, negative = _int(buf, pos)
    if after < 0:
        return -1, 0.0
    return after, float(np.int64(value)) if negative else float(value)


@_kernel
def _nil_or_empty_list(buf: Bytes, pos: int) -> bool:
    """``extra_keys`` that say nothing: absent, nil, or an array of nils (no multimodal key, no salt)."""
    if pos < 0 or buf[pos] == _NIL:
        return True
    kind, count, head = _header(buf, pos)
    if kind != 1 or pos + head + count > buf.size:
        return False
    for k in range(count):  # noqa: SIM110 - numba compiles a loop, not all() over a generator
        if buf[pos + head + k] != _NIL:
            return False
    return True


@_kernel
def _finish(
    counts: npt.NDArray[np.int64],
    m: int,
    events: int,
    blocks: int,
    local: int,
    skipped: int,
    kinds: npt.NDArray[np.uint8],
    tiers: npt.NDArray[np.uint8],
) -> None:
    """Write ``counts`` for a run of ``events`` events ending before message ``m``."""
    counts[C_NEXT] = m
    counts[C_EVENTS] = events
    counts[C_BLOCKS] = blocks
    counts[C_LOCAL] = local
    counts[C_SKIPPED] = skipped
    mixed = 0
    for i in range(events):
        if kinds[i] == CLEARED or tiers[i] != tiers[0]:
            mixed = 1
            break
    counts[C_MIXED] = mixed


@_kernel
def decode_runs(
    buf: Bytes,
    bounds: npt.NDArray[np.int64],
    first: int,
    seqs: npt.NDArray[np.uint64],
    expected: np.uint64,
    names: Bytes,
    name_bounds: npt.NDArray[np.int64],
    tier_ranks: npt.NDArray[np.int64],
    stored_layout: npt.NDArray[np.int64],
    removed_layout: npt.NDArray[np.int64],
    salted: bool,
    block_size: int,
    rank: int,
    kinds: npt.NDArray[np.uint8],
    tiers: npt.NDArray[np.uint8],
    parents: npt.NDArray[np.uint64],
    offsets: npt.NDArray[np.int64],
    engine: npt.NDArray[np.uint64],
    local: npt.NDArray[np.uint64],
    tokens: npt.NDArray[np.uint32],
    stamps: npt.NDArray[np.float64],
    fields: npt.NDArray[np.int64],
    word: npt.NDArray[np.uint64],
    real: npt.NDArray[np.float64],
    counts: npt.NDArray[np.int64],
) -> int:
    """Decode messages ``first``, ``first + 1``, ... (``buf[bounds[m]:bounds[m + 1]]``, engine batches
    ``[ts, events, dp_rank]`` of one worker's dp rank ``rank``, whose ZMQ sequence numbers ``seqs[m]`` must
    run on from ``expected``) into the run arrays, from their start.

    ``stamps[m]`` gets message ``m``'s timestamp. ``tokens`` must hold the tokens of any one event (as
    many words as the longest message has bytes will do); ``fields`` is scratch of ``len(FIELDS)`` words.
    ``counts`` (``C_*``) tells how far it got. Returns :data:`DONE`, :data:`GAVE_UP` or :data:`NEED_ROOM`;
    on either of the last two, the run holds exactly the messages before ``counts[C_NEXT]``.
    """
    n_events = 0
    n_blocks = 0
    n_local = 0
    n_skipped = 0
    offsets[0] = 0
    status = DONE
    m = first
    while m < bounds.size - 1:
        msg = buf[bounds[m] : bounds[m + 1]]
        events, blocks, nlocal, skipped = n_events, n_blocks, n_local, n_skipped
        status = GAVE_UP  # until the message is through
        if seqs[m] != expected + np.uint64(m - first):  # out of order: the stream's own logic reads it
            break
        kind, count, head = _header(msg, 0)
        if kind != 1 or count < 2 or count > 3:
            break
        pos, stamp = _number(msg, head, word, real)
        if pos < 0:
            break
        kind, n, head = _header(msg, pos)
        if kind != 1:
            break
        pos += head
        ok = True
        for _ in range(n):  # hot path: one engine event
            kind, nfields, head = _header(msg, pos)
            fields[:] = -1
            tag = -1
            ntokens = 0
            nhashes = 0
            if kind == 2:
                pos += head
                for _ in range(nfields):
                    code = _name(msg, pos, names, name_bounds, 0, len(FIELDS))
                    if code == -2:
                        ok = False
                        break
                    pos = _skip(msg, pos)
                    if pos < 0:
                        ok = False
                        break
                    if code >= 0:
                        if fields[code] >= 0:
                            ok = False  # a duplicate key: the Python decoder keeps the last
                            break
                        fields[code] = pos
                    if code == F_TOKENS:
                        pos, ntokens = _tokens(msg, pos, tokens)
                    elif code == F_HASHES:
                        pos, nhashes = _hashes(msg, pos, engine, n_blocks)
                    else:
                        pos = _skip(msg, pos)
                    if pos < 0:
                        status = NEED_ROOM if pos == -2 else GAVE_UP
                        ok = False
                        break
                if not ok or fields[F_TYPE] < 0:
                    ok = False
                    break
                tag = _name(msg, fields[F_TYPE], names, name_bounds, T_STORED, T_CLEARED + 1)
            elif kind == 1 and nfields > 0:
                pos += head
                tag = _name(msg, pos, names, name_bounds, T_STORED, T_CLEARED + 1)
                pos = _skip(msg, pos)
                layout = stored_layout if tag == T_STORED else removed_layout
                for k in range(nfields - 1):
                    if pos < 0:
                        break
                    code = layout[k] if tag != T_CLEARED and k < layout.size else -1
                    if code >= 0:
                        fields[code] = pos
                    if code == F_TOKENS:
                        pos, ntokens = _tokens(msg, pos, tokens)
                    elif code == F_HASHES:
                        pos, nhashes = _hashes(msg, pos, engine, n_blocks)
                    else:
                        pos = _skip(msg, pos)
                if pos < 0:
                    status = NEED_ROOM if pos == -2 else GAVE_UP
                    ok = False
                    break
            if tag < 0:
                ok = False
                break
            if n_events >= kinds.size:
                status = NEED_ROOM
                ok = False
                break
            if tag == T_CLEARED:
                kinds[n_events] = CLEARED
                tiers[n_events] = 0
                n_events += 1
                offsets[n_events] = n_blocks
                continue
            # The main attention group (``_engine._main_attention``): a kind, when named, decides alone.
            at = fields[F_GROUP]
            group = 0
            if at >= 0 and msg[at] != _NIL:
                after, value, negative = _int(msg, at)
                if after < 0 or negative or value > np.uint64(U32_MAX):
                    ok = False
                    break
                group = int(value)
            at = fields[F_KIND]
            main = group == 0
            if at >= 0 and msg[at] != _NIL:
                which = _name(msg, at, names, name_bounds, MAIN_KINDS_AT, TIERS_AT)
                if which == -2:
                    ok = False
                    break
                main = which >= 0
            at = fields[F_MEDIUM]
            tier = 0
            if at >= 0 and msg[at] != _NIL:
                which = _name(msg, at, names, name_bounds, TIERS_AT, name_bounds.size - 1)
                if which < 0:
                    ok = False
                    break
                tier = tier_ranks[which - TIERS_AT]
            if fields[F_HASHES] < 0 or nhashes == 0:  # read in place above, into engine[n_blocks:]
                ok = False
                break
            if tag == T_REMOVED:
                if main:
                    kinds[n_events] = REMOVED
                    tiers[n_events] = tier
                    n_blocks += nhashes
                    n_events += 1
                    offsets[n_events] = n_blocks
                else:
                    n_skipped += 1
                continue
            # A store: only one hashed with the plain seed, whose every block has its tokens.
            if fields[F_TOKENS] < 0 or fields[F_SIZE] < 0:
                ok = False
                break
            if fields[F_LORA_NAME] >= 0 and msg[fields[F_LORA_NAME]] != _NIL:
                ok = False
                break
            if not _nil_or_empty_list(msg, fields[F_EXTRA_KEYS]):
                ok = False
                break
            at = fields[F_SALT]
            if not salted and at >= 0 and msg[at] != _NIL and msg[at] != 0xA0:  # nil or "": no salt
                ok = False
                break
            after, size, negative = _int(msg, fields[F_SIZE])
            if after < 0 or negative or int(size) != block_size:
                ok = False
                break
            parent = np.uint64(0)
            under = False
            at = fields[F_PARENT]
            if at >= 0 and msg[at] != _NIL:
                after, parent, _ = _int(msg, at)
                if after < 0:
                    ok = False
                    break
                under = True
            if ntokens // block_size < nhashes:  # the tokens were read in place above
                ok = False
                break
            if not main:
                n_skipped += 1
                continue
            if n_local + nhashes > local.size:
                status = NEED_ROOM
                ok = False
                break
            hash_blocks(tokens, block_size, block_size, _SEED, local[n_local : n_local + nhashes])
            kinds[n_events] = STORED_UNDER if under else STORED
            tiers[n_events] = tier
            parents[n_events] = parent
            n_local += nhashes
            n_blocks += nhashes
            n_events += 1
            offsets[n_events] = n_blocks
        if ok and count == 3 and pos >= 0:
            if msg[pos] == _NIL:
                pos += 1
            else:
                pos, value, negative = _int(msg, pos)
                if pos < 0 or negative or value > np.uint64(I32_MAX) or int(value) != rank:
                    ok = False
        elif ok and rank != 0:
            ok = False
        if not ok or pos != msg.size:
            n_events, n_blocks, n_local, n_skipped = events, blocks, nlocal, skipped
            break
        stamps[m] = stamp
        status = DONE
        m += 1
    _finish(counts, m, n_events, n_blocks, n_local, n_skipped, kinds, tiers)
    return status


K_VERSION, K_TS, K_WORKER, K_RANK, K_EVENTS = 0, 1, 2, 3, 4
KVROUTER_KEYS: Final = ("v", "ts", "worker_id", "dp_rank", "events")
"""The keys of a kvrouter batch this pass reads, by their ``K_*`` code (``codecs/kvrouter.py``)."""
KVROUTER_TAGS: Final = ("S", "R", "C")
K_STORED, K_REMOVED, K_CLEARED = len(KVROUTER_KEYS), len(KVROUTER_KEYS) + 1, len(KVROUTER_KEYS) + 2
K_TIERS_AT: Final = len(KVROUTER_KEYS) + len(KVROUTER_TAGS)
_KVROUTER_NAMES: Final = (*KVROUTER_KEYS, *KVROUTER_TAGS, *TIER_NAMES)
KVROUTER_LEAST: Final = 2
"""A drain of one kvrouter message is read one by one: its Python decode (msgpack and a ``frombuffer`` per
hash array) costs less than this path's fixed cost a drain, about 10 µs of argument checks and array
slicing (a one-message drain of 80 blocks: 46 µs this way, 36 the other; an engine message, whose Python
decode re-hashes its tokens, is cheaper here even alone: 48 µs against 58)."""


@_kernel
def _packed(buf: Bytes, pos: int, width: int) -> tuple[int, int]:
    """(position of the bytes, count of ``width``-byte values) of the ``bin`` at ``pos``; position -1 when
    it is not a bin of whole values."""
    if pos >= buf.size or buf[pos] < 0xC4 or buf[pos] > 0xC6:
        return -1, 0
    kind, size, head = _header(buf, pos)
    if kind != 0 or size % width or pos + head + size > buf.size:
        return -1, 0
    return pos + head, size // width


@_kernel
def _copy_words(buf: Bytes, pos: int, count: int, out: npt.NDArray[np.uint64], at: int) -> None:
    """``count`` little-endian u64 words at ``buf[pos:]`` into ``out[at:]``."""
    for k in range(count):
        word = np.uint64(0)
        for i in range(7, -1, -1):
            word = (word << np.uint64(8)) | np.uint64(buf[pos + 8 * k + i])
        out[at + k] = word


@_kernel
def decode_kvrouter_runs(
    buf: Bytes,
    bounds: npt.NDArray[np.int64],
    first: int,
    expected: np.uint64,
    names: Bytes,
    name_bounds: npt.NDArray[np.int64],
    tier_ranks: npt.NDArray[np.int64],
    worker_id: np.uint64,
    rank: int,
    kinds: npt.NDArray[np.uint8],
    tiers: npt.NDArray[np.uint8],
    parents: npt.NDArray[np.uint64],
    offsets: npt.NDArray[np.int64],
    engine: npt.NDArray[np.uint64],
    local: npt.NDArray[np.uint64],
    stamps: npt.NDArray[np.float64],
    fields: npt.NDArray[np.int64],
    word: npt.NDArray[np.uint64],
    real: npt.NDArray[np.float64],
    counts: npt.NDArray[np.int64],
) -> int:
    """:func:`decode_runs` for kvrouter batches (``{v, ts, worker_id, dp_rank, events}``, hashes as packed
    bins), whose events carry ids: every event of the run must be the next id from ``expected`` on, and
    ``counts[C_LAST]`` gets the last id taken. A batch of no event is left to the stream, which ignores it."""
    n_events = 0
    n_blocks = 0
    n_local = 0
    offsets[0] = 0
    status = DONE
    m = first
    last = expected - np.uint64(1)
    while m < bounds.size - 1:
        msg = buf[bounds[m] : bounds[m + 1]]
        events, blocks, nlocal, before = n_events, n_blocks, n_local, last
        status = GAVE_UP
        kind, count, head = _header(msg, 0)
        if kind != 2:
            break
        pos = head
        fields[: len(KVROUTER_KEYS)] = -1
        for _ in range(count):
            code = _name(msg, pos, names, name_bounds, 0, len(KVROUTER_KEYS))
            if code == -2:
                pos = -1
                break
            pos = _skip(msg, pos)
            if pos < 0 or (code >= 0 and fields[code] >= 0):
                pos = -1
                break
            if code >= 0:
                fields[code] = pos
            pos = _skip(msg, pos)
            if pos < 0:
                break
        if pos != msg.size or fields[K_VERSION] < 0 or fields[K_WORKER] < 0 or fields[K_RANK] < 0:
            break
        if fields[K_EVENTS] < 0:
            break
        after, value, negative = _int(msg, fields[K_VERSION])
        if after < 0 or negative or value != np.uint64(1):
            break
        after, value, negative = _int(msg, fields[K_WORKER])
        if after < 0 or negative or value != worker_id:
            break
        after, value, negative = _int(msg, fields[K_RANK])
        if after < 0 or negative or value != np.uint64(rank):
            break
        stamp = 0.0
        at = fields[K_TS]
        if at >= 0 and msg[at] != _NIL:
            after, stamp = _number(msg, at, word, real)
            if after < 0:
                break
        kind, n, head = _header(msg, fields[K_EVENTS])
        if kind != 1 or n == 0:
            break
        pos = fields[K_EVENTS] + head
        ok = True
        for _ in range(n):  # hot path: one event
            kind, items, head = _header(msg, pos)
            if kind != 1 or items < 3:
                ok = False
                break
            at = pos + head
            tag = _name(msg, at, names, name_bounds, K_STORED, K_CLEARED + 1)
            at = _skip(msg, at)
            if tag < 0 or at < 0:
                ok = False
                break
            after, value, negative = _int(msg, at)
            if after < 0 or negative or value != last + np.uint64(1):
                ok = False
                break
            last = value
            which = _name(msg, after, names, name_bounds, K_TIERS_AT, name_bounds.size - 1)
            if which < 0:
                ok = False
                break
            tier = tier_ranks[which - K_TIERS_AT]
            at = _skip(msg, after)
            if n_events >= kinds.size:
                status = NEED_ROOM
                ok = False
                break
            if tag == K_CLEARED:
                kinds[n_events] = CLEARED
            elif tag == K_REMOVED:
                if items < 4:
                    ok = False
                    break
                start, nhashes = _packed(msg, at, 8)
                if start < 0 or nhashes == 0:
                    ok = False
                    break
                if n_blocks + nhashes > engine.size:
                    status = NEED_ROOM
                    ok = False
                    break
                _copy_words(msg, start, nhashes, engine, n_blocks)
                n_blocks += nhashes
                kinds[n_events] = REMOVED
            else:
                if items < 7:
                    ok = False
                    break
                parent = np.uint64(0)
                under = msg[at] != _NIL
                if under:
                    after, parent, negative = _int(msg, at)
                    if after < 0 or negative:
                        ok = False
                        break
                at = _skip(msg, at)
                start, nhashes = _packed(msg, at, 8)
                at = _skip(msg, at) if start >= 0 else -1
                from_local, nlocal = _packed(msg, at, 8) if at >= 0 else (-1, 0)
                at = _skip(msg, at) if from_local >= 0 else -1
                if at < 0 or nhashes == 0 or nlocal != nhashes:
                    ok = False
                    break
                if msg[at] != _NIL:  # the tokens, for recordings only: checked, not read
                    tokens_at, ntokens = _packed(msg, at, 4)
                    if tokens_at < 0 or ntokens % nhashes:
                        ok = False
                        break
                if n_blocks + nhashes > engine.size or n_local + nhashes > local.size:
                    status = NEED_ROOM
                    ok = False
                    break
                _copy_words(msg, start, nhashes, engine, n_blocks)
                _copy_words(msg, from_local, nhashes, local, n_local)
                n_blocks += nhashes
                n_local += nhashes
                kinds[n_events] = STORED_UNDER if under else STORED
                parents[n_events] = parent
            tiers[n_events] = tier
            n_events += 1
            offsets[n_events] = n_blocks
            pos = _skip(msg, pos)
            if pos < 0:
                ok = False
                break
        if not ok:
            n_events, n_blocks, n_local, last = events, blocks, nlocal, before
            break
        stamps[m] = stamp
        status = DONE
        m += 1
    _finish(counts, m, n_events, n_blocks, n_local, 0, kinds, tiers)
    counts[C_LAST] = np.int64(last)
    return status


class RunDecoder:
    """One stream's compiled decoding: its messages of one drain, loaded once, and the run arrays they are
    decoded into (kept, grown, never shrunk: a drain allocates nothing once the stream is warm).

    Args:
        dialect: the engine's (``vllm.Decoder.dialect``, ``sglang.Decoder.dialect``), or None for kvrouter
            batches.
        worker_id: the stream's worker (kvrouter batches name theirs; engine batches do not).
        rank: the stream's dp rank: a batch naming another is left to the stream.
        block_size: the router's; an engine store of another size is left to the stream.
    """

    def __init__(self, dialect: Dialect | None, worker_id: int, rank: int, block_size: int) -> None:
        self._dialect = dialect
        self.least = 1 if dialect else KVROUTER_LEAST
        """The fewest messages a drain needs for this path to pay (``on_drain`` reads smaller ones one by one)."""
        self._names = RunNames(_NAMES if dialect else _KVROUTER_NAMES, dialect)
        self.worker_id = np.uint64(worker_id)
        self.rank = rank
        self.block_size = block_size
        self._buf = np.empty(0, dtype=np.uint8)
        self._bounds = np.zeros(1, dtype=np.int64)
        self.seqs = np.empty(0, dtype=np.uint64)
        self.stamps = np.empty(0, dtype=np.float64)
        self._tokens = np.empty(0, dtype=np.uint32)
        self._fields = np.empty(len(FIELDS), dtype=np.int64)
        self._word = np.zeros(1, dtype=np.uint64)
        self._real = self._word.view(np.float64)
        self.counts = np.zeros(7, dtype=np.int64)
        self._grow(INITIAL_EVENTS, INITIAL_BLOCKS)

    def _grow(self, events: int, blocks: int) -> None:
        self.kinds = np.empty(events, dtype=np.uint8)
        self.tiers = np.empty(events, dtype=np.uint8)
        self.parents = np.zeros(events, dtype=np.uint64)
        self.offsets = np.empty(events + 1, dtype=np.int64)
        self.engine = np.empty(blocks, dtype=np.uint64)
        self.local = np.empty(blocks, dtype=np.uint64)

    def load(self, payloads: list[bytes], seqs: list[int]) -> None:
        """The drain's payloads, in order, with their ZMQ sequence numbers (an empty payload: a message this
        path must leave to the stream)."""
        self._buf = np.frombuffer(b"".join(payloads), dtype=np.uint8)
        lengths = list(map(len, payloads))
        self._bounds = np.fromiter(accumulate(lengths, initial=0), dtype=np.int64, count=len(payloads) + 1)
        self.seqs = np.array(seqs, dtype=np.uint64)
        if self.stamps.size < len(payloads):
            self.stamps = np.empty(2 * len(payloads), dtype=np.float64)
        longest = max(lengths, default=0)
        if self._dialect is not None and self._tokens.size < longest:  # a token takes a byte or more
            self._tokens = np.empty(2 * longest, dtype=np.uint32)

    def decode(self, first: int, expected: int) -> int:
        """Decode from message ``first``, whose first id must be ``expected`` (the ZMQ sequence number for an
        engine, the event id for kvrouter batches), while the ids follow on, as far as the run arrays allow
        (:data:`DONE`, :data:`GAVE_UP` or :data:`NEED_ROOM`; ``counts`` says how far, :meth:`last` the last id
        taken). A message that alone does not fit grows the arrays, so a call always makes progress or gives
        up."""
        while True:
            status = self._call(first, expected)
            if status != NEED_ROOM or self.counts[C_NEXT] > first:
                return status
            size = int(self._bounds[first + 1] - self._bounds[first])  # one hash or event takes a byte or more
            self._grow(max(2 * self.kinds.size, size), max(2 * self.engine.size, size))

    def last(self) -> int:
        """The id of the last message (engines) or event (kvrouter) the run holds."""
        if self._dialect is None:
            return int(self.counts[C_LAST]) % (1 << 64)
        return int(self.seqs[self.counts[C_NEXT] - 1])

    def _call(self, first: int, expected: int) -> int:
        n = self._names
        if self._dialect is None:
            return decode_kvrouter_runs(
                self._buf,
                self._bounds,
                first,
                np.uint64(expected),
                n.names,
                n.bounds,
                n.tiers,
                self.worker_id,
                self.rank,
                self.kinds,
                self.tiers,
                self.parents,
                self.offsets,
                self.engine,
                self.local,
                self.stamps,
                self._fields,
                self._word,
                self._real,
                self.counts,
            )
        return decode_runs(
            self._buf,
            self._bounds,
            first,
            self.seqs,
            np.uint64(expected),
            n.names,
            n.bounds,
            n.tiers,
            n.stored,
            n.removed,
            n.salted,
            self.block_size,
            self.rank,
            self.kinds,
            self.tiers,
            self.parents,
            self.offsets,
            self.engine,
            self.local,
            self._tokens,
            self.stamps,
            self._fields,
            self._word,
            self._real,
            self.counts,
        )
