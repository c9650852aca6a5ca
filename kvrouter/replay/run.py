"""One run of the workload against the stack, with or without a drill's fault, measured.

A run: :meth:`Stack.reset` (every engine empty, the index following it), then the workload, the probes
and a watcher of ``GET /workers`` at 10 Hz all at once; the fault is injected when the request at
:data:`FAULT_AT` of the workload goes out, so the fleet is warm and the load continues long after it.
Once every answer is in, the run waits (up to :data:`CONVERGE_TIMEOUT_S`) for the index to equal every
engine's cache, then reads the gap counters.

``converge_s`` is the time from the injection until the router's rows show it whole again: the fault
seen (the drill's own test), ``/ready`` 200 (every shard's applier up, a worker schedulable), no
listener ``restoring`` and every detected gap settled (``detected == recovered + lost``). ``converged`` is the
stronger, truth-based check at the end (``truth.index_equals_engines``). The hit rate and TTFT cover the
whole run, so the baseline (the same workload with no fault, on the same empty start) is their yardstick.

Rejected: measuring ``converge_s`` by the probes alone (prompts the fault does not touch stay right and
would report convergence at 0 s) and a fresh stack per run (minutes of process start on 2 cores, for a
start state the reset already makes equal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..client import ApiError, Worker
from .drills import Drill, Rows
from .replicas import SYNC_COUNTERS, ReplicaStack
from .stack import Mock, ReplayError, Stack
from .truth import PROBE_INTERVAL_S, ProbeLog, index_equals_engines, probe
from .workload import Outcome, ReplayRequest, drive

__all__ = ["CONVERGE_TIMEOUT_S", "FAULT_AT", "RunResult", "run"]

log = logging.getLogger(__name__)

FAULT_AT: Final = 1 / 3
"""Where in the workload the fault is injected: a third in, when the engines' caches are warm."""

CONVERGE_TIMEOUT_S: Final = 30.0
"""Longest wait after the load for the index to equal the engines: recovery's 5 s timeout, a 5 s
restore retry and the 2 s quiet-tail check (``docs/event-plane.md``), with room for a loaded machine."""

SETTLE_S: Final = 0.5
"""After the last answer, how long to wait before the first equality check (the last batches in flight)."""


@dataclass(slots=True)
class RunResult:
    """What one run measured (``report.py`` turns it into the table and the JSON)."""

    drill: str
    """The drill's name; ``baseline`` for the run without a fault."""
    outcomes: list[Outcome]
    probes: ProbeLog
    gaps: dict[str, int] = field(default_factory=lambda: {"detected": 0, "recovered": 0, "lost": 0})
    restarts: int = 0
    fault: dict[str, Any] = field(default_factory=dict)
    fault_at: float | None = None
    """``time.monotonic()`` of the injection."""
    fault_seen: bool = False
    converge_s: float | None = None
    converged: bool = False
    mismatch: str = ""
    """What differed at the last equality check, when it never held."""
    elapsed_s: float = 0.0
    replicas: dict[str, Any] | None = None
    """With replicas: whether their loads agree at the end, and per replica what its sync counted."""
    baseline: RunResult | None = None
    """The run without a fault on the same stack, when it is not the session's first (the replica stack's)."""
    booked: dict[str, list[int]] | None = None
    """On a disaggregated stack: the workers ``GET /loads`` still shows a booking for after every answer
    (``"worker:rank"`` -> [prefill tokens, active blocks, requests]); None: not checked."""

    @property
    def completed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is None]

    @property
    def errors(self) -> int:
        return len(self.outcomes) - len(self.completed)

    @property
    def hit_rate(self) -> float:
        done = self.completed
        prompt = sum(o.prompt_tokens for o in done)
        return sum(o.cached_tokens for o in done) / prompt if prompt else 0.0

    def ttft_ms(self) -> dict[str, float | None]:
        values = sorted(o.ttft_ms for o in self.completed if o.ttft_ms is not None)
        if len(values) < 2:
            only = values[0] if values else None
            return {"p50": only, "p90": only}
        cuts = statistics.quantiles(values, n=10, method="inclusive")
        return {"p50": round(cuts[4], 2), "p90": round(cuts[8], 2)}

    @property
    def unanswered(self) -> int:
        """Requests neither answered nor refused (the connection failed, or they timed out)."""
        return sum(not o.answered for o in self.outcomes)

    @property
    def wrong_answers(self) -> int:
        return len(self.probes.wrong())

    @property
    def accounted(self) -> bool:
        """Every gap settled and, with replicas, every message the sync lost counted and re-synced."""
        gaps = self.gaps["detected"] == self.gaps["recovered"] + self.gaps["lost"]
        return gaps and (self.replicas is None or bool(self.replicas["lost_counted"]))


def _rows(workers: Sequence[Worker]) -> Rows:
    return {int(row["instance_id"]): dict(row["listeners"].get("0") or {}) for row in workers}


async def _whole(stack: Stack) -> bool:
    """On every router: ``/ready`` 200 (every shard up, a worker schedulable; replicas: the sync connected
    and not re-syncing), no listener restoring, every gap settled: the routers' own views say they are whole."""
    for url in stack.urls:
        if not (await stack.client(url).ready())["ready"]:
            return False
        for listener in _rows(await stack.workers(url)).values():
            if listener.get("state") == "restoring":
                return False
            gaps = [int(listener.get(k, 0)) for k in ("gaps_detected", "gaps_recovered", "gaps_lost")]
            if gaps[0] != gaps[1] + gaps[2]:
                return False
    return True


async def _equal_everywhere(stack: Stack) -> tuple[bool, str]:
    """:func:`index_equals_engines` on every router (replicas: each names itself in what differs)."""
    problems = []
    for i, url in enumerate(stack.urls):
        equal, mismatch = await index_equals_engines(stack, url)
        if not equal:
            problems.append(mismatch if len(stack.urls) == 1 else f"replica {i}: {mismatch}")
    return not problems, "; ".join(problems)


async def _sync_counters(stack: ReplicaStack) -> list[dict[str, Any]]:
    return [await stack.sync_status(url) for url in stack.urls]


async def _replicas(
    stack: ReplicaStack, before: list[dict[str, Any]], generations: list[int]
) -> tuple[dict[str, Any], bool]:
    """The replicas' end state: loads agree, and per replica the sync's counters over the run; and whether
    that is settled (every replica connected, not re-syncing, loads equal).

    ``lost_counted`` holds when, on every replica, each disconnect was followed by a reconnect and a re-sync,
    and every message dropped (own events not published, a slow consumer's) by a re-sync: NATS core loses
    what it loses silently, the sync counts the fault and re-syncs (``docs/nats-bridge.md``, Faults).
    """
    loads = [await stack.loads(url) for url in stack.urls]
    now = await _sync_counters(stack)
    per_replica = []
    counted = True
    settled = True
    for i, (url, status) in enumerate(zip(stack.urls, now, strict=True)):
        was = before[i] if stack.generation_of(url) == generations[i] else {}
        delta = {key: int(status.get(key, 0)) - int(was.get(key, 0)) for key in SYNC_COUNTERS}
        connected = bool(status.get("connected")) and status.get("resyncing") is None
        settled = settled and connected
        ok = connected and delta["reconnects"] >= delta["disconnects"]
        if delta["disconnects"] or delta["dropped"] or delta["slow_consumer"]:
            ok = ok and delta["resyncs"] >= 1
        counted = counted and ok
        per_replica.append({"url": url, "connected": connected, "counters": delta})
    agree = all(view == loads[0] for view in loads[1:])
    report = {
        "count": len(stack.urls),
        "loads_agree": agree,
        "loads": loads[0] if agree else loads,
        "lost_counted": counted,
        "sync": per_replica,
    }
    return report, settled and agree


async def run(
    stack: Stack,
    requests: Sequence[ReplayRequest],
    prompts: Sequence[list[int]],
    drill: Drill | None = None,
    victim: Mock | None = None,
    *,
    on_done: Callable[[Outcome], None] | None = None,
    converge_timeout: float = CONVERGE_TIMEOUT_S,
) -> RunResult:
    """Run the workload once (with ``drill``'s fault on ``victim`` when given) and measure it;
    ``converge_timeout``: how long to wait after the load for the index to equal the engines.

    Raises:
        ReplayError: the stack could not be reset, or the fault could not be injected.
    """
    await stack.reset()
    before = {url: _rows(await stack.workers(url)) for url in stack.urls}
    primary_before = before[stack.url]
    generations = [stack.generation_of(url) for url in stack.urls]
    replica_stack = stack if isinstance(stack, ReplicaStack) else None
    sync_before = await _sync_counters(replica_stack) if replica_stack is not None else []
    result = RunResult(drill.name if drill else "baseline", [], ProbeLog())
    stop = asyncio.Event()
    fault_index = int(len(requests) * FAULT_AT)
    injected = asyncio.Event()
    inject_task: list[asyncio.Task[None]] = []

    async def inject() -> None:
        assert drill is not None
        assert victim is not None
        result.fault_at = time.monotonic()
        result.fault = await drill.inject(stack, victim)
        injected.set()

    def on_sent(index: int) -> None:
        if drill is not None and index == fault_index and not inject_task:
            inject_task.append(asyncio.create_task(inject()))

    async def watch() -> None:
        """Until the fault is seen and the router is whole again: when that happened."""
        assert drill is not None
        assert victim is not None
        await injected.wait()
        assert result.fault_at is not None
        while True:
            try:
                now = _rows(await stack.workers())
                if not result.fault_seen and drill.seen(stack, victim, result.fault, primary_before, now):
                    result.fault_seen = True
                if result.fault_seen and await _whole(stack):
                    result.converge_s = round(time.monotonic() - result.fault_at, 3)
                    return
            except (OSError, TimeoutError, ReplayError, ApiError):
                pass  # the router is down (router-restart): not whole yet
            await asyncio.sleep(PROBE_INTERVAL_S)

    started = time.monotonic()
    prober = asyncio.create_task(probe(stack, prompts, result.probes, stop))
    watcher = asyncio.create_task(watch()) if drill is not None else None
    try:
        result.outcomes = await drive(stack.request_url, stack.model_name, requests, on_sent=on_sent, on_done=on_done)
        if inject_task:
            await inject_task[0]
        await asyncio.sleep(SETTLE_S)
        deadline = time.monotonic() + converge_timeout
        while True:
            settled = True
            try:
                result.converged, result.mismatch = await _equal_everywhere(stack)
                if replica_stack is not None:
                    result.replicas, settled = await _replicas(replica_stack, sync_before, generations)
            except (OSError, TimeoutError, ReplayError, ApiError) as exc:
                result.converged, result.mismatch = False, f"the router or an engine did not answer: {exc!r}"
            watched = watcher is None or watcher.done()
            if (result.converged and settled and watched) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        await prober
        if watcher is not None and not watcher.done():
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    if watcher is not None and watcher.done() and not watcher.cancelled() and watcher.exception() is not None:
        raise watcher.exception()  # type: ignore[misc]
    result.probes.departed.update(stack.departed)
    if stack.disaggregated:
        result.booked = {worker: load for worker, load in (await stack.loads()).items() if any(load)}
    for url, generation in zip(stack.urls, generations, strict=True):  # replicas: each follows every engine
        after = _rows(await stack.workers(url))
        rows_before = before.get(url, {}) if stack.generation_of(url) == generation else {}  # a new router: from 0
        for worker, listener in after.items():
            was = rows_before.get(worker, {})
            for key in ("detected", "recovered", "lost"):
                result.gaps[key] += int(listener.get(f"gaps_{key}", 0)) - int(was.get(f"gaps_{key}", 0))
            result.restarts += int(listener.get("restarts", 0)) - int(was.get("restarts", 0))
    result.elapsed_s = round(time.monotonic() - started, 2)
    return result
