"""``simulate``: replay a trace through simulated engines under one routing policy, in virtual time.

A deterministic discrete-event loop (``spec/routing-benchmark.md`` §2, §5; the loop itself is
``engines.py``'s, shared with the disaggregated simulator). Each worker is a
:class:`~kvrouter.worker.WorkerModel`, which knows iterations but no clock; the loop gives each
iteration its place in simulated time. Three things happen, in this order when simultaneous:

1. **An iteration ends** (the worker decided it, with everything it did, when it started). Its first
   tokens and completions reach the router at once (``slots.mark_prefill_completed`` / ``slots.free`` +
   ``policy.finished``: the response path); its KV events reach the index ``event_lag_ms`` later (with
   no lag, at once). A lagged delivery due at the same instant goes after the iteration ends and before
   any arrival.
2. **A request arrives** (``arrival`` seconds, i.e. trace timestamp / speedup). The policy chooses a
   worker from a :class:`~kvrouter.sim.Cluster` view (timed with ``perf_counter_ns``); the simulator
   books the request in the slot manager with the index's overlap for that worker (plus what the policy
   predicts there: ``Policy.booked_overlap``), tells the policy, and queues the request at the worker.
3. **A worker starts its next iteration**, after every arrival at that instant, as the mocker enqueues
   all arrivals up to "now" before a pass. An idle worker starts one as soon as a request reaches it.

KV events are delivered at the end of the iteration that caused them, not at its start (an engine
publishes a block once its KV is computed), and first tokens / completions are stamped there too.

**Fast-forward.** A worker with nothing waiting or prefilling only decodes, and between two block
boundaries (or completions) of its sequences its KV usage, hence its iteration time, is constant. Such a
stretch is run as one block of iterations, ending at the first iteration boundary at or after the next
arrival anywhere (that arrival may come to this worker and must then join at that boundary, as it would
have); the stretch is exactly the iterations it replaces, so results do not depend on it
(``tests/sim/test_simulator.py::test_fast_forward_changes_nothing``). Cost then scales with arrivals,
completions and block boundaries, not with tokens: C8 under round robin is ~39k stepped iterations and
~23k skipped stretches instead of ~470k iterations one by one (8 workers, ~880 s at ~15 ms), about 2 s.

Determinism: one ``random.Random(seed)`` is the only randomness (policies use it through ``Cluster``);
no set of strings is iterated; ties in time are ordered by kind, then by the order events were made.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..events.model import WorkerKey
from ..hashing import sequence_hashes
from ..index import RadixIndex
from ..routing import SlotManager
from ..worker import Iteration, WorkerConfig, WorkerModel
from .engines import Engines, arrival_order
from .metrics import RunResult, imbalance, percentile, weighted_percentile
from .policy import Cluster, Policy, Request

__all__ = ["simulate"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Record:
    """What happened to one request."""

    worker: int = -1
    predicted_blocks: int = 0
    reused_tokens: int = 0
    first_token_ms: float = math.nan
    finish_ms: float = math.nan


def simulate(
    requests: Sequence[Request],
    *,
    workers: int,
    policy: Policy,
    seed: int = 0,
    event_lag_ms: float = 0.0,
    blocks_per_worker: int = 2048,
    block_size: int = 512,
    prefix_sharing: Literal["scheduled", "computed"] = "scheduled",
) -> RunResult:
    """Route ``requests`` with ``policy`` over ``workers`` simulated engines and measure the result.

    Args:
        requests: the trace, any order (replayed by ``arrival``, ties in the given order); each
            ``request_id`` unique; ``local_hashes`` = the ``input_tokens // block_size`` full blocks' ids.
        workers: engines, named ``(i, 0)`` for ``i`` in ``range(workers)``.
        policy: a fresh policy instance (it may keep state across the run).
        seed: seeds ``Cluster.rng``, the run's only random source.
        event_lag_ms: simulated delay between an engine's KV event and the index applying it.
        blocks_per_worker: KV blocks per engine (the anchors use 2048).
        block_size: tokens per block (the traces use 512).
        prefix_sharing: what a request admitted beside a running prefill of its prefix reuses: the blocks
            scheduled (vLLM v1, the mocker, the grid) or only those computed (SGLang); ``WorkerConfig``.

    Returns:
        The run's metrics; TTFT per request in the order given.

    Raises:
        ValueError: bad arguments, a duplicate request id, or the policy chose an unknown worker.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    if event_lag_ms < 0:
        raise ValueError(f"event_lag_ms must be >= 0, got {event_lag_ms!r}")
    config = WorkerConfig(block_size=block_size, num_blocks=blocks_per_worker, prefix_sharing=prefix_sharing)
    keys: tuple[WorkerKey, ...] = tuple((i, 0) for i in range(workers))
    models = [WorkerModel(i, config) for i in range(workers)]
    index = RadixIndex()
    engines = Engines(models, index, event_lag_ms)
    slots = SlotManager(block_size=block_size, clock=lambda: engines.now / 1000.0)
    cluster = Cluster(
        workers=keys,
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

    def ended(worker: int, iteration: Iteration | None) -> None:
        if iteration is None:
            return
        engines.deliver(worker, iteration.events)
        now = engines.now
        for request_id, reused in iteration.admitted:
            records[position[request_id]].reused_tokens = reused
        for request_id in iteration.first_tokens:
            records[position[request_id]].first_token_ms = now
            slots.mark_prefill_completed(request_id)
        for request_id in iteration.finished:
            i = position[request_id]
            records[i].finish_ms = now
            slots.free(request_id)
            policy.finished(requests[i], keys[worker], cluster)

    def arrive(k: int) -> None:
        i = order[k]
        request = requests[i]
        began = time.perf_counter_ns()
        worker = policy.choose(request, cluster)
        decision_us.append((time.perf_counter_ns() - began) / 1000.0)
        if worker not in keys:
            raise ValueError(f"policy {policy.name!r} chose {worker!r}, not one of the {workers} workers")
        overlap = index.find_matches(request.local_hashes).get(worker, 0)
        booked = policy.booked_overlap(request, worker, overlap)
        slots.add_request(
            request.request_id, worker, sequence_hashes(list(request.local_hashes)), request.input_tokens, booked
        )
        record = records[i]
        record.worker = worker[0]
        record.predicted_blocks = overlap
        policy.routed(request, worker, cluster)
        models[worker[0]].add_request(
            request.request_id, request.input_tokens, request.output_tokens, request.local_hashes
        )
        engines.wake(worker[0])

    def clock(seconds: float) -> None:
        cluster.now = seconds

    engines.run([requests[i].arrival * 1000.0 for i in order], arrive, ended, clock=clock)
    return _result(
        policy,
        workers,
        requests,
        records,
        models,
        decision_us,
        engines.itl_values,
        engines.itl_weights,
        engines.kv_area,
    )


def _result(
    policy: Policy,
    workers: int,
    requests: Sequence[Request],
    records: list[_Record],
    models: list[WorkerModel],
    decision_us: list[float],
    itl_values: list[float],
    itl_weights: list[int],
    kv_area: list[float],
) -> RunResult:
    ttft = [record.first_token_ms - request.arrival * 1000.0 for request, record in zip(requests, records, strict=True)]
    e2e = [record.finish_ms - request.arrival * 1000.0 for request, record in zip(requests, records, strict=True)]
    if any(math.isnan(value) for value in e2e):
        raise RuntimeError("simulation ended with unfinished requests")
    counts = [0] * workers
    for record in records:
        counts[record.worker] += 1
    total_input = sum(request.input_tokens for request in requests)
    reused = sum(record.reused_tokens for record in records)
    block_size = models[0].config.block_size if models else 1
    errors = [abs(record.predicted_blocks - record.reused_tokens // block_size) for record in records]
    prefill = [model.prefill_tokens_total for model in models]
    first_arrival = min((request.arrival * 1000.0 for request in requests), default=0.0)
    last_finish = max((record.finish_ms for record in records), default=0.0)
    return RunResult(
        policy=policy.name,
        workers=workers,
        requests=len(requests),
        hit_rate=reused / total_input if total_input else 0.0,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p90_ms=percentile(ttft, 90),
        ttft_p99_ms=percentile(ttft, 99),
        ttft_mean_ms=sum(ttft) / len(ttft) if ttft else math.nan,
        itl_p50_ms=weighted_percentile(itl_values, itl_weights, 50),
        itl_p90_ms=weighted_percentile(itl_values, itl_weights, 90),
        e2e_p99_ms=percentile(e2e, 99),
        prefill_imbalance=imbalance(prefill),
        kv_imbalance=imbalance(kv_area),
        request_imbalance=imbalance(counts),
        decision_us_p50=percentile(decision_us, 50),
        decision_us_p99=percentile(decision_us, 99),
        overlap_mae_blocks=sum(errors) / len(errors) if errors else 0.0,
        requests_per_worker=tuple(counts),
        prefill_tokens_per_worker=tuple(prefill),
        preemptions=sum(model.preemptions for model in models),
        makespan_ms=last_finish - first_arrival,
        ttft_ms=tuple(ttft),
    )
