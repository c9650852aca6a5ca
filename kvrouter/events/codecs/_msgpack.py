"""Compiled msgpack readers: the core the batch path's two decoders read with (``runs.py``).

``header`` reads what a value is (the compiled pre-pass, ``_prescan.py``, reads with it too); the others each
read one value at a position of a message's bytes and says where the value ends, or -1 when the value is
not one it takes; none raises, none allocates. They are compiled functions the decoders call, not inlined
into them: inlined into every call site they made a cold compile of the two decoders take 118 s instead of
39 (a first ``kvrouter up`` compiles them), for 1.4 µs a message of speed.

They are strict where the Python decoder (``_engine.py``, ``kvrouter.py``) might read a value differently
or refuse it: a map inside a skipped value (its keys might not be hashable), an ext value, a non-ASCII
string (it could be invalid UTF-8). The batch path then gives the message to the Python decoder, whose
answer is the authority.

Rules for every function here: numpy arrays in, integers out, no Python objects, no allocation.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from ..._jit import inlined, kernel

__all__ = [
    "NIL",
    "Bytes",
    "copy_words",
    "header",
    "name_index",
    "nil_or_nils",
    "packed_bin",
    "read_hashes",
    "read_int",
    "read_number",
    "read_tokens",
    "skip",
    "uint",
]


Bytes = npt.NDArray[np.uint8]

NIL: Final = 0xC0
"""msgpack's nil."""


@inlined
def uint(buf: Bytes, pos: int, size: int) -> int:
    """A big-endian unsigned integer of ``size`` bytes at ``pos`` (caller checked the bounds)."""
    value = 0
    for k in range(size):
        value = (value << 8) | int(buf[pos + k])
    return value


@inlined
def header(buf: Bytes, pos: int) -> tuple[int, int, int]:
    """(kind, count, header bytes) of the value at ``pos``; -1 kind when it is truncated or an ext.

    Kinds: 0 scalar (``count`` = payload bytes after the header), 1 array (``count`` = elements),
    2 map (``count`` = pairs), 3 string (``count`` = bytes). Integers are scalars.
    """
    end = buf.size
    if pos >= end:
        return -1, 0, 0
    b = int(buf[pos])
    if b <= 0x7F or b >= 0xE0 or b == 0xC0 or b == 0xC2 or b == 0xC3:
        return 0, 0, 1
    if 0x80 <= b <= 0x8F:
        return 2, b & 0x0F, 1
    if 0x90 <= b <= 0x9F:
        return 1, b & 0x0F, 1
    if 0xA0 <= b <= 0xBF:
        return 3, b & 0x1F, 1
    if b == 0xCC or b == 0xD0:
        return 0, 1, 1
    if b == 0xCD or b == 0xD1:
        return 0, 2, 1
    if b == 0xCA or b == 0xCE or b == 0xD2:
        return 0, 4, 1
    if b == 0xCB or b == 0xCF or b == 0xD3:
        return 0, 8, 1
    size = 0
    if b == 0xC4 or b == 0xD9:
        size = 1
    elif b == 0xC5 or b == 0xDA or b == 0xDC or b == 0xDE:
        size = 2
    elif b == 0xC6 or b == 0xDB or b == 0xDD or b == 0xDF:
        size = 4
    else:
        return -1, 0, 0  # ext, fixext, or the never-used 0xc1
    if pos + 1 + size > end:
        return -1, 0, 0
    count = uint(buf, pos + 1, size)
    if b == 0xDC or b == 0xDD:
        return 1, count, 1 + size
    if b == 0xDE or b == 0xDF:
        return 2, count, 1 + size
    return (3 if b >= 0xD9 else 0), count, 1 + size


@kernel
def name_index(buf: Bytes, pos: int, names: Bytes, bounds: npt.NDArray[np.int64], lo: int, hi: int) -> int:
    """The index in ``[lo, hi)`` of the name the string at ``pos`` is; -1 for none, -2 when it is not a
    string, or is one the Python decoder might refuse (non-ASCII: it could be invalid UTF-8)."""
    kind, count, head = header(buf, pos)
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


@kernel
def skip(buf: Bytes, pos: int) -> int:
    """The position after the value at ``pos``, or -1 when it holds what the Python decoder might read
    differently or refuse: a map (its keys might not be hashable), an ext, a non-ASCII string."""
    remaining = 1
    while remaining > 0:
        kind, count, head = header(buf, pos)
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


@kernel
def read_int(buf: Bytes, pos: int) -> tuple[int, np.uint64, bool]:
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


@kernel
def read_tokens(buf: Bytes, pos: int, out: npt.NDArray[np.uint32]) -> tuple[int, int]:
    """(position after it, count) of the array of u32 token ids at ``pos``, written to ``out``; position -1
    when it is not one (or ``out`` cannot hold it). One pass, for the unsigned encodings only: a token is
    never negative, so anything else is not a token."""
    kind, count, head = header(buf, pos)
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


@kernel
def read_hashes(buf: Bytes, pos: int, out: npt.NDArray[np.uint64], at: int) -> tuple[int, int]:
    """(position after it, count) of the array of integer hashes at ``pos``, cast to u64 into ``out[at:]``;
    position -1 when it is not one, -2 when ``out`` has no room for it."""
    kind, count, head = header(buf, pos)
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
        p, value, _ = read_int(buf, p)
        if p < 0:
            return -1, 0
        out[at + k] = value
    return p, count


@kernel
def read_number(buf: Bytes, pos: int, word: npt.NDArray[np.uint64], real: npt.NDArray[np.float64]) -> tuple[int, float]:
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
            word[0] = np.uint64(uint(buf, pos + 1, 8))
            return pos + 9, real[0]
        word[0] = np.uint64(uint(buf, pos + 1, 4))
        return pos + 5, float(word.view(np.float32)[0])  # little-endian: the low half is the f32
    after, value, negative = read_int(buf, pos)
    if after < 0:
        return -1, 0.0
    return after, float(np.int64(value)) if negative else float(value)


@kernel
def nil_or_nils(buf: Bytes, pos: int) -> bool:
    """``extra_keys`` that say nothing: absent, nil, or an array of nils (no multimodal key, no salt)."""
    if pos < 0 or buf[pos] == NIL:
        return True
    kind, count, head = header(buf, pos)
    if kind != 1 or pos + head + count > buf.size:
        return False
    for k in range(count):  # noqa: SIM110 - numba compiles a loop, not all() over a generator
        if buf[pos + head + k] != NIL:
            return False
    return True


@kernel
def packed_bin(buf: Bytes, pos: int, width: int) -> tuple[int, int]:
    """(position of the bytes, count of ``width``-byte values) of the ``bin`` at ``pos``; position -1 when
    it is not a bin of whole values."""
    if pos >= buf.size or buf[pos] < 0xC4 or buf[pos] > 0xC6:
        return -1, 0
    kind, size, head = header(buf, pos)
    if kind != 0 or size % width or pos + head + size > buf.size:
        return -1, 0
    return pos + head, size // width


@kernel
def copy_words(buf: Bytes, pos: int, count: int, out: npt.NDArray[np.uint64], at: int) -> None:
    """``count`` little-endian u64 words at ``buf[pos:]`` into ``out[at:]``."""
    for k in range(count):
        word = np.uint64(0)
        for i in range(7, -1, -1):
            word = (word << np.uint64(8)) | np.uint64(buf[pos + 8 * k + i])
        out[at + k] = word
