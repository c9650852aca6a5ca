"""Compiled pre-pass over an engine batch: lifts the integer arrays of every event out as packed bytes.

Why: a vLLM store of 64 blocks of 16 tokens carries 1,024 token ids and 64 engine hashes as msgpack
integer arrays. ``msgpack.unpackb`` makes a Python int of each (the hashes and most token ids are too
large for the small-int cache), then the decoder walks them again to check their types and packs
them into a ``uint32`` / ``uint64`` array: about 40 µs an event on the bench machine, more than the
table store it feeds. This pass walks the msgpack bytes once in numba and, for every event's
``token_ids`` and ``block_hashes``, rewrites an array of integers as an ``ext`` value holding the
packed little-endian words, which :mod:`._engine` unpacks with one ``numpy.frombuffer``; everything
else is copied as it is, so the Python decoder still reads (and checks) every other field itself.

It lifts only what the decoder would accept unchanged: token arrays of integers in u32, hash arrays
of integers (msgpack has none outside [-2**63, 2**64), and a signed hash is stored as its two's
complement, as ``expect_hash`` casts it). An array holding anything else (a boolean, a float, a
bytes digest, an EAGLE pair, a token beyond u32) stays a list and takes the checked path, which
names the bad element. The pass never reports an error: on anything it does not expect (not an
array at the root, an ``ext`` value anywhere, truncated or trailing bytes) it gives up and the
decoder reads the original payload, so error messages cannot differ. Rejected alternative: a
complete msgpack decoder in numba, which would hold a second copy of every field check.

Rules for every function here: numpy arrays in, integers out, no Python objects, no allocation.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from ..._jit import inlined, kernel
from ._msgpack import Bytes, header

__all__ = ["EXT_HASHES", "EXT_TOKENS", "GAVE_UP", "NEED_ROOM", "lift_arrays"]

EXT_TOKENS: Final = 1
"""``ext`` type of a lifted ``token_ids`` array: little-endian u32 words."""
EXT_HASHES: Final = 2
"""``ext`` type of a lifted ``block_hashes`` array: little-endian u64 words."""
GAVE_UP: Final = -1
"""The payload is not a batch this pass understands; decode the original."""
NEED_ROOM: Final = -2
"""``out`` is too small; lifted words can take up to 8 times their msgpack bytes."""

_U32_MAX: Final = np.uint64((1 << 32) - 1)
_EIGHT: Final = np.uint64(8)
_BYTE: Final = np.uint64(0xFF)
_HIGH_BITS: Final = np.array([0] + [((1 << 64) - 1) ^ ((1 << (8 * n)) - 1) for n in range(1, 9)], dtype=np.uint64)
"""``_HIGH_BITS[n]``: the bits above an n-byte integer, or-ed in to sign-extend a negative one."""


@inlined
def _skip(buf: Bytes, pos: int) -> int:
    """The position after the value at ``pos``, or -1."""
    remaining = 1
    while remaining > 0:
        kind, count, head = header(buf, pos)
        if kind < 0:
            return -1
        pos += head
        if kind == 1:
            remaining += count
        elif kind == 2:
            remaining += 2 * count
        else:
            pos += count
        remaining -= 1
        if pos > buf.size:
            return -1
    return pos


@inlined
def _str_is(buf: Bytes, pos: int, name: Bytes) -> bool:
    """Whether the value at ``pos`` is the string ``name``."""
    kind, count, head = header(buf, pos)
    if kind != 3 or count != name.size or pos + head + count > buf.size:
        return False
    for k in range(count):  # noqa: SIM110 - numba compiles a loop, not all() over a generator
        if buf[pos + head + k] != name[k]:
            return False
    return True


@inlined
def _lift(buf: Bytes, pos: int, out: Bytes, at: int, ext: int) -> tuple[int, int]:
    """Write the integer array at ``pos`` as an ext value at ``out[at:]``.

    Returns:
        (the position after it in ``out``, the position after the array in ``buf``); the first is -1
        when the value is not a non-empty array of acceptable integers, -2 when ``out`` has no room.
    """
    kind, count, head = header(buf, pos)
    if kind != 1 or count == 0:
        return -1, 0
    width = 4 if ext == EXT_TOKENS else 8
    data = count * width
    ext_head = 3 if data < 0x100 else (4 if data < 0x10000 else 6)
    if at + ext_head + data > out.size:
        return -2, 0
    p = pos + head
    w = at + ext_head
    end = buf.size
    for _ in range(count):  # hot path: one integer, 1 to 9 bytes
        if p >= end:
            return -1, 0
        b = buf[p]
        negative = False
        if b <= 0x7F:
            word = np.uint64(b)
            p += 1
        elif b >= 0xE0:
            word = np.uint64(b) | _HIGH_BITS[1]  # negative fixint, sign-extended
            negative = True
            p += 1
        elif 0xCC <= b <= 0xD3:
            size = 1 << ((b - 0xCC) & 3)
            if p + 1 + size > end:
                return -1, 0
            word = np.uint64(0)
            for k in range(size):
                word = (word << _EIGHT) | np.uint64(buf[p + 1 + k])
            if b >= 0xD0 and buf[p + 1] >= 0x80:  # a negative signed int: sign-extend to 64 bits
                word |= _HIGH_BITS[size]
                negative = True
            p += 1 + size
        else:
            return -1, 0
        if width == 4 and (negative or word > _U32_MAX):  # tokens are u32; hashes take any int, cast
            return -1, 0
        out[w] = np.uint8(word & _BYTE)
        out[w + 1] = np.uint8((word >> np.uint64(8)) & _BYTE)
        out[w + 2] = np.uint8((word >> np.uint64(16)) & _BYTE)
        out[w + 3] = np.uint8((word >> np.uint64(24)) & _BYTE)
        if width == 8:
            out[w + 4] = np.uint8((word >> np.uint64(32)) & _BYTE)
            out[w + 5] = np.uint8((word >> np.uint64(40)) & _BYTE)
            out[w + 6] = np.uint8((word >> np.uint64(48)) & _BYTE)
            out[w + 7] = np.uint8((word >> np.uint64(56)) & _BYTE)
        w += width
    if ext_head == 3:
        out[at] = 0xC7
        out[at + 1] = data
    elif ext_head == 4:
        out[at] = 0xC8
        out[at + 1] = data >> 8
        out[at + 2] = data & 0xFF
    else:
        out[at] = 0xC9
        for k in range(4):
            out[at + 1 + k] = (data >> (24 - 8 * k)) & 0xFF
    out[at + ext_head - 1] = ext
    return w, p


@inlined
def _copy(buf: Bytes, start: int, stop: int, out: Bytes, at: int) -> int:
    """Copy ``buf[start:stop]`` to ``out[at:]``; the position after it, or -2 for no room."""
    if at + stop - start > out.size:
        return -2
    out[at : at + stop - start] = buf[start:stop]
    return at + stop - start


@kernel
def lift_arrays(
    buf: Bytes,
    out: Bytes,
    tokens_key: Bytes,
    hashes_key: Bytes,
    stored_tag: Bytes,
    removed_tag: Bytes,
    stored_hashes_at: int,
    stored_tokens_at: int,
    removed_hashes_at: int,
) -> int:
    """Rewrite the batch ``[ts, events, ...]`` in ``buf`` into ``out``, each event's integer
    ``token_ids`` / ``block_hashes`` array lifted into an ext value (:data:`EXT_TOKENS`,
    :data:`EXT_HASHES`): map events by key, tag-first array events by position (``*_at``: index
    in the event array, tag at 0).

    Returns:
        The length written to ``out``, :data:`GAVE_UP` or :data:`NEED_ROOM`.
    """
    kind, count, head = header(buf, 0)
    if kind != 1 or count < 2:
        return GAVE_UP
    pos = _skip(buf, head)  # ts
    if pos < 0:
        return GAVE_UP
    kind, events, head = header(buf, pos)
    if kind != 1:
        return GAVE_UP
    pos += head
    flushed = 0  # buf[:flushed] is in out[:o]
    o = 0
    for _ in range(events):  # hot path: one pass over every byte of the batch
        kind, fields, head = header(buf, pos)
        if kind < 0:
            return GAVE_UP
        if kind == 2 or kind == 1:
            tokens_at = -1
            hashes_at = -1
            if kind == 1 and fields > 0:
                if _str_is(buf, pos + head, stored_tag):
                    tokens_at, hashes_at = stored_tokens_at, stored_hashes_at
                elif _str_is(buf, pos + head, removed_tag):
                    hashes_at = removed_hashes_at
            pos += head
            for k in range(fields):
                lift = 0
                if kind == 2:
                    if _str_is(buf, pos, tokens_key):
                        lift = EXT_TOKENS
                    elif _str_is(buf, pos, hashes_key):
                        lift = EXT_HASHES
                    pos = _skip(buf, pos)  # the key
                    if pos < 0:
                        return GAVE_UP
                elif k == tokens_at:
                    lift = EXT_TOKENS
                elif k == hashes_at:
                    lift = EXT_HASHES
                if lift:
                    o = _copy(buf, flushed, pos, out, o)
                    if o < 0:
                        return NEED_ROOM
                    flushed = pos
                    w, after = _lift(buf, pos, out, o, lift)
                    if w == -2:
                        return NEED_ROOM
                    if w >= 0:
                        o = w
                        pos = flushed = after
                        continue
                pos = _skip(buf, pos)
                if pos < 0:
                    return GAVE_UP
        else:
            pos = _skip(buf, pos)
            if pos < 0:
                return GAVE_UP
    for _ in range(count - 2):  # dp rank and anything after it
        pos = _skip(buf, pos)
        if pos < 0:
            return GAVE_UP
    if pos != buf.size:
        return GAVE_UP
    o = _copy(buf, flushed, pos, out, o)
    return NEED_ROOM if o < 0 else o
