"""``Matches``: the blocks decisions matched, fed to the index cap's least-recently-used order.

Under ``--max-index-blocks`` each applier evicts the least recently stored *or matched* blocks first
(``docs/shm-engine.md`` "The index cap"); only the routers know what was matched. A decision appends one
tuple here (its chosen worker, its prompt's local hashes, its device overlap) and the health loop calls
:meth:`Matches.feed` on every tick, off the decision path: the chains are hashed there, ``FEED_SLICE``
prompts at a time with the loop let go between slices, and each worker's blocks go to its applier in one
message (``touch``). The decision path only appends.
"""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from ...events.model import WorkerKey
from ...hashing import sequence_hashes_array

__all__ = ["FEED_SLICE", "MATCHED_LIMIT", "Matches"]

MATCHED_LIMIT: Final = 256
"""Decisions whose matched blocks one health tick feeds to the index cap's order: past it a tick's further
decisions are left out (a busy router's recency is then a sample, which is all an order among millions of
blocks needs), so neither the list nor the tick's work grows with the decision rate. The tick hashes on the
event loop: at 4,096 a busy front stalled every request for about 10 ms twice a second (``bench_service``'s
p99 at concurrency 8: 12.5 ms, 4.9 ms without feeding)."""
FEED_SLICE: Final = 8
"""Prompts :meth:`Matches.feed` hashes, or workers it sends their blocks, before it lets the event loop serve
requests again (about 0.2 ms)."""


class Toucher(Protocol):
    """Where matched blocks go: the engine (front 0) or its view (another front), both ``touch``."""

    def touch(self, worker: WorkerKey, seq_hashes: npt.NDArray[np.uint64]) -> None: ...


class Matches:
    """The decisions' matches since the last health tick (at most ``MATCHED_LIMIT``)."""

    def __init__(self) -> None:
        self._matched: list[tuple[WorkerKey, npt.NDArray[np.uint64], int]] = []

    def add(self, worker: WorkerKey, local: npt.NDArray[np.uint64], overlap: int) -> None:
        """A decision matched ``overlap`` leading blocks of ``local`` on ``worker`` (kept up to the limit)."""
        if len(self._matched) < MATCHED_LIMIT:
            self._matched.append((worker, local, overlap))

    async def feed(self, index: Toucher) -> None:
        """Send the blocks matched since the last call to their workers' appliers, one message per worker.
        A worker's chains go as they are, repeats and all: the applier's ``touch`` counts a block once per
        message, and sorting them out here (``np.unique``, about 90 µs a worker) was two thirds of a tick's
        feeding on the loop."""
        matched, self._matched = self._matched, []
        deepest: dict[tuple[WorkerKey, bytes], tuple[npt.NDArray[np.uint64], int]] = {}
        for worker, local, overlap in matched:  # a prompt matched again and again is hashed once, at its deepest
            key = (worker, local.tobytes())
            if overlap > deepest.get(key, (local, 0))[1]:
                deepest[key] = (local, overlap)
        by_worker: dict[WorkerKey, list[npt.NDArray[np.uint64]]] = {}
        for n, ((worker, _), (local, overlap)) in enumerate(deepest.items(), 1):
            by_worker.setdefault(worker, []).append(sequence_hashes_array(local[:overlap]))
            if n % FEED_SLICE == 0:
                await asyncio.sleep(0)
        for n, (worker, chains) in enumerate(by_worker.items(), 1):
            index.touch(worker, np.concatenate(chains))
            if n % FEED_SLICE == 0:
                await asyncio.sleep(0)
