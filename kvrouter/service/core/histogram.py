"""``Buckets``: the front's histograms, kept as plain counts by the event loop and read at scrape time.

A decision or a request observes into one with a ``bisect`` and three additions, no lock and no label
lookup: prometheus-client's ``Histogram`` takes a lock and resolves labels per observation, on the path
of every request, for figures read every 15 s. ``metrics.py`` turns them into histogram families.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, Final

__all__ = ["HIT_RATE_BUCKETS", "LATENCY_BUCKETS", "REUSE_ERROR_BUCKETS", "Buckets"]

LATENCY_BUCKETS: Final = tuple(0.000025 * 2**n for n in range(16))
"""Routing overhead and HTTP duration buckets [s]: 25 µs doubling to 0.82 s. A decision costs tens of
µs, an HTTP round trip hundreds: Dynamo's 0.1 ms first bucket would put every decision in it."""
REUSE_ERROR_BUCKETS: Final = (-64.0, -16.0, -4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0, 16.0, 64.0)
"""Blocks the engine reused minus blocks the router predicted (``accuracy.py``): 0 is its own bucket (a
correct prediction); negative is the index holding blocks the engine had not, positive the reverse."""
HIT_RATE_BUCKETS: Final = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
"""Predicted hit rate (cached prompt tokens / prompt tokens) of the chosen worker; 0.0 gets its own
bucket, as a cold prompt is the case to tell apart."""


class Buckets:
    """A histogram's cumulative-ready state without a lock: per-bucket counts, count and sum.

    ``observe`` is for one writer (the front's event loop); a reader on another thread may see a count
    one behind its sum, which a scrape tolerates. prometheus-client's ``Histogram`` takes a lock and a
    label lookup per observation; this is a ``bisect`` and three additions.
    """

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must be strictly increasing, got {list(bounds)}")
        self.bounds: tuple[float, ...] = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        """Per bucket (the last one is +Inf), observations that fell in it (not cumulative)."""
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` pairs ending with ``+Inf``, as ``HistogramMetricFamily`` takes them."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(total)))
        return out

    def add(self, other: Buckets) -> None:
        """Add ``other``'s observations (same bounds): the fronts' histograms summed."""
        if other.bounds != self.bounds:
            raise ValueError("cannot add histograms of different bounds")
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.count += other.count
        self.sum += other.sum

    def to_wire(self) -> list[Any]:
        return [self.counts, self.count, self.sum]

    @classmethod
    def from_wire(cls, wire: Sequence[Any], bounds: Sequence[float] = LATENCY_BUCKETS) -> Buckets:
        """Raises: ValueError: counts that do not fit ``bounds``."""
        buckets = cls(bounds)
        counts, count, total = wire
        if len(counts) != len(buckets.counts):
            raise ValueError(f"histogram: {len(counts)} counts for {len(buckets.counts)} buckets")
        buckets.counts = [int(c) for c in counts]
        buckets.count = int(count)
        buckets.sum = float(total)
        return buckets
