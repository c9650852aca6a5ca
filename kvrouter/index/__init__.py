"""The KV index: which worker holds which blocks, and how many leading blocks of a query each holds."""

from __future__ import annotations

from .approximate import ApproxIndex
from .reference import RadixIndex

__all__ = ["ApproxIndex", "RadixIndex"]
