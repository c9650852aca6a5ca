"""One ``kvrouter replay`` invocation: the stack, the baseline run, then each drill's run, with a progress bar.

A short unmeasured warm-up (:data:`WARMUP_REQUESTS`) goes first. The baseline runs once and serves every
drill: each run starts from the same reset fleet and sends the same requests, so a drill's hit rate and
TTFT differ from the baseline's only by its fault (and by the timing noise of a shared machine, which one
run cannot remove; ``docs/replay.md`` says so). The seed picks the probe prompts among the workload's
prompts and the victim engine; the workload itself is the trace's.

Up to three stacks, one after the other: the single-node drills on a :class:`LocalStack` (started with the
flags its drills need, e.g. the slow consumer's small queues), then the disaggregated drill on a
:class:`LocalStack` of prefill and decode engines (half of ``--mock-workers`` each), then the NATS drills on
a :class:`~kvrouter.replay.replicas.ReplicaStack`. The last two have their own warm-up and baseline (they
route differently: split requests; two views, requests alternating). Each stack is stopped before the next
starts, so they never share the 2 cores. The NATS drills are ``skipped`` with the reason when no
``nats-server`` can be found (nor ``--nats-url`` given), with ``--url``, and for ``nats-outage`` with
``--nats-url``; the disaggregated one with ``--url`` and with fewer than two engines.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..sim.trace import Trace
from .drills import DRILLS, NOT_BUILT
from .replicas import ReplicaStack
from .report import Skipped, quality
from .run import RunResult, run
from .stack import AttachedStack, LocalStack, Mock, Stack, StackConfig
from .workload import TOKENS_PER_HASH, ReplayRequest, requests_from_trace

__all__ = ["PROBES", "Outcomes", "ReplayOptions", "probe_prompts", "replay"]

log = logging.getLogger(__name__)

WARMUP_REQUESTS: Final = 40
"""The first requests of the workload, sent once unmeasured before the baseline: the first run after a start
pays the router's and the engines' first calls (slower forwarding bunches arrivals at the engines, which
their simulated TTFT then shows), and would make the baseline look worse than every drill."""

PROBES: Final = 4
"""Probe prompts asked every 100 ms: each is one ``/query`` plus its share of each engine's ``/overlap``."""


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """What the command line resolved."""

    drills: tuple[str, ...]
    requests: int
    speed: float
    seed: int
    url: str | None = None
    nats_url: str | None = None
    """The replica drills' NATS server; None: this run starts its own."""
    mock_workers: int = 4
    shards: int = 2
    num_gpu_blocks: int = 4096
    model_name: str = "default"
    record: str | None = None
    """``--record FILE``: the started router records the whole invocation (``kvrouter up --record``)."""
    logs: str | None = None
    """``--keep-logs DIR``: the stacks' logs go there (the replica stack's to ``DIR/replicas``) and stay."""


@dataclass(slots=True)
class Outcomes:
    """Everything one invocation measured."""

    baseline: RunResult | None
    results: list[RunResult | Skipped]
    workload: dict[str, Any]


def probe_prompts(requests: Sequence[ReplayRequest], rng: random.Random, count: int = PROBES) -> list[list[int]]:
    """``count`` distinct cacheable prompts (the full hash-id blocks of workload requests), picked by ``rng``."""
    seen: set[tuple[int, ...]] = set()
    candidates = []
    for request in requests:
        blocks = [t for t in request.prompt if t < 1 << 30]  # the trace's blocks, without the request's own tail
        if len(blocks) >= 2 * TOKENS_PER_HASH and tuple(blocks) not in seen:
            seen.add(tuple(blocks))
            candidates.append(blocks)
    return rng.sample(candidates, min(count, len(candidates)))


async def replay(options: ReplayOptions, trace: Trace, console: Console) -> Outcomes:
    """Start (or attach) the stack, run the baseline and every asked drill, stop the stack.

    Raises:
        ReplayError: the stack could not be started, attached or reset, or a fault not injected.
        ValueError: the workload cannot be built from ``trace`` (too few requests).
    """
    requests = requests_from_trace(trace, count=options.requests, speed=options.speed)
    rng = random.Random(options.seed)
    prompts = probe_prompts(requests, rng)
    config = StackConfig(
        mock_workers=options.mock_workers,
        num_gpu_blocks=options.num_gpu_blocks,
        shards=options.shards,
        speedup_ratio=options.speed,
        model_name=options.model_name,
        logs=options.logs,
    )
    stack: Stack
    victim_index: int | None = None
    single = [name for name in options.drills if not DRILLS[name].replicas and not DRILLS[name].disagg]
    on_replicas = [name for name in options.drills if DRILLS[name].replicas]
    on_disagg = [name for name in options.drills if DRILLS[name].disagg]
    if options.url is not None:
        stack = AttachedStack(options.url, options.model_name)
    else:
        # the victim is known before the start (the same draw as choosing among the started engines), so
        # the engine a drill needs configured (slow-consumer: small queues) is started so
        victim_index = rng.randrange(options.mock_workers)
        asked = [DRILLS[name] for name in single]
        stack = LocalStack(
            replace(
                config,
                router_args=tuple(arg for drill in asked for arg in drill.router_args),
                mock_args=((victim_index + 1, tuple(arg for drill in asked for arg in drill.victim_args)),),
                record=options.record,
                router_seed=None if options.record is None else options.seed,
            )
        )
    workload: dict[str, Any] = {
        "trace": trace.name,
        "requests": len(requests),
        "speed": options.speed,
        "seed": options.seed,
        "tokens_per_hash": TOKENS_PER_HASH,
        "duration_s": round(requests[-1].at, 2),
        "probes": len(prompts),
    }
    results: list[RunResult | Skipped] = []
    runnable = []
    for name in single:
        if stack.local or not DRILLS[name].needs_local:
            runnable.append(name)
        else:
            results.append(Skipped(name, "needs local processes (not with --url)"))
    disagg_stack: LocalStack | None = None
    disagg_victim = 0
    if on_disagg and options.url is not None:
        results += [Skipped(name, "needs local processes (not with --url)") for name in on_disagg]
    elif on_disagg and options.mock_workers < 2:
        why = "needs a prefill and a decode engine (--mock-workers 2 or more)"
        results += [Skipped(name, why) for name in on_disagg]
    elif on_disagg:
        prefill = options.mock_workers // 2
        disagg_victim = rng.randrange(prefill)  # drawn after the single stack's victim, which stays as it was
        asked = [DRILLS[name] for name in on_disagg]
        disagg_stack = LocalStack(
            replace(
                config,
                prefill_workers=prefill,
                router_args=tuple(arg for drill in asked for arg in drill.router_args),
                mock_args=((disagg_victim + 1, tuple(arg for drill in asked for arg in drill.victim_args)),),
                logs=None if options.logs is None else str(Path(options.logs) / "disagg"),
            )
        )
    on_stack = []
    why_not = ReplicaStack.available(options.nats_url)
    for name in on_replicas:
        if options.url is not None:
            results.append(Skipped(name, "needs local processes (not with --url)"))
        elif why_not is not None:
            results.append(Skipped(name, why_not))
        elif DRILLS[name].own_nats and options.nats_url is not None:
            results.append(Skipped(name, "takes the NATS server down: needs the one this run starts (no --nats-url)"))
        else:
            on_stack.append(name)
    baselines: list[RunResult] = []
    with Progress(
        TextColumn("{task.description:<16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        if runnable or (isinstance(stack, AttachedStack) and not on_stack):  # attached: checked even if all skip
            try:
                with console.status("starting the stack (kvrouter up and mock engines)..."):
                    if isinstance(stack, AttachedStack):
                        await stack.attach()
                    else:
                        assert isinstance(stack, LocalStack)
                        await stack.start()
                workload["engines"] = len(stack.mocks)
                workload["url"] = stack.url
                if isinstance(stack, LocalStack) and stack.up is not None:
                    workload["router_pid"] = stack.up.pid
                victim = stack.mocks[victim_index] if victim_index is not None else rng.choice(stack.mocks)
                baselines += await _runs(stack, runnable, requests, prompts, victim, progress, results, "")
            finally:
                await stack.close()
        else:
            await stack.close()  # never started: its temporary directory goes now, not at exit
        if disagg_stack is not None:
            try:
                with console.status("starting the disaggregated stack (kvrouter up, prefill and decode engines)..."):
                    await disagg_stack.start()
                workload["disaggregated"] = {
                    "url": disagg_stack.url,
                    "router_pid": disagg_stack.router_pid(),
                    "prefill_workers": [m.worker_id for m in disagg_stack.mocks if m.role == "prefill"],
                    "decode_workers": [m.worker_id for m in disagg_stack.mocks if m.role == "decode"],
                }
                victim = disagg_stack.mocks[disagg_victim]
                disagg_runs = await _own_runs(
                    disagg_stack, on_disagg, requests, prompts, victim, progress, results, " (P/D)"
                )
                baselines += disagg_runs
                workload["disagg_baseline"] = {**quality(disagg_runs[0]), "booked": disagg_runs[0].booked,
                                               "unanswered": disagg_runs[0].unanswered}  # fmt: skip
            finally:
                await disagg_stack.close()
        if on_stack:
            logs = None if options.logs is None else str(Path(options.logs) / "replicas")
            replicas = ReplicaStack(replace(config, logs=logs), nats_url=options.nats_url)
            try:
                with console.status("starting the replica stack (NATS, kvrouter up replicas, mock engines)..."):
                    await replicas.start()
                workload["replicas"] = {
                    "urls": replicas.urls,
                    "router_pids": [router.proc.pid for router in replicas.routers],
                    "nats_url": replicas.nats_url,
                    "nats_server": "started by this run" if replicas.nats is not None else "given (--nats-url)",
                    "namespace": replicas.namespace,
                }
                victim = replicas.mocks[victim_index if victim_index is not None else 0]
                baselines += await _own_runs(
                    replicas, on_stack, requests, prompts, victim, progress, results, " (replicas)"
                )
            finally:
                await replicas.close()
    baseline = baselines[0] if baselines else None
    if on_stack and len(baselines) > 1:
        workload["replica_baseline"] = quality(baselines[-1])
    order = {name: i for i, name in enumerate(options.drills)}
    results.sort(key=lambda r: order[r.drill])
    workload["not_built"] = list(NOT_BUILT)
    return Outcomes(baseline, results, workload)


async def _own_runs(
    stack: Stack,
    names: Sequence[str],
    requests: Sequence[ReplayRequest],
    prompts: list[list[int]],
    victim: Mock,
    progress: Progress,
    results: list[RunResult | Skipped],
    label: str,
) -> list[RunResult]:
    """:func:`_runs` on a stack of these drills' own (the disaggregated one, the replicas'): each drill's
    result is judged against that stack's baseline, not the single-node one."""
    runs = await _runs(stack, names, requests, prompts, victim, progress, results, label)
    for result in results:
        if isinstance(result, RunResult) and result.drill in names:
            result.baseline = runs[0]
    return runs


async def _runs(
    stack: Stack,
    names: Sequence[str],
    requests: Sequence[ReplayRequest],
    prompts: list[list[int]],
    victim: Mock,
    progress: Progress,
    results: list[RunResult | Skipped],
    label: str,
) -> list[RunResult]:
    """On ``stack``: the warm-up, the baseline (returned, in a list: none when no drill runs) and each drill
    of ``names`` (appended to ``results``)."""
    warmup = requests[: min(WARMUP_REQUESTS, max(1, len(requests) // 10))]
    task = progress.add_task("warm-up" + label, total=len(warmup), note="")
    await run(stack, warmup, prompts, on_done=lambda _outcome: progress.advance(task))
    baseline: list[RunResult] = []
    names = ["baseline", *names] if names else []
    tasks = {name: progress.add_task(name + label if name == "baseline" else name, total=len(requests), note="",
                                     start=False) for name in names}  # fmt: skip
    for name in names:
        task = tasks[name]
        progress.start_task(task)

        def done(outcome: Any, task: Any = task) -> None:
            progress.advance(task)

        drill = DRILLS.get(name)
        result = await run(stack, requests, prompts, drill, victim if drill else None, on_done=done)
        note = "converged" if result.converged else "NOT converged"
        progress.update(task, note=f"{note}, {result.elapsed_s:.0f}s")
        if drill is None:
            baseline.append(result)
        else:
            results.append(result)
    return baseline
