"""Tokens → local block hashes → router sequence hashes, bit-exact with Dynamo (``spec/dynamo-semantics.md`` §1)."""

from __future__ import annotations

from .blocks import block_hashes, block_hashes_array
from .chain import local_hash_array, sequence_hashes, sequence_hashes_array

__all__ = [
    "block_hashes",
    "block_hashes_array",
    "local_hash_array",
    "sequence_hashes",
    "sequence_hashes_array",
]
