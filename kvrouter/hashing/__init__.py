"""Tokens → local block hashes → router sequence hashes, bit-exact with Dynamo (``spec/dynamo-semantics.md`` §1)."""

from __future__ import annotations

from .blocks import block_hashes
from .chain import sequence_hashes

__all__ = ["block_hashes", "sequence_hashes"]
