"""``chwbl``: consistent hashing with bounded loads over the prompt's first blocks (KubeAI's PrefixHash).

A request's key is a hash of its first ``prefix_blocks`` local hashes, placed on a ring where each worker
owns ``virtual_nodes`` points. Walking clockwise from the key, the request goes to the first worker whose
in-flight requests are at most ``(1 + epsilon)`` times the average including this request,
``(total + 1) / n`` (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads"). Requests
sharing a prefix therefore stick to one worker until it carries more than its share, then spill to the
next worker on the ring, the same one for every such request. The least loaded worker always passes
(its load is at most ``total / n``), so the walk always ends.

KubeAI tests ``load + 1 <= (1 + epsilon) * (total + 1) / n`` instead, which at low load rejects every
worker and falls back to the ring owner; the benchmark's rule (``spec/routing-benchmark.md`` §4) is the
paper's, taken here. The ring uses a personalised BLAKE2b of fixed-width integers, not Python's ``hash``, so
placements are the same in every process and run.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Sequence
from typing import Final

from ...errors import ConfigError
from ...events.model import WorkerKey
from ..policy import Cluster, Policy, Request

__all__ = ["ChwblPolicy"]

DEFAULT_PREFIX_BLOCKS: Final = 4
"""Blocks of the prompt that make its key (``spec/routing-benchmark.md`` §4)."""
DEFAULT_VIRTUAL_NODES: Final = 100
"""Ring points per worker; KubeAI's default replication is 256, and 100 already spreads 4-8 workers evenly."""
DEFAULT_EPSILON: Final = 0.25
"""Load slack over the average: KubeAI's default ``meanLoadFactor`` of 125%."""


def _point(*values: int) -> int:
    """A 64-bit ring position for a tuple of unsigned 64-bit integers."""
    data = struct.pack(f"<{len(values)}Q", *values)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"kvr-chwbl").digest(), "little")


class ChwblPolicy(Policy):
    """The ring owner of the prompt's prefix, or the next worker clockwise that is not overloaded.

    Args:
        prefix_blocks: leading local hashes hashed into the key (fewer when the prompt is shorter).
        virtual_nodes: ring points per worker.
        epsilon: a worker is eligible while its in-flight requests are ``<= (1 + epsilon) * (total + 1) / n``.

    Raises:
        ConfigError: ``prefix_blocks`` or ``virtual_nodes`` below 1, or ``epsilon`` negative.
    """

    name = "chwbl"

    def __init__(
        self,
        *,
        prefix_blocks: int = DEFAULT_PREFIX_BLOCKS,
        virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
        epsilon: float = DEFAULT_EPSILON,
    ) -> None:
        if prefix_blocks < 1 or virtual_nodes < 1:
            raise ConfigError(f"chwbl needs prefix_blocks and virtual_nodes >= 1, got {prefix_blocks}, {virtual_nodes}")
        if not epsilon >= 0:
            raise ConfigError(f"chwbl epsilon must be >= 0, got {epsilon!r}")
        self.prefix_blocks = prefix_blocks
        self.virtual_nodes = virtual_nodes
        self.epsilon = epsilon
        self._ring_workers: tuple[WorkerKey, ...] = ()
        self._points: list[int] = []
        """Sorted ring positions."""
        self._owners: list[WorkerKey] = []
        """The worker owning each position of ``_points``."""

    def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
        workers = cluster.workers
        if workers != self._ring_workers:
            self._build_ring(workers)
        slots = cluster.slots
        loads = {w: slots.active_requests(w) for w in workers}
        bound = (1.0 + self.epsilon) * (sum(loads.values()) + 1) / len(workers)
        start = bisect.bisect_left(self._points, self.key(request.local_hashes))
        owners = self._owners
        for step in range(len(owners)):
            worker = owners[(start + step) % len(owners)]
            if loads[worker] <= bound:
                return worker
        raise AssertionError("unreachable: the least loaded worker is always within the bound")

    def key(self, local_hashes: Sequence[int]) -> int:
        """The ring position of a prompt: a hash of its first ``prefix_blocks`` local hashes."""
        return _point(*local_hashes[: self.prefix_blocks])

    def _build_ring(self, workers: tuple[WorkerKey, ...]) -> None:
        ring = sorted(
            (_point(worker_id, dp_rank, replica), (worker_id, dp_rank))
            for worker_id, dp_rank in workers
            for replica in range(self.virtual_nodes)
        )
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]
        self._ring_workers = workers
