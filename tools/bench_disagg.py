"""Disaggregated fleets against an aggregated one of the same size, on both Mooncake traces (the simulator).

    python tools/bench_disagg.py [--jobs N] [--limit N] [--json FILE] [--check] [--write-doc]

Each trace runs at its 8-worker speed-up of ``tools/bench_routing.py`` (C8 x4, S8 x2) and at one held-out
speed-up (x3 and x1.5), on 4P+4D and 2P+6D under every disaggregated policy (``sim/policies/disagg.py``),
and on 8 aggregated workers under ``kvrouter``. Per run: TTFT p50/p90, ITL p50/p90, output tokens per
second, KV moved and the share prefilled locally. The reference here is ``dynamo_disagg``, Dynamo's routing
as its docs describe it, simulated on the same requests.

Goals (issue 35), each checked per (trace, speed-up, fleet) and printed PASS or FAIL (``--check``: exit 1
on a FAIL):

- ``kvrouter_disagg`` has the lowest TTFT p90 of the disaggregated policies;
- its ITL p90 is at or below the aggregated fleet's;
- on the conversation trace, it beats ``kvrouter_always_split`` on TTFT p90.

``--json FILE`` writes every run's figures, the goals, and ``ratios`` (above 1 when kvrouter is better,
each the lowest over the rows): ``ttft_p90_vs_dynamo_disagg`` (``dynamo_disagg``'s p90 ÷ kvrouter's) and
``itl_p90_vs_aggregated`` (the aggregated fleet's ITL p90 ÷ kvrouter's). ``--write-doc`` puts the table in
``docs/routing-benchmark.md`` between its ``bench_disagg`` markers. Runs are seeded and deterministic;
``--jobs`` spreads them over processes.
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
from typing import Any, Final

from bench_routing import TRACES

from kvrouter.sim.disagg import simulate_disagg
from kvrouter.sim.policies import make_policy
from kvrouter.sim.policies.disagg import DISAGG_POLICIES, make_disagg_policy
from kvrouter.sim.simulator import simulate
from kvrouter.sim.trace import load_trace

DOC: Final = Path(__file__).resolve().parents[1] / "docs" / "routing-benchmark.md"
BEGIN: Final = "<!-- bench_disagg: begin -->"
END: Final = "<!-- bench_disagg: end -->"
AGGREGATED: Final = "kvrouter"
FLEETS: Final = ((4, 4), (2, 6))
WORKERS: Final = 8


@dataclass(frozen=True, slots=True)
class Speed:
    trace: str
    speedup: float
    held_out: bool


SPEEDS: Final = (
    Speed("conversation", 4.0, False),
    Speed("conversation", 3.0, True),
    Speed("synthetic", 2.0, False),
    Speed("synthetic", 1.5, True),
)


@dataclass(frozen=True, slots=True)
class Job:
    speed: Speed
    fleet: tuple[int, int] | None
    """(prefill, decode) workers; None: ``WORKERS`` aggregated."""
    policy: str


def run_one(traces: Path, limit: int | None, job: Job) -> dict[str, Any]:
    """One simulation's figures."""
    speed = job.speed
    requests = load_trace(
        traces / f"mooncake_fast25_{speed.trace}_trace.jsonl", speedup=speed.speedup, limit=limit
    ).requests
    if job.fleet is None:
        result = simulate(requests, workers=WORKERS, policy=make_policy(job.policy))
        return {
            "ttft_p50_ms": result.ttft_p50_ms,
            "ttft_p90_ms": result.ttft_p90_ms,
            "itl_p50_ms": result.itl_p50_ms,
            "itl_p90_ms": result.itl_p90_ms,
            "hit_rate": result.hit_rate,
            "output_tokens_per_s": sum(r.output_tokens for r in requests) / (result.makespan_ms / 1000.0),
            "bytes_transferred": 0,
            "local_prefill_share": 1.0,
        }
    disagg = simulate_disagg(
        requests, prefill_workers=job.fleet[0], decode_workers=job.fleet[1], policy=make_disagg_policy(job.policy)
    )
    keep = (
        "ttft_p50_ms",
        "ttft_p90_ms",
        "itl_p50_ms",
        "itl_p90_ms",
        "hit_rate",
        "output_tokens_per_s",
        "bytes_transferred",
        "local_prefill_share",
    )
    figures = dataclasses.asdict(disagg)
    return {key: figures[key] for key in keep}


def fleet_name(fleet: tuple[int, int] | None) -> str:
    return f"{WORKERS} aggregated" if fleet is None else f"{fleet[0]}P+{fleet[1]}D"


def goals(
    speed: Speed, fleet: tuple[int, int], by: dict[str, dict[str, Any]], aggregated: dict[str, Any]
) -> list[tuple[str, bool]]:
    """The goals on one (trace, speed-up, fleet): (text, passed)."""
    kv = by["kvrouter_disagg"]
    others = {name: row for name, row in by.items() if name != "kvrouter_disagg"}
    best = min(others, key=lambda name: others[name]["ttft_p90_ms"])
    checked = [
        (
            f"TTFT p90 {kv['ttft_p90_ms']:.0f} ms lowest (next: {best} {others[best]['ttft_p90_ms']:.0f})",
            kv["ttft_p90_ms"] <= others[best]["ttft_p90_ms"],
        ),
        (
            f"ITL p90 {kv['itl_p90_ms']:.1f} ≤ aggregated {aggregated['itl_p90_ms']:.1f} ms",
            kv["itl_p90_ms"] <= aggregated["itl_p90_ms"],
        ),
    ]
    if speed.trace == "conversation":
        split = by["kvrouter_always_split"]["ttft_p90_ms"]
        checked.append((f"TTFT p90 below always-split's {split:.0f} ms", kv["ttft_p90_ms"] < split))
    return checked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel runs [default: CPUs]")
    parser.add_argument("--traces", type=Path, default=TRACES, metavar="DIR", help="folder of the Mooncake traces")
    parser.add_argument("--limit", type=int, metavar="N", help="only each trace's first N requests (a smoke run)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures, goals and ratios here")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal fails")
    parser.add_argument("--write-doc", action="store_true", help=f"put the table in {DOC.name}")
    args = parser.parse_args(argv)

    jobs = [
        Job(speed, fleet, policy)
        for speed in SPEEDS
        for fleet, policies in [*((f, tuple(DISAGG_POLICIES)) for f in FLEETS), (None, (AGGREGATED,))]
        for policy in policies
    ]
    started, load_before = time.perf_counter(), os.getloadavg()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(run_one, [args.traces] * len(jobs), [args.limit] * len(jobs), jobs))
    by = {(job.speed, job.fleet, job.policy): result for job, result in zip(jobs, results, strict=True)}

    lines = [
        "| trace | speed-up | fleet | policy | TTFT p50 / p90 ms | ITL p50 / p90 ms | output tok/s | KV moved GB "
        "| local |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows, checks, failed = [], [], 0
    ttft_ratios, itl_ratios = [], []
    for speed in SPEEDS:
        aggregated = by[(speed, None, AGGREGATED)]
        for fleet in (*FLEETS, None):
            for policy in DISAGG_POLICIES if fleet is not None else (AGGREGATED,):
                r = by[(speed, fleet, policy)]
                label = f"x{speed.speedup:g}" + (" (held out)" if speed.held_out else "")
                lines.append(
                    f"| {speed.trace} | {label} | {fleet_name(fleet)} | {policy} | "
                    f"{r['ttft_p50_ms']:,.0f} / {r['ttft_p90_ms']:,.0f} | "
                    f"{r['itl_p50_ms']:.1f} / {r['itl_p90_ms']:.1f} | "
                    f"{r['output_tokens_per_s']:,.0f} | {r['bytes_transferred'] / 1e9:,.0f} | "
                    f"{r['local_prefill_share']:.0%} |"
                )
                rows.append(
                    {
                        "trace": speed.trace,
                        "speedup": speed.speedup,
                        "held_out": speed.held_out,
                        "fleet": fleet_name(fleet),
                        "policy": policy,
                        **r,
                    }
                )
            if fleet is None:
                continue
            group = {policy: by[(speed, fleet, policy)] for policy in DISAGG_POLICIES}
            checked = goals(speed, fleet, group, aggregated)
            failed += sum(not ok for _, ok in checked)
            where = f"{speed.trace} x{speed.speedup:g} {fleet_name(fleet)}"
            checks += [{"where": where, "goal": text, "passed": ok} for text, ok in checked]
            kv = group["kvrouter_disagg"]
            ttft_ratios.append(group["dynamo_disagg"]["ttft_p90_ms"] / kv["ttft_p90_ms"])
            itl_ratios.append(aggregated["itl_p90_ms"] / kv["itl_p90_ms"])
    table = "\n".join(lines)
    print(table)
    print()
    for check in checks:
        print(f"{'PASS' if check['passed'] else 'FAIL'}  {check['where']}: {check['goal']}")
    ratios = {"ttft_p90_vs_dynamo_disagg": min(ttft_ratios), "itl_p90_vs_aggregated": min(itl_ratios)}
    machine = (
        f"{len(jobs)} runs in {time.perf_counter() - started:.1f} s wall on {args.jobs} job(s); load average "
        f"{[round(x, 2) for x in load_before]} before, {[round(x, 2) for x in os.getloadavg()]} after; "
        f"python {sys.version.split()[0]}"
    )
    print(
        f"\nratios (above 1: kvrouter better; the lowest over the rows): {ratios}\n{machine}; {failed} goal(s) failed"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"rows": rows, "goals": checks, "ratios": ratios, "failed": failed, "machine": machine}, indent=1
            )
        )
    if args.write_doc:
        text = DOC.read_text()
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        DOC.write_text(f"{head}{BEGIN}\n{table}\n\n{machine}\n{END}{tail}")
        print(f"wrote the table into {DOC}")
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
