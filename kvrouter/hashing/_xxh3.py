"""Compiled XXH3-64 over u32 token words, and the router's sequence-hash chain.

Why numba: through the ``xxhash`` package each block costs one C call plus a bytes slice, about 190 ns,
and a list costs another 12.5 ns per token to become an ndarray (``spec/shm-engine.md`` §2.1). Hashing
every block of a prompt in one compiled loop removes the per-block Python work; numba imports in 0.19 s
and, with ``cache=True``, loads a compiled kernel in about 0.3 s (§2.3). The cost is owning an XXH3 port:
``tests/hashing/test_xxh3.py`` holds it bit-exact against ``xxhash`` for every word length 1..700.

A block of B tokens is 4·B bytes, always a multiple of 4, so the input stays a ``uint32`` array and every
8-byte read is two consecutive words, ``lo | hi << 32``: no byte view, no endianness question. Lengths 1..3
and 0 bytes cannot occur and are not ported; every other XXH3-64 path is (4-8, 9-16, 17-128, 129-240 and
the long path above 240 bytes, which hashes with a secret derived from the seed once per call).

Rules for every function here:
- numpy arrays in; scalars or preallocated arrays out; no Python objects;
- no allocation inside a loop (the long path's secret table and accumulators are made once per call);
- all arithmetic is on ``uint64`` (wrapping, as in C): constants are ``np.uint64``, because numba types
  ``uint64 + int`` as int64 or float64.

Constants are the XXH3 specification's (``xxhash.h`` 0.8: ``XXH_PRIME*``, ``PRIME_MX*``, ``XXH3_kSecret``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .._jit import inlined, kernel

__all__ = ["chain_hashes", "chain_step", "hash_blocks"]


Words = npt.NDArray[np.uint32]
Hashes = npt.NDArray[np.uint64]


_PRIME32_1: Final = np.uint64(0x9E3779B1)
_PRIME32_2: Final = np.uint64(0x85EBCA77)
_PRIME32_3: Final = np.uint64(0xC2B2AE3D)
_PRIME64_1: Final = np.uint64(0x9E3779B185EBCA87)
_PRIME64_2: Final = np.uint64(0xC2B2AE3D27D4EB4F)
_PRIME64_3: Final = np.uint64(0x165667B19E3779F9)
_PRIME64_4: Final = np.uint64(0x85EBCA77C2B2AE63)
_PRIME64_5: Final = np.uint64(0x27D4EB2F165667C5)
_PRIME_MX1: Final = np.uint64(0x165667919E3779F9)
_PRIME_MX2: Final = np.uint64(0x9FB21C651E98DF25)
_LOW32: Final = np.uint64(0xFFFFFFFF)
_BYTE: Final = np.uint64(0xFF)

_SECRET_SIZE: Final = 192
"""Bytes of ``XXH3_kSecret``, and of the seed-derived secret of the long path."""
_SECRET_BYTES: Final = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_SECRET_WORDS: Final = _SECRET_SIZE - 8 + 1
"""Entries of a secret table: the little-endian u64 at every byte offset, since XXH3 reads at +3, +7, +11."""
_SECRET: Final = np.array(
    [int.from_bytes(_SECRET_BYTES[o : o + 8], "little") for o in range(_SECRET_WORDS)], dtype=np.uint64
)
"""``XXH3_kSecret`` as a secret table; the short paths (<= 240 bytes) mix the seed in arithmetically."""

_MIDSIZE_MAX_WORDS: Final = 240 // 4
"""``XXH3_MIDSIZE_MAX`` (240 bytes) in u32 words: longer inputs take the long path."""
_MIDSIZE_START: Final = 3
"""``XXH3_MIDSIZE_STARTOFFSET``: secret offset of the 129-240 path's rounds after the eighth."""
_MIDSIZE_LAST: Final = 136 - 17
"""``XXH3_SECRET_SIZE_MIN - XXH3_MIDSIZE_LASTOFFSET``: secret offset of the 129-240 path's last 16 bytes."""
_STRIPE_WORDS: Final = 16
"""A 64-byte stripe of the long path, in u32 words."""
_STRIPES_PER_BLOCK: Final = (_SECRET_SIZE - 64) // 8
_SCRAMBLE_AT: Final = _SECRET_SIZE - 64
"""Secret offset of the scramble after each 1 KiB block of the long path."""
_LAST_STRIPE_AT: Final = _SECRET_SIZE - 64 - 7
"""``XXH_SECRET_LASTACC_START`` (7) back from the scramble key: the last stripe's secret offset."""
_MERGE_AT: Final = 11
"""``XXH_SECRET_MERGEACCS_START``: secret offset of the final merge of the eight accumulators."""


def _mul128_fold64_typer(typingctx: Any, lhs: Any, rhs: Any) -> Any:
    """Typing and LLVM code for ``_mul128_fold64``: zero-extend both to i128, multiply, fold."""
    if lhs != types.uint64 or rhs != types.uint64:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        wide = ir.IntType(128)
        product = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
        low = builder.trunc(product, ir.IntType(64))
        high = builder.trunc(builder.lshr(product, ir.Constant(wide, 64)), ir.IntType(64))
        return builder.xor(low, high)

    return types.uint64(types.uint64, types.uint64), codegen


_mul128_fold64 = cast(Callable[[np.uint64, np.uint64], np.uint64], intrinsic(_mul128_fold64_typer))
"""``lo64 ^ hi64`` of the full 128-bit product (``XXH3_mul128_fold64``): one ``mul`` instruction, where
splitting into 32-bit halves would take four multiplies."""


@inlined
def _read64(words: Words, w: int) -> np.uint64:
    return np.uint64(words[w]) | (np.uint64(words[w + 1]) << 32)


@kernel
def _swap32(x: np.uint64) -> np.uint64:
    return ((x & _BYTE) << 24) | (((x >> 8) & _BYTE) << 16) | (((x >> 16) & _BYTE) << 8) | (x >> 24)


@kernel
def _swap64(x: np.uint64) -> np.uint64:
    return (_swap32(x & _LOW32) << 32) | _swap32(x >> 32)


@kernel
def _avalanche(h: np.uint64) -> np.uint64:
    h = (h ^ (h >> 37)) * _PRIME_MX1
    return h ^ (h >> 32)


@kernel
def _rrmxmx(h: np.uint64, length: np.uint64) -> np.uint64:
    h ^= ((h << 49) | (h >> 15)) ^ ((h << 24) | (h >> 40))
    h *= _PRIME_MX2
    h ^= (h >> 35) + length
    h *= _PRIME_MX2
    return h ^ (h >> 28)


@kernel
def _len_4to8(first: np.uint64, last: np.uint64, length: np.uint64, seed: np.uint64) -> np.uint64:
    seed ^= _swap32(seed & _LOW32) << 32
    bitflip = (_SECRET[8] ^ _SECRET[16]) - seed
    return _rrmxmx((last + (first << 32)) ^ bitflip, length)


@kernel
def _len_9to16(first: np.uint64, last: np.uint64, length: np.uint64, seed: np.uint64) -> np.uint64:
    low = first ^ ((_SECRET[24] ^ _SECRET[32]) + seed)
    high = last ^ ((_SECRET[40] ^ _SECRET[48]) - seed)
    return _avalanche(length + _swap64(low) + high + _mul128_fold64(low, high))


@inlined
def _mix16(words: Words, w: int, secret: Hashes, at: int, seed: np.uint64) -> np.uint64:
    return _mul128_fold64(_read64(words, w) ^ (secret[at] + seed), _read64(words, w + 2) ^ (secret[at + 8] - seed))


@inlined
def _len_17to128(words: Words, s: int, n: int, seed: np.uint64) -> np.uint64:
    length = np.uint64(4 * n)
    acc = length * _PRIME64_1
    if n > 8:
        if n > 16:
            if n > 24:
                acc += _mix16(words, s + 12, _SECRET, 96, seed)
                acc += _mix16(words, s + n - 16, _SECRET, 112, seed)
            acc += _mix16(words, s + 8, _SECRET, 64, seed)
            acc += _mix16(words, s + n - 12, _SECRET, 80, seed)
        acc += _mix16(words, s + 4, _SECRET, 32, seed)
        acc += _mix16(words, s + n - 8, _SECRET, 48, seed)
    acc += _mix16(words, s, _SECRET, 0, seed)
    acc += _mix16(words, s + n - 4, _SECRET, 16, seed)
    return _avalanche(acc)


@inlined
def _len_129to240(words: Words, s: int, n: int, seed: np.uint64) -> np.uint64:
    length = np.uint64(4 * n)
    acc = length * _PRIME64_1
    for i in range(8):
        acc += _mix16(words, s + 4 * i, _SECRET, 16 * i, seed)
    acc_end = _mix16(words, s + n - 4, _SECRET, _MIDSIZE_LAST, seed)
    acc = _avalanche(acc)
    for i in range(8, n // 4):
        acc_end += _mix16(words, s + 4 * i, _SECRET, 16 * (i - 8) + _MIDSIZE_START, seed)
    return _avalanche(acc + acc_end)


@inlined
def _short(words: Words, s: int, n: int, seed: np.uint64) -> np.uint64:
    """XXH3-64 of ``words[s:s+n]`` for 4..240 bytes (1..60 words)."""
    length = np.uint64(4 * n)
    if n <= 2:
        return _len_4to8(np.uint64(words[s]), np.uint64(words[s + n - 1]), length, seed)
    if n <= 4:
        return _len_9to16(_read64(words, s), _read64(words, s + n - 2), length, seed)
    if n <= 32:
        return _len_17to128(words, s, n, seed)
    return _len_129to240(words, s, n, seed)


@inlined
def _seeded_secret(seed: np.uint64, table: Hashes) -> None:
    """Fill ``table`` with the long path's secret for ``seed`` (``XXH3_initCustomSecret``): each 16-byte
    pair of kSecret becomes ``(lo + seed, hi - seed)``, read here at every byte offset. Seed 0 gives
    kSecret itself, which is what C's seed-0 shortcut uses, so no branch is needed."""
    for o in range(_SECRET_WORDS):
        q, r = o // 8, o % 8
        word = _SECRET[8 * q] + seed if q % 2 == 0 else _SECRET[8 * q] - seed
        if r == 0:
            table[o] = word
        else:
            following = _SECRET[8 * q + 8] - seed if q % 2 == 0 else _SECRET[8 * q + 8] + seed
            table[o] = (word >> np.uint64(8 * r)) | (following << np.uint64(64 - 8 * r))


@inlined
def _accumulate(acc: Hashes, words: Words, w: int, secret: Hashes, at: int) -> None:
    """One 64-byte stripe into the eight accumulators (``XXH3_accumulate_512``, scalar form)."""
    for lane in range(8):
        value = _read64(words, w + 2 * lane)
        keyed = value ^ secret[at + 8 * lane]
        acc[lane ^ 1] += value
        acc[lane] += (keyed & _LOW32) * (keyed >> 32)


@inlined
def _long(words: Words, s: int, n: int, secret: Hashes, acc: Hashes) -> np.uint64:
    """XXH3-64 of ``words[s:s+n]`` above 240 bytes, with the seed-derived ``secret`` table; ``acc`` is
    scratch for the eight accumulators."""
    length = 4 * n
    acc[0], acc[1], acc[2], acc[3] = _PRIME32_3, _PRIME64_1, _PRIME64_2, _PRIME64_3
    acc[4], acc[5], acc[6], acc[7] = _PRIME64_4, _PRIME32_2, _PRIME64_5, _PRIME32_1
    block_words = _STRIPES_PER_BLOCK * _STRIPE_WORDS
    blocks = (length - 1) // (4 * block_words)
    for b in range(blocks):
        for stripe in range(_STRIPES_PER_BLOCK):
            _accumulate(acc, words, s + b * block_words + stripe * _STRIPE_WORDS, secret, 8 * stripe)
        for lane in range(8):
            a = acc[lane]
            acc[lane] = ((a ^ (a >> 47)) ^ secret[_SCRAMBLE_AT + 8 * lane]) * _PRIME32_1
    stripes = ((length - 1) - 4 * block_words * blocks) // (4 * _STRIPE_WORDS)
    for stripe in range(stripes):
        _accumulate(acc, words, s + blocks * block_words + stripe * _STRIPE_WORDS, secret, 8 * stripe)
    _accumulate(acc, words, s + n - _STRIPE_WORDS, secret, _LAST_STRIPE_AT)
    result = np.uint64(length) * _PRIME64_1
    for i in range(4):
        at = _MERGE_AT + 16 * i
        result += _mul128_fold64(acc[2 * i] ^ secret[at], acc[2 * i + 1] ^ secret[at + 8])
    return _avalanche(result)


@kernel
def hash_blocks(tokens: Words, block_size: int, window: int, seed: np.uint64, out: Hashes) -> None:
    """``out[i] = xxh3_64(tokens[i*block_size : i*block_size + window], seed)`` for every ``i`` of ``out``.

    The caller sizes ``out`` to the number of whole windows; ``window`` is ``block_size`` (or ``+ 1`` for
    eagle) and at least 1.
    """
    if window <= _MIDSIZE_MAX_WORDS:
        for i in range(out.size):
            out[i] = _short(tokens, i * block_size, window, seed)
        return
    secret = np.empty(_SECRET_WORDS, dtype=np.uint64)
    _seeded_secret(seed, secret)
    acc = np.empty(8, dtype=np.uint64)
    for i in range(out.size):
        out[i] = _long(tokens, i * block_size, window, secret, acc)


@kernel
def chain_step(previous: np.uint64, local: np.uint64, seed: np.uint64) -> np.uint64:
    """One link of the sequence-hash chain: ``xxh3_64(u64le(previous) ‖ u64le(local), seed)``."""
    return _len_9to16(previous, local, np.uint64(16), seed)


@kernel
def chain_hashes(local: Hashes, seed: np.uint64, out: Hashes) -> None:
    """``out[0] = local[0]``; ``out[i] = chain_step(out[i-1], local[i], seed)``."""
    if local.size == 0:
        return
    previous = local[0]
    out[0] = previous
    for i in range(1, local.size):
        previous = chain_step(previous, local[i], seed)
        out[i] = previous
