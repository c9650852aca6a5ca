"""``token_ids`` straight from a ``/select`` or ``/query`` body's bytes into ``uint32``, in one compiled pass.

Why: on a 1,024-token body (6.4 KB) ``orjson.loads`` costs about 29 µs and the list → checked ``uint32``
array another 43 µs (``core/requests.token_array``): three quarters of a ``/select``'s own work, spent
building 1,024 Python ints only to throw them away (``spec/interfaces.md`` §5.2). :func:`scan_tokens`
walks the top-level JSON object once, finds the ``"token_ids"`` member and parses its integers into a
``uint32`` array as it goes (a few µs); the rest of the body, with that array cut out and replaced by
``[]``, is small and goes through ``orjson`` and ``core/requests.parse_select`` as before, so every other
field is checked by the one validator there is.

What it takes: the JSON grammar for the integers (``0`` or ``[1-9][0-9]*``, at most u32), JSON
whitespace, any key order and any other members (strings with escapes, numbers, nested values: skipped
by a small tokenizer that only tracks strings and nesting — their validity is orjson's job on the rest).
What it refuses, returning None so the caller takes the ``orjson`` path, which stays the one source of
truth for errors: a key with an escape (``"token\\u005fids"`` must not slip past), a second
``token_ids``, a top level that is not an object, ``token_ids`` not an array of such integers (floats,
exponents, negatives, ``null``, nested arrays, leading zeros, over u32), and any body the rest of which
orjson or the validator refuses. So a fast answer equals the slow one by construction, and
``tests/service/test_fastparse.py`` checks it differentially on generated and malformed bodies.

Rejected: a second JSON library with a typed-array hook (simdjson's Python binding builds Python ints
too, and is one more native dependency); parsing the whole body in numba (every field's validation
would then live twice).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt
import orjson

from ..._jit import kernel
from ...errors import BadRequest
from ..core.requests import MAX_NAME, QueryRequest, SelectRequest, parse_query, parse_select

__all__ = ["fast_query", "fast_select", "scan_tokens", "warm"]

_KEY: Final = np.frombuffer(b"token_ids", dtype=np.uint8).copy()
U32_MAX: Final = (1 << 32) - 1


@kernel
def _is_ws(c: int) -> bool:
    return c == 32 or c == 10 or c == 13 or c == 9


@kernel
def _skip_ws(buf: npt.NDArray[np.uint8], i: int) -> int:
    n = buf.size
    while i < n and (buf[i] == 32 or buf[i] == 10 or buf[i] == 13 or buf[i] == 9):
        i += 1
    return i


@kernel
def _string_end(buf: npt.NDArray[np.uint8], i: int) -> int:
    """``buf[i]`` is the opening quote: the index after the closing one, or -1 (unterminated)."""
    n = buf.size
    i += 1
    while i < n:
        c = buf[i]
        if c == 92:  # backslash: the next byte is escaped (a quote included)
            i += 2
        elif c == 34:
            return i + 1
        else:
            i += 1
    return -1


@kernel
def _value_end(buf: npt.NDArray[np.uint8], i: int) -> int:
    """``buf[i]`` starts a value: the index after it, or -1. Strings and nesting are tracked; the rest
    (numbers, literals, string contents) is left for orjson to judge."""
    n = buf.size
    depth = 0
    while i < n:
        c = buf[i]
        if c == 34:
            i = _string_end(buf, i)
            if i < 0:
                return -1
            if depth == 0:
                return i
            continue
        if c == 123 or c == 91:  # { [
            depth += 1
        elif c == 125 or c == 93:  # } ]
            if depth == 0:
                return i  # the enclosing object's end: a scalar ended here
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and (c == 44 or c == 32 or c == 10 or c == 13 or c == 9):  # , or ws ends a scalar
            return i
        i += 1
    return -1


@kernel
def _parse_array(buf: npt.NDArray[np.uint8], i: int, out: npt.NDArray[np.uint32]) -> tuple[int, int]:
    """``buf[i]`` is ``[``: (count, index after ``]``) of an array of JSON integers in u32, or (-1, -1).
    All arithmetic is on int64 (ten digits fit), so numba emits no unsigned/float conversions."""
    n = buf.size
    count = 0
    i = _skip_ws(buf, i + 1)
    if i < n and buf[i] == 93:
        return 0, i + 1
    while i < n:
        d = np.int64(buf[i]) - 48
        if d < 0 or d > 9:
            return -1, -1  # '-', a literal, a nested value, a string: not a plain u32
        value = d
        i += 1
        if d == 0:
            if i < n and np.uint8(buf[i] - 48) <= 9:
                return -1, -1  # leading zero: not JSON
        else:
            end = min(n, i + 10)  # at most ten digits in all: stop reading at the eleventh
            while i < end:
                d = np.int64(buf[i]) - 48
                if d < 0 or d > 9:
                    break
                value = value * 10 + d
                i += 1
            if value > 4294967295 or (i < n and np.uint8(buf[i] - 48) <= 9):
                return -1, -1
        if i >= n:
            return -1, -1
        c = buf[i]
        if c == 44:  # the common case: a comma right after the digits
            out[count] = value
            count += 1
            i += 1
            if i < n and (buf[i] == 32 or buf[i] == 10 or buf[i] == 13 or buf[i] == 9):
                i = _skip_ws(buf, i)
            continue
        if c == 46 or c == 101 or c == 69:
            return -1, -1  # fraction or exponent: a float
        out[count] = value
        count += 1
        i = _skip_ws(buf, i)
        if i >= n:
            return -1, -1
        if buf[i] == 93:
            return count, i + 1
        if buf[i] != 44:
            return -1, -1
        i = _skip_ws(buf, i + 1)
    return -1, -1


@kernel
def _scan(buf: npt.NDArray[np.uint8], key: npt.NDArray[np.uint8], out: npt.NDArray[np.uint32]) -> tuple[int, int, int]:
    """(count, start, end): ``buf[start:end]`` is the top-level ``token_ids`` array, its ``count``
    integers in ``out``. (-1, 0, 0): not found, or not a shape this parser takes."""
    n = buf.size
    k = key.size
    i = _skip_ws(buf, 0)
    if i >= n or buf[i] != 123:
        return -1, 0, 0
    i = _skip_ws(buf, i + 1)
    if i < n and buf[i] == 125:
        return -1, 0, 0
    count = -1
    start = 0
    end = 0
    while i < n:
        if buf[i] != 34:
            return -1, 0, 0
        key_start = i + 1
        j = key_start
        while j < n and buf[j] != 34:
            if buf[j] == 92:
                return -1, 0, 0  # an escaped key might spell token_ids
            j += 1
        if j >= n:
            return -1, 0, 0
        is_tokens = j - key_start == k
        if is_tokens:
            for m in range(k):
                if buf[key_start + m] != key[m]:
                    is_tokens = False
                    break
        i = _skip_ws(buf, j + 1)
        if i >= n or buf[i] != 58:
            return -1, 0, 0
        i = _skip_ws(buf, i + 1)
        if i >= n:
            return -1, 0, 0
        if is_tokens:
            if count >= 0 or buf[i] != 91:
                return -1, 0, 0  # a second token_ids, or not an array
            start = i
            count, i = _parse_array(buf, i, out)
            if count < 0:
                return -1, 0, 0
            end = i
        else:
            i = _value_end(buf, i)
            if i < 0:
                return -1, 0, 0
        i = _skip_ws(buf, i)
        if i >= n:
            return -1, 0, 0
        if buf[i] == 125:
            if _skip_ws(buf, i + 1) != n:
                return -1, 0, 0
            return count, start, end
        if buf[i] != 44:
            return -1, 0, 0
        i = _skip_ws(buf, i + 1)
    return -1, 0, 0


def scan_tokens(body: bytes) -> tuple[npt.NDArray[np.uint32], int, int] | None:
    """(token ids, start, end) of the top-level ``token_ids`` array at ``body[start:end]``, or None when
    the body is not a shape :func:`_scan` takes (the caller then parses it the ordinary way)."""
    buf = np.frombuffer(body, dtype=np.uint8)
    out = np.empty(len(body) // 2 + 1, dtype=np.uint32)  # every id takes a digit and a separator
    count, start, end = _scan(buf, _KEY, out)
    if count < 0:
        return None
    return out[:count], start, end


def fast_select(body: bytes) -> SelectRequest | None:
    """The ``SelectRequest`` of a ``/select`` body with its token ids parsed by :func:`scan_tokens`, or
    None: not that shape, or refused by orjson or the validator (the caller's ordinary path then
    parses the body again and raises the error it always raised)."""
    split = _split(body)
    if split is None:
        return None
    tokens, rest = split
    if len(rest) == 2 and type(name := rest.get("model_name")) is str and 0 < len(name) <= MAX_NAME:
        return SelectRequest(model_name=name, token_ids=tokens)  # the hot body: what parse_select gives
    try:
        return parse_select(rest, tokens=tokens)
    except BadRequest:
        return None


def fast_query(body: bytes) -> QueryRequest | None:
    """:func:`fast_select`'s twin for a ``/query`` body."""
    split = _split(body)
    if split is None:
        return None
    try:
        return parse_query(split[1], by_hash=False, tokens=split[0])
    except BadRequest:
        return None


def _split(body: bytes) -> tuple[npt.NDArray[np.uint32], dict[str, Any]] | None:
    """The body's token ids, and the rest of it as orjson reads it with ``[]`` in their place; None when
    either is not there (the ordinary path then says why)."""
    found = scan_tokens(body)
    if found is None:
        return None
    tokens, start, end = found
    try:
        rest = orjson.loads(body[:start] + b"[]" + body[end:])
    except orjson.JSONDecodeError:
        return None
    return (tokens, rest) if isinstance(rest, dict) else None


def warm() -> None:
    """Compile (or load from numba's cache) the scanner: call before serving."""
    fast_select(b'{"model_name": "m", "token_ids": [1, 2]}')
