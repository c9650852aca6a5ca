"""``preble_e2``: Preble's E2 rule, exploit a long cached prefix, otherwise explore the least loaded worker.

Preble (Srivatsa et al., ICLR 2025, arXiv 2407.00023) routes a request to the worker holding its longest
cached prefix when that prefix is longer than the rest of the prompt (*exploit*: most of the prefill is
saved). Otherwise it *explores*: the worker with the least recent work, counting the new request's
uncached prefill there. Recent work is what was routed to the worker over the last ``window_secs`` of
simulated time: the uncached prefill tokens of each request (the prompt beyond its overlap on that
worker at routing) plus its output tokens, its decode. Both are charged when the request is routed, so a
request still decoding counts as soon as it is placed, which a load counted at completion would miss.

Simplified from the paper, on purpose (``spec/routing-benchmark.md`` §4): work is measured in tokens,
not the paper's per-token time model, and prefix replication and rebalancing of hot prefixes are left
out. The output length is the trace's, which stands for a request's ``max_tokens``. Exploit ties go to
the worker with the least recent work; remaining ties go uniformly at random through ``Cluster.rng``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Final

from ...errors import ConfigError
from ...events.model import WorkerKey
from ...routing import choose
from ..policy import Cluster, Policy, Request

__all__ = ["PrebleE2Policy"]

DEFAULT_WINDOW_SECS: Final = 180.0
"""The load window: "a few minutes" in the paper; three here."""


class PrebleE2Policy(Policy):
    """Longest cached prefix when it exceeds the uncached rest, else least windowed work.

    Args:
        window_secs: how far back routed work counts toward a worker's load, in simulated seconds.

    Raises:
        ConfigError: ``window_secs`` not > 0.
    """

    name = "preble_e2"

    def __init__(self, *, window_secs: float = DEFAULT_WINDOW_SECS) -> None:
        if not window_secs > 0:
            raise ConfigError(f"preble_e2 window_secs must be > 0, got {window_secs!r}")
        self.window_secs = window_secs
        self._recent: deque[tuple[float, WorkerKey, int]] = deque()
        """(routed at, worker, tokens of work) per request routed in the window, oldest first."""
        self._work: dict[WorkerKey, int] = {}
        """Per worker, the sum of ``_recent``'s work: the windowed load."""
        self._last: tuple[str, dict[WorkerKey, int]] | None = None
        """The last request chosen for and its overlaps, so ``routed`` need not query the index again."""

    def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
        self._expire(cluster.now)
        overlaps = cluster.index.find_matches(request.local_hashes)
        self._last = (request.request_id, overlaps)
        workers = cluster.workers
        block_size = cluster.block_size
        isl = request.input_tokens
        costs: list[float] = [
            self._work.get(w, 0) + max(0, isl - overlaps.get(w, 0) * block_size)  # new request's prefill
            for w in workers
        ]
        longest = max(overlaps.get(w, 0) for w in workers)
        cached_tokens = min(isl, longest * block_size)
        if cached_tokens > isl - cached_tokens:  # exploit
            held = [overlaps.get(w, 0) == longest for w in workers]
            costs = [cost if holds else math.inf for cost, holds in zip(costs, held, strict=True)]
        return workers[choose(costs, 0.0, cluster.rng)]

    def routed(self, request: Request, worker: WorkerKey, cluster: Cluster) -> None:
        if self._last is not None and self._last[0] == request.request_id:
            overlap = self._last[1].get(worker, 0)
        else:
            overlap = cluster.index.find_matches(request.local_hashes).get(worker, 0)
        self._last = None
        work = max(0, request.input_tokens - overlap * cluster.block_size) + request.output_tokens
        self._recent.append((cluster.now, worker, work))
        self._work[worker] = self._work.get(worker, 0) + work

    def load(self, worker: WorkerKey) -> int:
        """The worker's work routed within the window, in tokens, as of the last decision."""
        return self._work.get(worker, 0)

    def _expire(self, now: float) -> None:
        cutoff = now - self.window_secs
        recent = self._recent
        while recent and recent[0][0] <= cutoff:
            _, worker, work = recent.popleft()
            self._work[worker] -= work
