"""``Decider``: a prompt in, a :class:`~kvrouter.service.core.decision.Decision` out, booked and handed on.

``/select``, ``/select_and_reserve``, the ZMQ fast path, the proxy and the router queue all decide through
:meth:`Decider.select`: the partition's candidates (minus those a session is bound away from), the prompt
hashed into blocks, one call of the partition's router (the index walk, every candidate's cost and the
choice in one compiled kernel: ``routing/router.py``), the booking, then the sinks (``decision.py``).
It raises the core's own refusals, never a status (``errors.py``): the edge that asked picks the status.
A refusal because every worker is busy (:class:`Overloaded`) is not counted here: whoever gives the final
answer counts it (the router queue retries one before it refuses).

``/query`` and ``/query_by_hash`` read the same index through :meth:`Decider.query`, with no decision.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt

from ...errors import (
    BadRequest,
    Conflict,
    DuplicateRequest,
    EngineError,
    InvalidHashInput,
    NoWorkerAvailable,
    Overloaded,
    Unavailable,
)
from ...events.model import StorageTier, WorkerKey
from ...hashing import block_hashes_array
from ...routing.disagg import PREFILL_BOOKING, DisaggConfig, Split, select_split
from ...routing.router import Selection
from ...stats.segment import EXPLAIN_INTERVAL_S
from .affinity import Affinity
from .counters import ServiceCounters
from .decision import Decision, ShadowRound, Sink
from .lifecycle import Lifecycle
from .partition import Partition
from .recording import ServiceRecording
from .registry import Registry
from .requests import QueryRequest, SelectRequest
from .reservations import Reservations
from .shadow import Shadows

__all__ = ["Decider", "QueryAnswer", "ReadIndex"]

NO_FALLBACKS: Final[list[tuple[WorkerKey, float]]] = []
ONE_HOP: Final = "one_hop: asked for one worker (the prefill workers refused the connection)"
"""Why a request asked ``whole`` is not split: the proxy's, once the prefill workers refused it twice."""


def ranked_fallbacks(selection: Selection, count: int) -> list[tuple[WorkerKey, float]]:
    """The next-best eligible candidates of an explained selection, cheapest first, with their costs."""
    if selection.explanation is None:
        return NO_FALLBACKS
    others = [w for w in selection.explanation if not w.selected and not w.busy]
    others.sort(key=lambda w: w.cost.total)
    return [(w.worker, w.cost.total) for w in others[:count]]


class ReadIndex(Protocol):
    """The index a decision reads: the engine, or another front's view of it (``engine.py``)."""

    def find_matches_by_tier(self, local_hashes: Any) -> dict[StorageTier, dict[WorkerKey, int]]: ...

    def unanswered(self) -> frozenset[int]: ...


@dataclass(frozen=True, slots=True)
class QueryAnswer:
    """``/query``'s outcome: per tier, each worker's matched blocks, for the partition's registered ranks."""

    partition: Partition
    tiers: Mapping[StorageTier, Mapping[WorkerKey, int]]


class Decider:
    """Decisions and index queries for one service; the event loop is its one user."""

    def __init__(
        self,
        index: ReadIndex,
        registry: Registry,
        reservations: Reservations,
        lifecycle: Lifecycle,
        counters: ServiceCounters,
        affinity: Affinity,
        sinks: tuple[Sink, ...],
        next_seq: Any,
        *,
        shadows: Shadows | None = None,
        recording: ServiceRecording | None = None,
        keep_records: bool = False,
        disagg: DisaggConfig | None = None,
    ) -> None:
        self.index = index
        self.registry = registry
        self.reservations = reservations
        self.lifecycle = lifecycle
        self.counters = counters
        self.affinity = affinity
        self.sinks = sinks
        self.next_seq = next_seq
        """The decisions ring's next number (``Journal.next_decision``)."""
        self.shadows = shadows
        self.recording = recording
        self.keep_records = keep_records
        self.disagg = disagg or DisaggConfig()
        self.link = self.disagg.link
        """The KV link between topology domains (rule 2's factor), made once."""
        """The link and split rule of disaggregated partitions (``routing/disagg.py``)."""
        """Every decision keeps the router's record (a decision log is written): not only those with an id."""
        self._explain_after = 0.0
        """``perf_counter`` time after which the next decision is explained for the ring (``kvrouter top``)."""

    def select(self, request: SelectRequest, *, reserve: bool) -> Decision:
        """``POST /select`` (``reserve=False``) and ``/select_and_reserve`` (``reserve=True``).

        Raises:
            Starting, Stopping: the index is not up. UnknownPartition: unknown model or group. Conflict: a
            ``selection_id`` already booked. Unavailable: no schedulable worker, or the engine failed.
            Overloaded: every worker over a busy threshold (not counted here). BadRequest: a prompt the hasher
            refuses, or a probe asked to book.
        """
        self.lifecycle.require_index()
        recording = self.recording
        if recording is None:
            return self._select(request, reserve=reserve, t=0)
        t = recording.clock.hold()  # the router reads this one time throughout (recording.py)
        try:
            return self._select(request, reserve=reserve, t=t)
        finally:
            recording.clock.release()

    def _select(self, request: SelectRequest, *, reserve: bool, t: int) -> Decision:
        partition = self.registry.partition(request.model_name, request.routing_group)
        candidates, prefill_candidates = partition.candidates, partition.prefill_candidates
        adapter = None if request.lora_name is None else partition.adapters.get(request.lora_name)
        if adapter is not None:  # a registered adapter: the workers serving it (others would refuse the request)
            candidates, prefill_candidates = adapter
            if not candidates:
                self.counters.no_worker += 1
                raise Unavailable(
                    f"no schedulable worker in {partition.name} serves LoRA adapter {request.lora_name!r} "
                    "(those registered with it are unhealthy, pending or prefill only: /workers)"
                )
        if not candidates:
            self.counters.no_worker += 1
            if partition.schedulable:  # every healthy worker prefills only: no one can generate
                raise Unavailable(
                    f"no decode-capable worker in {partition.name}: its {len(partition.schedulable)} schedulable "
                    "workers all have role prefill; register a worker with role decode or both"
                )
            waiting = sum(instance.status != "active" for instance in partition.instances.values())
            held = f", {waiting} not followed (pending or failed: /workers)" if waiting else ""
            raise Unavailable(
                f"no schedulable worker in {partition.name} ({len(partition.unhealthy)} skipped as unhealthy{held})"
            )
        hashing = time.perf_counter()
        local, isl = self._prompt(partition, request)
        selection_id = request.selection_id
        if reserve:
            if selection_id is None:
                selection_id = uuid.uuid4().hex
            elif selection_id in self.reservations.own:
                raise Conflict(f"selection_id {selection_id!r} is already reserved")
        explain = request.explain or request.fallbacks > 0 or request.probe
        # explained for the decisions ring only, one every EXPLAIN_INTERVAL_S: kvrouter top always has a recent
        # decision's candidates, and requests that did not ask for them pay nothing
        sampled = not explain and hashing >= self._explain_after
        if sampled:
            self._explain_after = hashing + EXPLAIN_INTERVAL_S
        if request.probe and reserve:
            raise BadRequest("probe: a probe books nothing; use /select")
        if not request.probe:
            candidates = self.affinity.candidates(partition.name, request.session_id, candidates)
        index: Any = partition.approx if partition.approx is not None else self.index
        shadowed = None
        if self.shadows is not None and not request.probe and not partition.disaggregated:  # before any booking
            shadowed = ShadowRound(*self.shadows.choose(partition, index, candidates, selection_id or "", local, isl))
        started = time.perf_counter()
        self.counters.phases["hash"].observe(started - hashing)
        booked = selection_id if reserve else None
        record = (
            reserve
            or selection_id is not None
            or self.keep_records
            or shadowed is not None
            or self.recording is not None
        )

        def select(workers: Sequence[WorkerKey], request_id: str | None) -> Selection:
            """One call of the router, recorded, its refusals the core's own."""
            try:
                chosen = partition.router.select(
                    index,
                    workers,
                    local_hashes=local,
                    isl_tokens=isl,
                    capacities=partition.capacities,
                    request_id=request_id,
                    explain=explain or sampled,
                    record=record,
                )
            except (NoWorkerAvailable, DuplicateRequest, EngineError) as exc:
                if self.recording is not None:
                    kind = {NoWorkerAvailable: "overloaded", DuplicateRequest: "duplicate"}.get(type(exc), "engine")
                    self.recording.decided(
                        t, partition, local, isl, request.lora_name, tuple(workers), request_id, request.probe, None,
                        kind, unanswered=self._unanswered(partition),
                    )  # fmt: skip
                if isinstance(exc, NoWorkerAvailable):
                    raise Overloaded(f"overloaded: {exc}") from exc
                if isinstance(exc, DuplicateRequest):
                    raise Conflict(str(exc)) from exc
                raise Unavailable(f"engine: {exc}") from exc
            if self.recording is not None:
                self.recording.decided(
                    t, partition, local, isl, request.lora_name, tuple(workers), request_id, request.probe, chosen,
                    unanswered=self._unanswered(partition),
                )  # fmt: skip
            return chosen

        split: Split | None = None
        if not partition.disaggregated:
            selection = select(candidates, booked)
        elif request.whole:  # one hop asked for: the decode-capable workers take it whole
            selection = select(candidates, booked)
            split = Split(selection, None, ONE_HOP, ())
        else:
            disagg = self.disagg
            split = select_split(
                select,
                index,
                partition.slots,
                partition.block_size,
                prefill_candidates,
                candidates,
                local_hashes=local,
                isl_tokens=isl,
                factor=self._factor(partition),
                max_local_prefill_tokens=disagg.max_local_prefill_tokens,
                prefill_busy_tokens=disagg.prefill_busy_tokens,
                book=booked,
            )
            selection = split.decode
        elapsed = time.perf_counter() - started
        instance = partition.instances[selection.worker[0]]
        if request.probe:  # where it would go: nothing counted, recorded, bound or kept
            return Decision(
                partition,
                selection,
                None,
                False,
                NO_FALLBACKS,
                instance.http_endpoint,
                instance.address,
                request,
                local,
                split=split,
            )
        prefill = None if split is None else split.prefill
        if reserve:
            assert selection_id is not None
            self.reservations.book(selection_id, partition, selection, local, split=prefill is not None)
            peers = self.registry.peers
            if peers is not None:  # queued: no I/O here
                peers.added(selection_id, partition.slots, request.lora_name)
                if prefill is not None:
                    peers.added(selection_id + PREFILL_BOOKING, partition.slots, request.lora_name)
        fallbacks = NO_FALLBACKS
        if request.fallbacks and split is not None and split.decode_costs:  # the next cheapest decode workers
            ranked = sorted(split.decode_costs, key=lambda pair: pair[1])
            fallbacks = [(key, cost) for key, cost in ranked if key != selection.worker][: request.fallbacks]
        elif request.fallbacks:
            fallbacks = ranked_fallbacks(selection, request.fallbacks)
        decision = Decision(
            partition,
            selection,
            selection_id,
            reserve,
            fallbacks,
            instance.http_endpoint,
            instance.address,
            request,
            local,
            elapsed,
            self.next_seq(),
            shadowed,
            split,
        )
        if prefill is not None:
            prefill_instance = partition.instances[prefill.worker[0]]
            decision.prefill_endpoint = prefill_instance.http_endpoint
            decision.prefill_address = prefill_instance.address
        for sink in self.sinks:  # hot path: a handful of calls
            sink(decision)
        if sampled:  # the answer is the one an unexplained request gets
            selection.explanation = None
        return decision

    def query(self, request: QueryRequest) -> QueryAnswer:
        """``/query`` and ``/query_by_hash``: the partition's workers' matched blocks per tier.

        Raises:
            Starting, Stopping: the index is not up. UnknownPartition: unknown model or group.
            BadRequest: a prompt the hasher refuses. Unavailable: the engine failed.
        """
        self.lifecycle.require_index()
        partition = self.registry.partition(request.model_name, request.routing_group)
        if request.token_ids is not None:
            try:
                local = block_hashes_array(
                    request.token_ids,
                    partition.block_size,
                    lora_name=request.lora_name,
                    cache_namespace=request.cache_salt,
                )
            except InvalidHashInput as exc:
                raise BadRequest(str(exc)) from exc
        else:
            local = np.array(request.block_hashes or (), dtype=np.uint64)
        if partition.approx is not None:
            return QueryAnswer(partition, partition.approx.find_matches_by_tier(local.tolist()))
        try:
            return QueryAnswer(partition, self.index.find_matches_by_tier(local))
        except EngineError as exc:
            raise Unavailable(f"engine: {exc}") from exc

    def _prompt(self, partition: Partition, request: SelectRequest) -> tuple[npt.NDArray[np.uint64], int]:
        """The prompt's local hashes and its input length in tokens."""
        block_size = partition.block_size
        if request.token_ids is not None:
            try:
                local = block_hashes_array(
                    request.token_ids, block_size, lora_name=request.lora_name, cache_namespace=request.cache_salt
                )
            except InvalidHashInput as exc:
                raise BadRequest(str(exc)) from exc
            return local, len(request.token_ids) if request.isl_tokens is None else request.isl_tokens
        local = np.array(request.block_hashes or (), dtype=np.uint64)
        return local, len(local) * block_size if request.isl_tokens is None else request.isl_tokens

    def _factor(self, partition: Partition) -> Callable[[WorkerKey, WorkerKey], float]:
        """The link factor between two of the partition's workers, by their instances' topology domains."""
        link, instances = self.link, partition.instances

        def factor(prefill: WorkerKey, decode: WorkerKey) -> float:
            return link.factor(instances[prefill[0]].topology_domain == instances[decode[0]].topology_domain)

        return factor

    def _unanswered(self, partition: Partition) -> frozenset[int]:
        """The shards the decision just made could not read (none in approximate mode: no shard is asked)."""
        return frozenset() if partition.approx is not None else self.index.unanswered()
