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

import aiohttp

from .drills import Drill, Rows
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
    def wrong_answers(self) -> int:
        return len(self.probes.wrong())

    @property
    def accounted(self) -> bool:
        return self.gaps["detected"] == self.gaps["recovered"] + self.gaps["lost"]


def _rows(workers: list[dict[str, Any]]) -> Rows:
    return {int(row["instance_id"]): dict(row.get("listeners", {}).get("0", {})) for row in workers}


async def _whole(stack: Stack) -> bool:
    """``/ready`` 200 (every shard up, a worker schedulable), no listener restoring, every gap settled: the
    router's own view says it is whole."""
    status, _ready = await stack.call("GET", "/ready")
    if status != 200:
        return False
    for listener in _rows(await stack.workers()).values():
        if listener.get("state") == "restoring":
            return False
        gaps = [int(listener.get(k, 0)) for k in ("gaps_detected", "gaps_recovered", "gaps_lost")]
        if gaps[0] != gaps[1] + gaps[2]:
            return False
    return True


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
    before = _rows(await stack.workers())
    generation = stack.generation
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
                if not result.fault_seen and drill.seen(stack, victim, result.fault, before, now):
                    result.fault_seen = True
                if result.fault_seen and await _whole(stack):
                    result.converge_s = round(time.monotonic() - result.fault_at, 3)
                    return
            except (OSError, TimeoutError, ReplayError, aiohttp.ClientError):
                pass  # the router is down (router-restart): not whole yet
            await asyncio.sleep(PROBE_INTERVAL_S)

    started = time.monotonic()
    prober = asyncio.create_task(probe(stack, prompts, result.probes, stop))
    watcher = asyncio.create_task(watch()) if drill is not None else None
    try:
        result.outcomes = await drive(lambda: stack.url, stack.model_name, requests, on_sent=on_sent, on_done=on_done)
        if inject_task:
            await inject_task[0]
        await asyncio.sleep(SETTLE_S)
        deadline = time.monotonic() + converge_timeout
        while True:
            try:
                result.converged, result.mismatch = await index_equals_engines(stack)
            except (OSError, TimeoutError, ReplayError, aiohttp.ClientError) as exc:
                result.converged, result.mismatch = False, f"the router or an engine did not answer: {exc!r}"
            watched = watcher is None or watcher.done()
            if (result.converged and watched) or time.monotonic() > deadline:
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
    after = _rows(await stack.workers())
    if stack.generation != generation:  # a new router: its rows counted from 0
        before = {}
    for worker, listener in after.items():
        was = before.get(worker, {})
        for key in ("detected", "recovered", "lost"):
            result.gaps[key] += int(listener.get(f"gaps_{key}", 0)) - int(was.get(f"gaps_{key}", 0))
        result.restarts += int(listener.get("restarts", 0)) - int(was.get("restarts", 0))
    result.elapsed_s = round(time.monotonic() - started, 2)
    return result
