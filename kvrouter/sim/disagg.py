"""``simulate_disagg``: a trace through a disaggregated fleet, prefill workers and decode workers, in virtual time.

The engines' loop the aggregated simulator runs on (``engines.py``), with a second hop. A
:class:`DisaggPolicy` answers each arrival with a :class:`Plan`: a decode worker and, when the request is
split, a prefill worker.

- **Split.** The prefill worker gets the prompt with one output token, as vLLM's proxy sends the prefill
  hop (``max_tokens`` 1). Its first token ends the hop; the decode worker then pulls the KV it lacks (the
  prompt's tokens past its own cached prefix, the partial last block included), which takes
  :meth:`~kvrouter.routing.disagg.Link.ms` over the link between the two workers' topology domains. The KV
  lands at the decode worker's next iteration boundary: its blocks are stored as an engine stores pulled
  blocks (``WorkerModel.receive``, KV events and all), and the request joins the decode worker's queue as a
  received prompt (``WorkerModel.add_request(received=True)``): it prefills nothing (or, when a pulled block
  was evicted before it was admitted, from there on), and its first token takes one decode step. Its TTFT
  is the decode worker's first token.
- **Local.** The decode worker gets the request and prefills it itself, as an aggregated worker.

Bookings, as the router books a split request: the prefill worker's prefill under ``<id>#prefill`` until the
hop ends, the decode worker's blocks under the request's id at once (booked as cached: nothing left to
prefill there), marked prefill-completed at its first token and freed at its end. A local request is
booked as an aggregated one.

**Timing assumptions** (options of :func:`simulate_disagg`, printed by ``kvrouter simulate``): the engines
are the aggregated simulator's (the mocker's prefill and decode speeds), prefill and decode workers alike;
a transfer costs ``Link.overhead_ms`` (2 ms by default, an assumption: NIXL's descriptor exchange and
the pull's round trips) plus bytes over ``gbps_local`` inside a domain or ``gbps`` across; the workers are
spread over ``domains`` topology domains in turn (one by default: every transfer is local).
"""

from __future__ import annotations

import abc
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from ..events.model import WorkerKey
from ..hashing import sequence_hashes
from ..index import RadixIndex
from ..routing import SlotManager
from ..routing.disagg import PREFILL_BOOKING, Link
from ..worker import Iteration, WorkerConfig, WorkerModel
from .engines import LANDED, Engines, arrival_order
from .metrics import imbalance, percentile, weighted_percentile
from .policy import Cluster, Request

__all__ = ["DEFAULT_OVERHEAD_MS", "DisaggPolicy", "DisaggResult", "Fleet", "Plan", "simulate_disagg"]

DEFAULT_OVERHEAD_MS = 2.0
"""A transfer's fixed cost in the simulator (an assumption; see the module docstring)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Where a request goes: its decode worker, and its prefill worker when it is split."""

    decode: WorkerKey
    prefill: WorkerKey | None
    """None: the decode worker prefills it itself."""
    reason: str | None = None
    """Why it is not split (``routing/disagg.py``'s rule), when it is not."""


@dataclass(slots=True)
class Fleet:
    """The state a disaggregated policy may read (and must not change)."""

    prefill: tuple[WorkerKey, ...]
    decode: tuple[WorkerKey, ...]
    domains: Mapping[WorkerKey, int]
    """Each worker's topology domain."""
    link: Link
    index: RadixIndex
    slots: SlotManager
    block_size: int
    capacity_blocks: int
    now: float
    """Simulated seconds."""
    rng: random.Random

    def pool(self, workers: tuple[WorkerKey, ...]) -> Cluster:
        """An aggregated policy's view of ``workers``: for the prefill choice, today's decision."""
        return Cluster(workers, self.index, self.slots, self.block_size, self.capacity_blocks, self.now, self.rng)

    def factor(self, prefill: WorkerKey, decode: WorkerKey) -> float:
        """:meth:`Link.factor` between two workers."""
        return self.link.factor(self.domains[prefill] == self.domains[decode])


class DisaggPolicy(abc.ABC):
    """A disaggregated routing policy; one instance serves one run."""

    name: ClassVar[str]

    @abc.abstractmethod
    def plan(self, request: Request, fleet: Fleet) -> Plan:
        """Where ``request`` goes."""

    def booked_overlap(self, request: Request, worker: WorkerKey, index_overlap: int) -> int:
        """The blocks the prefill worker's booking counts as cached (``Policy.booked_overlap``)."""
        return index_overlap


@dataclass(frozen=True, slots=True)
class DisaggResult:
    """The metrics of one disaggregated run. Times in milliseconds."""

    policy: str
    prefill_workers: int
    decode_workers: int
    requests: int
    hit_rate: float
    """Prompt tokens reused from cache where the prompt was prefilled / all prompt tokens."""
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    prefill_imbalance: float
    """Uncached prefill tokens of the prefill workers, max over mean."""
    output_tokens_per_s: float
    """Output tokens over the makespan (first arrival to last completion)."""
    bytes_transferred: int
    local_prefill_share: float
    """Requests prefilled by their decode worker / all requests."""
    decision_us_p50: float
    decision_us_p99: float
    makespan_ms: float
    ttft_ms: tuple[float, ...]


@dataclass(slots=True)
class _Record:
    decode: int = -1
    prefill: int = -1
    """-1: prefilled locally."""
    reused_tokens: int = 0
    first_token_ms: float = math.nan
    finish_ms: float = math.nan


def simulate_disagg(
    requests: Sequence[Request],
    *,
    prefill_workers: int,
    decode_workers: int,
    policy: DisaggPolicy,
    link: Link | None = None,
    domains: int = 1,
    seed: int = 0,
    event_lag_ms: float = 0.0,
    blocks_per_worker: int = 2048,
    block_size: int = 512,
    prefix_sharing: Literal["scheduled", "computed"] = "scheduled",
) -> DisaggResult:
    """Route ``requests`` with ``policy`` over ``prefill_workers`` + ``decode_workers`` simulated engines.

    Workers ``(i, 0)``: prefill ``i < prefill_workers``, decode after them; worker ``i`` of each pool is in
    domain ``i % domains``. Other arguments as :func:`~kvrouter.sim.simulator.simulate`'s; ``link``
    defaults to ``Link(overhead_ms=DEFAULT_OVERHEAD_MS)``.

    Raises:
        ValueError: bad arguments, a duplicate request id, or a plan naming a worker of the wrong pool.
    """
    if prefill_workers < 1 or decode_workers < 1:
        raise ValueError(f"needs a prefill and a decode worker, got {prefill_workers} and {decode_workers}")
    if domains < 1 or event_lag_ms < 0:
        raise ValueError(f"domains must be >= 1 and event_lag_ms >= 0, got {domains!r} and {event_lag_ms!r}")
    link = link or Link(overhead_ms=DEFAULT_OVERHEAD_MS)
    config = WorkerConfig(block_size=block_size, num_blocks=blocks_per_worker, prefix_sharing=prefix_sharing)
    total = prefill_workers + decode_workers
    keys: tuple[WorkerKey, ...] = tuple((i, 0) for i in range(total))
    prefill_keys, decode_keys = keys[:prefill_workers], keys[prefill_workers:]
    models = [WorkerModel(i, config) for i in range(total)]
    index = RadixIndex()
    engines = Engines(models, index, event_lag_ms)
    # every booking is freed by the run itself: none may expire (a 2P+6D fleet keeps requests queued for minutes)
    slots = SlotManager(block_size=block_size, clock=lambda: engines.now / 1000.0, expiry_secs=math.inf)
    fleet = Fleet(
        prefill=prefill_keys,
        decode=decode_keys,
        domains={key: (key[0] if key[0] < prefill_workers else key[0] - prefill_workers) % domains for key in keys},
        link=link,
        index=index,
        slots=slots,
        block_size=block_size,
        capacity_blocks=blocks_per_worker,
        now=0.0,
        rng=random.Random(seed),
    )
    position, order = arrival_order(requests)
    records = [_Record() for _ in requests]
    decision_us: list[float] = []
    moved = 0
    waiting: list[list[int]] = [[] for _ in range(total)]
    """Per decode worker: requests whose KV arrived during its iteration, taken at its end."""
    landings: list[list[float]] = [[] for _ in range(total)]
    """Per decode worker: when the transfers on their way to it land."""
    ends = engines.ends

    def bound(worker: int, next_arrival: float) -> float:
        """A decode stretch stops at the first boundary after anything that may bring this worker a request: an
        arrival, a transfer on its way, or a prefill iteration's end (whose first token starts one)."""
        if worker < prefill_workers:
            return next_arrival
        return min(next_arrival, *landings[worker], *ends[:prefill_workers])

    def join_decode(i: int, worker: int) -> None:
        """The KV of split request ``i`` landed on ``worker``, between its iterations."""
        request = requests[i]
        engines.deliver(worker, models[worker].receive(request.local_hashes))
        models[worker].add_request(
            request.request_id, request.input_tokens, request.output_tokens, request.local_hashes, received=True
        )

    def landed(worker: int, i: int) -> None:
        landings[worker].remove(engines.now)
        if ends[worker] < math.inf:  # mid-iteration: it joins at the iteration's end
            waiting[worker].append(i)
        else:
            join_decode(i, worker)
            engines.wake(worker)

    def ended(worker: int, iteration: Iteration | None) -> None:
        if iteration is not None:
            finish_iteration(worker, iteration)
        for i in waiting[worker]:
            join_decode(i, worker)
        waiting[worker].clear()

    def finish_iteration(worker: int, iteration: Iteration) -> None:
        nonlocal moved
        now = engines.now
        engines.deliver(worker, iteration.events)
        prefilling = worker < prefill_workers
        for request_id, reused in iteration.admitted:
            i = position[request_id]
            if prefilling or records[i].prefill < 0:  # the hop that prefills it says what it reused
                records[i].reused_tokens = reused
        for request_id in iteration.first_tokens:
            i = position[request_id]
            if prefilling:  # the prefill hop is done: the decode worker pulls what it lacks
                slots.free(request_id + PREFILL_BOOKING)
                request, record = requests[i], records[i]
                hits = models[record.decode].kv.prefix_hits(request.local_hashes)
                tokens = request.input_tokens - hits * block_size
                moved += link.bytes(tokens)
                local = fleet.domains[keys[worker]] == fleet.domains[keys[record.decode]]
                at = now + link.ms(tokens, local=local)
                landings[record.decode].append(at)
                engines.push(at, LANDED, record.decode, i)
            else:
                records[i].first_token_ms = now
                slots.mark_prefill_completed(request_id)
        for request_id in iteration.finished:
            if not prefilling:
                i = position[request_id]
                records[i].finish_ms = now
                slots.free(request_id)

    def arrive(k: int) -> None:
        i = order[k]
        request = requests[i]
        began = time.perf_counter_ns()
        plan = policy.plan(request, fleet)
        decision_us.append((time.perf_counter_ns() - began) / 1000.0)
        if plan.decode not in decode_keys or (plan.prefill is not None and plan.prefill not in prefill_keys):
            raise ValueError(f"policy {policy.name!r} planned {plan!r}, not a prefill and a decode worker")
        record = records[i]
        record.decode = plan.decode[0]
        hashes = sequence_hashes(list(request.local_hashes))
        overlaps = index.find_matches(request.local_hashes)
        if plan.prefill is None:
            booked = overlaps.get(plan.decode, 0)
            slots.add_request(request.request_id, plan.decode, hashes, request.input_tokens, booked)
            models[plan.decode[0]].add_request(
                request.request_id, request.input_tokens, request.output_tokens, request.local_hashes
            )
            engines.wake(plan.decode[0])
            return
        record.prefill = plan.prefill[0]
        booked = policy.booked_overlap(request, plan.prefill, overlaps.get(plan.prefill, 0))
        slots.add_request(request.request_id + PREFILL_BOOKING, plan.prefill, hashes, request.input_tokens, booked)
        slots.add_request(request.request_id, plan.decode, hashes, request.input_tokens, len(request.local_hashes))
        models[plan.prefill[0]].add_request(request.request_id, request.input_tokens, 1, request.local_hashes)
        engines.wake(plan.prefill[0])

    def clock(seconds: float) -> None:
        fleet.now = seconds

    engines.run([requests[i].arrival * 1000.0 for i in order], arrive, ended, landed=landed, bound=bound, clock=clock)
    itl = (engines.itl_values, engines.itl_weights)
    return _result(policy, models, prefill_workers, requests, records, decision_us, itl, moved)


def _result(
    policy: DisaggPolicy,
    models: list[WorkerModel],
    prefill_workers: int,
    requests: Sequence[Request],
    records: list[_Record],
    decision_us: list[float],
    itl: tuple[list[float], list[int]],
    moved: int,
) -> DisaggResult:
    itl_values, itl_weights = itl
    ttft = [record.first_token_ms - request.arrival * 1000.0 for request, record in zip(requests, records, strict=True)]
    if any(math.isnan(record.finish_ms) for record in records):
        raise RuntimeError("simulation ended with unfinished requests")
    total_input = sum(request.input_tokens for request in requests)
    first_arrival = min((request.arrival * 1000.0 for request in requests), default=0.0)
    last_finish = max((record.finish_ms for record in records), default=0.0)
    makespan = last_finish - first_arrival
    output = sum(request.output_tokens for request in requests)
    return DisaggResult(
        policy=policy.name,
        prefill_workers=prefill_workers,
        decode_workers=len(models) - prefill_workers,
        requests=len(requests),
        hit_rate=sum(record.reused_tokens for record in records) / total_input if total_input else 0.0,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p90_ms=percentile(ttft, 90),
        ttft_p99_ms=percentile(ttft, 99),
        itl_p50_ms=weighted_percentile(itl_values, itl_weights, 50),
        itl_p90_ms=weighted_percentile(itl_values, itl_weights, 90),
        prefill_imbalance=imbalance([model.prefill_tokens_total for model in models[:prefill_workers]]),
        output_tokens_per_s=output / (makespan / 1000.0) if makespan > 0 else 0.0,
        bytes_transferred=moved,
        local_prefill_share=sum(record.prefill < 0 for record in records) / len(records) if records else 0.0,
        decision_us_p50=percentile(decision_us, 50),
        decision_us_p99=percentile(decision_us, 99),
        makespan_ms=makespan,
        ttft_ms=tuple(ttft),
    )
