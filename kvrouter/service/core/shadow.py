"""Shadow policies (``--shadow-policy NAME[,NAME…]``): what another policy would have chosen, on live traffic.

A policy change is judged today on a simulator's trace, not on the fleet it will route. With shadows on,
every decision also asks each named policy of the simulator (``kvrouter/sim/policies``, the same classes
``kvrouter simulate`` runs) for its choice, on the same state the live router sees — the partition's
candidates, the shared-memory index and the partition's slot manager — before the live router books
anything. Nothing a shadow chooses is booked or answered: routing is untouched.

Each shadow's choice is then priced with the live decision's own terms (the router's
:class:`~kvrouter.routing.router.DecisionRecord`: every candidate's overlap and cost), so the comparison is
like for like: per policy, how often it agrees with the live choice, the overlap it would have got, and
the live cost function's value of its pick against the live pick's. Policies that learn from outcomes
(round robin's cursor, SGLang's approximate tree) are told where each request really went.

Cost: each shadow's ``choose`` runs on the decision path, before the live decision (so that it sees the
same loads): from a few microseconds (round robin) to tens (the policies that walk the index). Shadows
are a measuring tool to turn on for a while, not a default. Rejected: running shadows after the answer
(the live reservation is then already booked, so every shadow would see the live choice's load and be
biased away from it) and copying the slot manager per decision (far dearer than the shadows themselves).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ...events.model import WorkerKey
from ...routing import _kernels as kernels
from ...routing.router import DecisionRecord
from ...sim.policies import make_policy
from ...sim.policy import Cluster, Policy, Request
from .counters import SHADOW_FIELDS, ServiceCounters
from .partition import Partition

__all__ = ["DEFAULT_CAPACITY_BLOCKS", "ShadowChoice", "Shadows"]

DEFAULT_CAPACITY_BLOCKS: Final = 4096
"""KV blocks per worker a shadow is told when the registration gave none (``total_kv_blocks``)."""


@dataclass(slots=True)
class ShadowChoice:
    """One shadow's choice for one decision, priced once the live decision is made."""

    policy: str
    worker: WorkerKey
    overlap_blocks: int = 0
    cost: float | None = None
    """The live cost function's value of this pick (None when the worker was not a live candidate)."""


class Shadows:
    """The shadow policies of one service: one policy instance per (partition, name), fresh per partition.

    Args:
        names: the simulator's policy names (``ServiceConfig`` has checked them).
        counters: where the comparisons go (the service's, summed over fronts).
        seed: seeds every shadow's own random source.
    """

    def __init__(self, names: tuple[str, ...], counters: ServiceCounters, *, seed: int = 0) -> None:
        self.names = names
        self.counters = counters
        self.seed = seed
        self._policies: dict[tuple[str, str], list[Policy]] = {}
        self._rng: dict[tuple[str, str], random.Random] = {}
        self._started = time.monotonic()

    def cluster(self, partition: Partition, index: Any, candidates: tuple[WorkerKey, ...]) -> Cluster:
        """The state a shadow reads: what the live router reads, as the simulator's policies expect it."""
        key = (partition.model_name, partition.routing_group)
        rng = self._rng.get(key)
        if rng is None:
            rng = self._rng[key] = random.Random(self.seed)
        capacities = [b for b in (partition.capacities or {}).values() if b]
        return Cluster(
            workers=candidates,
            index=index,
            slots=partition.slots,
            block_size=partition.block_size,
            capacity_blocks=min(capacities) if capacities else DEFAULT_CAPACITY_BLOCKS,
            now=time.monotonic() - self._started,
            rng=rng,
        )

    def _of(self, partition: Partition) -> list[Policy]:
        key = (partition.model_name, partition.routing_group)
        policies = self._policies.get(key)
        if policies is None:
            policies = self._policies[key] = [make_policy(name, seed=self.seed) for name in self.names]
        return policies

    def choose(
        self,
        partition: Partition,
        index: Any,
        candidates: tuple[WorkerKey, ...],
        request_id: str,
        local: npt.NDArray[np.uint64],
        isl_tokens: int,
    ) -> tuple[Request, Cluster, list[ShadowChoice]]:
        """Every shadow's choice on the state now; call it before the live decision books anything."""
        cluster = self.cluster(partition, index, candidates)
        request = Request(request_id, cluster.now, isl_tokens, 0, tuple(local.tolist()))
        choices = [
            ShadowChoice(name, policy.choose(request, cluster))
            for name, policy in zip(self.names, self._of(partition), strict=True)
        ]
        return request, cluster, choices

    def account(
        self,
        partition: Partition,
        request: Request,
        cluster: Cluster,
        choices: list[ShadowChoice],
        live: WorkerKey,
        record: DecisionRecord,
    ) -> None:
        """Price each choice with the live decision's terms, count the comparison, and tell each policy where
        the request went."""
        position = {key: i for i, key in enumerate(record.keys)}
        live_cost = float(record.terms[kernels.C_TOTAL, record.head])
        live_overlap = int(record.overlaps[0, record.head])
        for choice, policy in zip(choices, self._of(partition), strict=True):
            at = position.get(choice.worker)
            if at is not None:
                choice.overlap_blocks = int(record.overlaps[0, at])
                choice.cost = float(record.terms[kernels.C_TOTAL, at])
            figures = self.counters.shadow.setdefault(choice.policy, [0.0] * len(SHADOW_FIELDS))
            figures[0] += 1
            figures[1] += choice.worker == live
            figures[2] += choice.overlap_blocks
            figures[3] += live_overlap
            if choice.cost is not None:
                figures[4] += choice.cost
                figures[5] += live_cost
            policy.routed(request, live, cluster)
