"""``Router``: one routing decision from an index, the slot manager's load, the cost and the selector.

Per request: hash the prompt (or take its local hashes), ask the index for each candidate's overlap
per tier, drop the candidates over a busy threshold, cost the rest (``cost.py``), pick one
(``selection.py``) and, when the caller books the request, add it to the slot manager so the next
decision sees the load. With ``explain=True`` the selection carries every candidate's terms, which is
what Dynamo's selection service does not return and operators ask for (``spec/interfaces.md`` §2).

The router owns no index: the event-driven index is shared with the event plane, and in approximate
mode (``use_kv_events=False``) the caller passes an :class:`~kvrouter.index.ApproxIndex`, into which
every decision is written, as the reference writes synthetic stores (``spec/dynamo-semantics.md`` §3.2).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from ..errors import ConfigError, InvalidHashInput, NoWorkerAvailable
from ..events.model import StorageTier, WorkerKey
from ..hashing import block_hashes, sequence_hashes
from ..index import ApproxIndex
from .config import RouterConfig
from .cost import Cost, Load, Overlap, worker_cost
from .selection import choose, probabilities
from .slots import SlotManager

__all__ = ["OverlapSource", "Router", "Selection", "WorkerExplanation"]

SWEEP_INTERVAL_SECS: Final = 60.0
"""How often stale requests are swept out of the slot manager: Dynamo's one-minute sweep (§5)."""


class OverlapSource(Protocol):
    """What the router needs of an index: overlap per tier for one query."""

    def find_matches_by_tier(self, local_hashes: Sequence[int]) -> dict[StorageTier, dict[WorkerKey, int]]: ...


@dataclass(frozen=True, slots=True)
class WorkerExplanation:
    """One candidate's part in a decision."""

    worker: WorkerKey
    overlap: Overlap
    cost: Cost
    probability: float
    """Its chance of being picked (0 when busy)."""
    selected: bool
    busy: bool
    """Over a busy threshold, so not a candidate."""


@dataclass(frozen=True, slots=True)
class Selection:
    """The chosen worker, its device overlap and cost, and (when asked) every candidate's explanation."""

    worker: WorkerKey
    overlap_blocks: int
    cost: Cost
    isl_tokens: int
    explanation: tuple[WorkerExplanation, ...] | None = None


class Router:
    """Chooses a worker per request and tracks the load of the requests it booked.

    Args:
        config: the weights and switches.
        block_size: tokens per KV block of the model served.
        seed: seeds the tie-break / sampling RNG; None draws a fresh seed.
        clock: seconds, monotonic; drives the slot manager's stale sweep, run from ``select`` once a
            minute (requests older than 300 s are dropped).
        slots: a slot manager shared with whoever drives the request lifecycle (the simulator); by
            default the router makes its own from ``config``.
    """

    def __init__(
        self,
        config: RouterConfig | None = None,
        *,
        block_size: int,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        slots: SlotManager | None = None,
    ) -> None:
        self.config = config or RouterConfig()
        self.block_size = block_size
        self.rng = random.Random(seed)
        self._clock = clock
        self._next_sweep = clock() + SWEEP_INTERVAL_SECS
        self.slots = slots or SlotManager(
            block_size=block_size,
            track_active_blocks=self.config.router_track_active_blocks,
            track_prefill_tokens=self.config.router_track_prefill_tokens,
            assume_kv_reuse=self.config.router_assume_kv_reuse,
            clock=clock,
        )

    def select(
        self,
        index: OverlapSource,
        workers: Iterable[WorkerKey],
        *,
        local_hashes: Sequence[int] | None = None,
        tokens: Sequence[int] | None = None,
        isl_tokens: int | None = None,
        lora_name: str | None = None,
        capacities: Mapping[WorkerKey, int] | None = None,
        request_id: str | None = None,
        explain: bool = False,
    ) -> Selection:
        """Choose a worker for one request.

        Args:
            index: where overlaps come from (an ``ApproxIndex`` when ``use_kv_events`` is off).
            workers: the candidates.
            local_hashes: the request's local block hashes; or give ``tokens`` and they are computed.
            tokens: the request's token ids (with ``lora_name``), when ``local_hashes`` is not given.
            isl_tokens: prompt length; defaults to ``len(tokens)``, or full blocks of ``local_hashes``.
            capacities: KV blocks per worker, for ``active_decode_blocks_threshold``.
            request_id: book the request on the chosen worker (select-and-reserve); None only chooses.
            explain: attach every candidate's :class:`WorkerExplanation`.

        Raises:
            NoWorkerAvailable: no candidates, or all over a busy threshold.
            ConfigError: approximate mode with an index that cannot record decisions.
        """
        if local_hashes is None:
            if tokens is None:
                raise InvalidHashInput("select needs local_hashes or tokens")
            local_hashes = block_hashes(tokens, self.block_size, lora_name=lora_name)
            isl = len(tokens) if isl_tokens is None else isl_tokens
        else:
            isl = len(local_hashes) * self.block_size if isl_tokens is None else isl_tokens
        if self._clock() >= self._next_sweep:
            self.slots.sweep()
            self._next_sweep = self._clock() + SWEEP_INTERVAL_SECS
        candidates = list(dict.fromkeys(workers))
        if not candidates:
            raise NoWorkerAvailable("no candidate workers")
        seq_hashes = sequence_hashes(local_hashes)
        by_tier = index.find_matches_by_tier(local_hashes)
        overlaps = {w: Overlap.from_tiers(by_tier, w) for w in candidates}
        loads = {w: self._load(w, seq_hashes) for w in candidates}
        busy = {w for w in candidates if self._busy(w, capacities)}
        eligible = [w for w in candidates if w not in busy]
        if not eligible:
            raise NoWorkerAvailable(f"all {len(candidates)} candidate workers are over a busy threshold")
        least_prefill = min(loads[w].active_prefill_tokens for w in eligible)
        mean_recent = sum(loads[w].recent_prefill_tokens for w in eligible) / len(eligible)
        costs = {
            w: worker_cost(
                self.config,
                isl_tokens=isl,
                block_size=self.block_size,
                overlap=overlaps[w],
                load=loads[w],
                min_active_prefill_tokens=least_prefill,
                mean_recent_prefill_tokens=mean_recent,
            )
            for w in candidates
        }
        totals = [costs[w].total for w in eligible]
        chosen = eligible[choose(totals, self.config.router_temperature, self.rng)]
        if request_id is not None:
            self.slots.add_request(request_id, chosen, seq_hashes, isl, overlaps[chosen].device)
        if not self.config.use_kv_events:
            if not isinstance(index, ApproxIndex):
                raise ConfigError("use_kv_events=False needs an ApproxIndex to record decisions in")
            index.record_routing(chosen, local_hashes)
        explanation = None
        if explain:
            chance = dict(zip(eligible, probabilities(totals, self.config.router_temperature), strict=True))
            explanation = tuple(
                WorkerExplanation(w, overlaps[w], costs[w], chance.get(w, 0.0), w == chosen, w in busy)
                for w in candidates
            )
        return Selection(chosen, overlaps[chosen].device, costs[chosen], isl, explanation)

    def _load(self, worker: WorkerKey, seq_hashes: Sequence[int]) -> Load:
        return Load(
            active_prefill_tokens=self.slots.active_prefill_tokens(worker),
            potential_decode_blocks=self.slots.potential_decode_blocks(worker, seq_hashes),
            active_requests=self.slots.active_requests(worker),
            recent_prefill_tokens=self.slots.recent_prefill_tokens(worker) if self.config.prefill_work_weight else 0.0,
        )

    def _busy(self, worker: WorkerKey, capacities: Mapping[WorkerKey, int] | None) -> bool:
        decode_limit = self.config.active_decode_blocks_threshold
        capacity = capacities.get(worker) if capacities else None
        if decode_limit is not None and capacity and self.slots.active_blocks(worker) > decode_limit * capacity:
            return True
        prefill_limit = self.config.active_prefill_tokens_threshold
        return prefill_limit is not None and self.slots.active_prefill_tokens(worker) > prefill_limit
