"""PLACEHOLDER."""
from __future__ import annotations
from collections.abc import Sequence
import xxhash

def sequence_hashes(local_hashes: Sequence[int]) -> list[int]:
    out: list[int] = []
    for h in local_hashes:
        out.append(h if not out else xxhash.xxh3_64_intdigest(out[-1].to_bytes(8, "little") + h.to_bytes(8, "little"), 1337))
    return out
