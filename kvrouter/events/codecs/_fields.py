"""Checked field access for decoders: every failure is a ``BadEvent`` that names the value's path.

Decoders read untrusted msgpack / JSON trees. Instead of ``isinstance`` checks scattered through each
codec, they call these helpers with a ``where`` string (``"$[1][0].block_hashes[2]"``), so every
message reads like msgspec's "expected `int`, got `str` - at `$.x`".
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ...errors import BadEvent
from ..model import U64_MAX, EngineHash, StorageTier, parse_tier

__all__ = [
    "describe",
    "expect_float",
    "expect_hash",
    "expect_int",
    "expect_list",
    "expect_map",
    "expect_opt_str",
    "expect_str",
    "expect_tier",
    "expect_tokens",
    "expect_u64",
    "field",
]

I64_MIN: Final = -(1 << 63)
U32_MAX: Final = (1 << 32) - 1


def describe(value: object) -> str:
    """A short type name for messages; msgpack/JSON trees only hold a few kinds."""
    return "null" if value is None else type(value).__name__


def expect_list(value: object, where: str) -> Sequence[Any]:
    if isinstance(value, list | tuple):
        return value
    raise BadEvent(f"{where}: expected an array, got {describe(value)}")


def expect_map(value: object, where: str) -> Mapping[str, Any]:
    if isinstance(value, dict):
        return value
    raise BadEvent(f"{where}: expected a map, got {describe(value)}")


def field(obj: Mapping[str, Any], name: str, where: str) -> Any:
    """A required key: absent is an error, present-but-null is returned as ``None``."""
    try:
        return obj[name]
    except KeyError:
        raise BadEvent(f"{where}: missing field {name!r}") from None


def expect_int(value: object, where: str, *, lo: int = 0, hi: int = U64_MAX) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if lo <= value <= hi:
            return value
        raise BadEvent(f"{where}: {value} is outside [{lo}, {hi}]")
    raise BadEvent(f"{where}: expected an integer, got {describe(value)}")


def expect_u64(value: object, where: str) -> int:
    """A strict unsigned 64-bit integer, as the reference's serde ``u64``."""
    return expect_int(value, where)


def expect_hash(value: object, where: str) -> EngineHash:
    """An engine block hash as engines publish it, cast to u64.

    Accepts u64, signed i64 (SGLang, vLLM before 0.10.2: two's complement) and vLLM's raw digest
    bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), which are folded exactly as vLLM folds them
    into ints (``int.from_bytes(digest, "big") & (2**64 - 1)``) so both settings name a block alike.
    """
    if isinstance(value, bytes):
        if not value:
            raise BadEvent(f"{where}: empty bytes hash")
        return EngineHash(int.from_bytes(value, "big") & U64_MAX)
    if isinstance(value, int) and not isinstance(value, bool):
        if I64_MIN <= value <= U64_MAX:
            return EngineHash(value & U64_MAX)
        raise BadEvent(f"{where}: hash {value} does not fit in 64 bits")
    raise BadEvent(f"{where}: expected an integer or bytes hash, got {describe(value)}")


def expect_float(value: object, where: str) -> float:
    if isinstance(value, float | int) and not isinstance(value, bool):
        return float(value)
    raise BadEvent(f"{where}: expected a number, got {describe(value)}")


def expect_opt_str(value: object, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise BadEvent(f"{where}: expected a string or null, got {describe(value)}")


def expect_str(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    raise BadEvent(f"{where}: expected a string, got {describe(value)}")


def expect_tier(value: object, where: str) -> StorageTier:
    """A medium / tier name (``None`` = device), mapped by :func:`~kvrouter.events.model.parse_tier`."""
    name = expect_opt_str(value, where)
    try:
        return parse_tier(name)
    except BadEvent as exc:
        raise BadEvent(f"{where}: {exc}") from None


def expect_tokens(value: object, where: str) -> array[int]:
    """A list of u32 token ids (Dynamo's ``Vec<u32>``), as the ``array('I')`` the hasher reads in place.

    Token lists are the longest arrays in an event, so the check is two C-level passes (element types,
    then the ``array`` conversion, which range-checks); only when one fails are the elements walked
    one by one, to name the first bad one. Comparing exact types also rejects msgpack booleans.
    """
    items = expect_list(value, where)
    if set(map(type, items)) <= {int}:
        try:
            return array("I", items)
        except OverflowError:
            pass
    return array("I", [expect_int(t, f"{where}[{i}]", hi=U32_MAX) for i, t in enumerate(items)])
