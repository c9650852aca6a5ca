"""The held-out routing runs: Mooncake worker counts, speed-ups, trace segments and seeds outside the grid.

    python tools/bench_routing_held_out.py [--runs LABEL[,LABEL…]] [--jobs N] [--json FILE] [--check]

A default chosen on ``tools/bench_routing.py``'s grid must hold where it was not chosen. These runs were
never used to choose one (``docs/routing-benchmark.md``, "Held out"): round robin, ``dynamo_t0`` and kvrouter
on each, and issue 10's bars for kvrouter (uncached-prefill imbalance at most 1.10 up to 16 workers, above
that at most the larger of 1.10 and round robin's; hit rate at least ``dynamo_t0``'s; TTFT p90 below
``dynamo_t0``'s). A segment's clock starts at its first request. ``--check`` turns a failed bar into exit 1.
Runs are deterministic (seeded); ``--jobs`` spreads them over processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bench_routing import IMBALANCE_BAR, IMBALANCE_BAR_MAX_WORKERS, TRACES

from kvrouter.sim.metrics import RunResult
from kvrouter.sim.policies import make_policy
from kvrouter.sim.simulator import simulate
from kvrouter.sim.trace import load_trace


@dataclass(frozen=True, slots=True)
class Run:
    label: str
    trace: str
    """``conversation`` or ``synthetic``."""
    workers: int
    speedup: float
    first: int = 0
    """The segment's first request (0-based); the rest of the trace from there."""
    seed: int = 0


RUNS: Final = (
    Run("C6 x3", "conversation", 6, 3),
    Run("C12 x6", "conversation", 12, 6),
    Run("C24 x12", "conversation", 24, 12),
    Run("S6 x1.5", "synthetic", 6, 1.5),
    Run("S12 x3", "synthetic", 12, 3),
    Run("S24 x6", "synthetic", 24, 6),
    Run("C16 x6", "conversation", 16, 6),
    Run("C16 x10", "conversation", 16, 10),
    Run("S16 x3", "synthetic", 16, 3),
    Run("S16 x5", "synthetic", 16, 5),
    Run("C16 x8, requests 6,001-12,031", "conversation", 16, 8, first=6000),
    Run("S16 x4, requests 2,001-3,993", "synthetic", 16, 4, first=2000),
    Run("S16 x4, seed 1", "synthetic", 16, 4, seed=1),
    Run("S16 x4, seed 2", "synthetic", 16, 4, seed=2),
)
POLICIES: Final = ("round_robin", "dynamo_t0", "kvrouter")


def run_one(traces: Path, run: Run, policy: str) -> RunResult:
    requests = load_trace(traces / f"mooncake_fast25_{run.trace}_trace.jsonl", speedup=run.speedup).requests
    if run.first:
        start = requests[run.first].arrival
        requests = tuple(dataclasses.replace(r, arrival=r.arrival - start) for r in requests[run.first :])
    return simulate(requests, workers=run.workers, policy=make_policy(policy, seed=run.seed), seed=run.seed)


def figures(result: RunResult) -> str:
    """``hit p50/p90/p99 imbalance``, as the doc's tables give them."""
    return (
        f"{result.hit_rate:.3f} {result.ttft_p50_ms:.0f}/{result.ttft_p90_ms:.0f}/{result.ttft_p99_ms:.0f} "
        f"{result.prefill_imbalance:.2f}"
    )


def bars(run: Run, rr: RunResult, t0: RunResult, kv: RunResult) -> list[tuple[str, bool]]:
    """Issue 10's bars for kvrouter on one run."""
    bar = IMBALANCE_BAR if run.workers <= IMBALANCE_BAR_MAX_WORKERS else max(IMBALANCE_BAR, rr.prefill_imbalance)
    return [
        (f"imbalance {kv.prefill_imbalance:.3f} ≤ {bar:.3f}", kv.prefill_imbalance <= bar),
        (f"hit {kv.hit_rate:.3f} ≥ dynamo_t0's {t0.hit_rate:.3f}", kv.hit_rate >= t0.hit_rate),
        (f"TTFT p90 {kv.ttft_p90_ms:.0f} < dynamo_t0's {t0.ttft_p90_ms:.0f} ms", kv.ttft_p90_ms < t0.ttft_p90_ms),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel runs [default: CPUs]")
    parser.add_argument("--traces", type=Path, default=TRACES, metavar="DIR", help="folder of the Mooncake traces")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures and bars here")
    parser.add_argument("--check", action="store_true", help="exit 1 when a bar fails")
    parser.add_argument("--runs", metavar="LABEL[,LABEL…]", help="a subset, by label [default: all]")
    args = parser.parse_args(argv)

    runs = list(RUNS)
    if args.runs:
        wanted = [label.strip() for label in args.runs.split(",") if label.strip()]
        known = {run.label: run for run in RUNS}
        unknown = [label for label in wanted if label not in known]
        if unknown or not wanted:
            raise SystemExit(
                f"bench_routing_held_out: unknown run {unknown or args.runs!r}; choose from: {', '.join(known)}"
            )
        runs = [known[label] for label in wanted]
    grid = [(run, policy) for run in runs for policy in POLICIES]
    started, load_before = time.perf_counter(), os.getloadavg()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(run_one, [args.traces] * len(grid), *zip(*grid, strict=True)))
    by = dict(zip(grid, results, strict=True))
    print(f"| run | {' | '.join(POLICIES)} | bars |")
    print("|---|" + "---|" * (len(POLICIES) + 1))
    rows, failed = [], 0
    for run in runs:
        rr, t0, kv = (by[(run, p)] for p in POLICIES)
        checked = bars(run, rr, t0, kv)
        failed += sum(not ok for _, ok in checked)
        verdict = "pass" if all(ok for _, ok in checked) else "FAIL: " + "; ".join(t for t, ok in checked if not ok)
        print(f"| {run.label} | {' | '.join(figures(r) for r in (rr, t0, kv))} | {verdict} |")
        rows.append(
            {
                "run": run.label,
                **{p: by[(run, p)].summary() for p in POLICIES},
                "bars": [{"bar": text, "passed": ok} for text, ok in checked],
            }
        )
    print(
        f"\n{len(grid)} runs in {time.perf_counter() - started:.1f} s wall on {args.jobs} job(s); "
        f"load average {[round(x, 2) for x in load_before]} before, {[round(x, 2) for x in os.getloadavg()]} "
        f"after; python {sys.version.split()[0]}; {failed} bar(s) failed"
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "failed": failed}, indent=1, default=str))
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
