"""PLACEHOLDER: pure-xxhash version, replaced by the compiled one."""
from __future__ import annotations
from array import array
from collections.abc import Mapping, Sequence
from typing import Any
import xxhash
from ..errors import InvalidTokens

XXH3_SEED = 1337

def block_hashes(tokens: Any, block_size: int, *, lora_name: str | None = None, cache_namespace: str | None = None,
                 mm_infos: Sequence[Mapping[str, Any] | None] | None = None, eagle: bool = False) -> list[int]:
    if block_size < 1:
        raise InvalidTokens("block_size must be >= 1")
    seed = XXH3_SEED
    if lora_name:
        seed = (seed + xxhash.xxh3_64_intdigest(lora_name.encode(), 0)) & (2**64 - 1)
    if cache_namespace:
        seed = (seed + xxhash.xxh3_64_intdigest(cache_namespace.encode(), 1)) & (2**64 - 1)
    try:
        data = array("I", list(tokens)).tobytes()
    except OverflowError as exc:
        raise InvalidTokens(str(exc)) from exc
    n = len(data) // 4
    window = block_size + 1 if eagle else block_size
    count = (n - window) // block_size + 1 if n >= window else 0
    out = []
    for i in range(count):
        chunk = data[4 * i * block_size: 4 * (i * block_size + window)]
        info = mm_infos[i] if mm_infos is not None and i < len(mm_infos) else None
        if info and info.get("mm_objects"):
            for h in sorted(o["mm_hash"] for o in info["mm_objects"]):
                chunk += h.to_bytes(8, "little")
        out.append(xxhash.xxh3_64_intdigest(chunk, seed))
    return out
