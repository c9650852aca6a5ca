"""The policies that are a :class:`~kvrouter.routing.Router` with a fixed config: one decision path for all.

``least_loaded``, ``dynamo_t0`` and ``kvrouter`` differ only in their :class:`RouterConfig`, so they share
this base rather than three copies of the call. The router reads the simulator's index and slot manager
and never books (no ``request_id``): the simulator books every policy's decision the same way
(``kvrouter/sim/policy.py``). The router is built at the first decision, because the slot manager and
block size belong to the cluster, not to the policy.

Rejected: letting the router sweep stale requests. Its sweep would free requests in the simulator's
slot manager (a policy must not change ``Cluster``), and on a wall clock it would make a run depend on
how fast it ran. The simulator frees every request it books, so nothing goes stale.
"""

from __future__ import annotations

from ...events.model import WorkerKey
from ...routing import Router, RouterConfig, Selection
from ..policy import Cluster, Policy, Request

__all__ = ["RouterPolicy", "still_clock"]


def still_clock() -> float:
    """A clock that never reaches the router's first sweep (60 s after construction): no sweep ever runs."""
    return 0.0


class RouterPolicy(Policy):
    """A policy that asks a :class:`Router` built on the cluster's index and slot manager.

    Args:
        config: the router's weights and switches.
        seed: seeds the router's tie-break (and, above temperature 0, sampling) RNG.
    """

    def __init__(self, config: RouterConfig, *, seed: int = 0) -> None:
        self.config = config
        """The configuration every decision of this policy uses."""
        self.seed = seed
        self._router: Router | None = None
        self._last: tuple[str, Selection] | None = None
        """The last request chosen for and its selection, for :meth:`booked_overlap`."""

    def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
        router = self._router
        if router is None or router.slots is not cluster.slots or router.block_size != cluster.block_size:
            router = self._router = Router(
                self.config, block_size=cluster.block_size, seed=self.seed, clock=still_clock, slots=cluster.slots
            )
        capacities = None
        if self.config.active_decode_blocks_threshold is not None:  # the only reader of capacities
            capacities = dict.fromkeys(cluster.workers, cluster.capacity_blocks)
        selection = router.select(
            cluster.index,
            cluster.workers,
            local_hashes=request.local_hashes,
            isl_tokens=request.input_tokens,
            capacities=capacities,
        )
        self._last = (request.request_id, selection)
        return selection.worker

    def booked_overlap(self, request: Request, worker: WorkerKey, index_overlap: int) -> int:
        last = self._last
        if last is None or last[0] != request.request_id or last[1].worker != worker:
            return index_overlap
        return index_overlap + last[1].predicted_blocks
