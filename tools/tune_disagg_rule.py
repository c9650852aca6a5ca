"""The defaults of the conditional rule, measured: ``kvrouter_disagg`` under pairs of its two thresholds.

    python tools/tune_disagg_rule.py [--jobs N] [--limit N] [--json FILE]

Issue 35 lets the defaults of ``--disagg-max-local-prefill-tokens`` and ``--disagg-prefill-busy-tokens``
move after measuring them in the simulator, and asks that they be checked on workloads outside the grid.
This runs ``kvrouter_disagg`` (``sim/policies/disagg.py``) with each pair of :data:`PAIRS` on every run of
:data:`RUNS`: first the four of ``tools/bench_disagg.py``'s grid (both traces at their 8-worker speed-up,
4P+4D and 2P+6D), then runs the choice was not made on (other fleets, other speed-ups, the later part of a
trace). Per run and pair it prints TTFT p90 ms / ITL p90 ms / the share prefilled locally, as the table of
``docs/routing-benchmark.md`` ("Choosing the rule's defaults"). There is no reference column: the
reference's ``dynamo_disagg`` always splits; ``tools/bench_disagg.py`` compares with it.

Runs are seeded and deterministic; ``--jobs`` spreads them over processes; ``--limit`` replays that many
requests per run (the tests' short version).
"""

from __future__ import annotations

import argparse
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
from kvrouter.sim.policies.disagg import make_disagg_policy
from kvrouter.sim.trace import load_trace


@dataclass(frozen=True, slots=True)
class Run:
    trace: str
    speedup: float
    prefill: int
    decode: int
    first: int = 0
    """The first request of the trace replayed (0: from the start)."""
    held_out: bool = False

    @property
    def name(self) -> str:
        part = f", requests {self.first + 1:,}-" if self.first else ""
        out = " (held out)" if self.held_out else ""
        return f"{self.trace[0].upper()} x{self.speedup:g} {self.prefill}P+{self.decode}D{part}{out}"


RUNS: Final = (
    Run("conversation", 4.0, 4, 4),
    Run("conversation", 4.0, 2, 6),
    Run("synthetic", 2.0, 4, 4),
    Run("synthetic", 2.0, 2, 6),
    Run("conversation", 3.0, 3, 5, held_out=True),
    Run("conversation", 5.0, 6, 2, held_out=True),
    Run("synthetic", 1.5, 3, 5, held_out=True),
    Run("synthetic", 3.0, 5, 3, held_out=True),
    Run("conversation", 4.0, 4, 4, first=6000, held_out=True),
    Run("synthetic", 2.0, 2, 6, first=2000, held_out=True),
)
"""The grid of ``tools/bench_disagg.py`` first, then runs outside it."""

PAIRS: Final = ((512, None), (2048, None), (2048, 16384), (512, 16384))
"""(``--disagg-max-local-prefill-tokens``, ``--disagg-prefill-busy-tokens``; None: off)."""


def run_one(traces: Path, limit: int | None, run: Run, pair: tuple[int, int | None]) -> dict[str, Any]:
    requests = load_trace(traces / f"mooncake_fast25_{run.trace}_trace.jsonl", speedup=run.speedup).requests
    requests = requests[run.first :] if limit is None else requests[run.first : run.first + limit]
    policy = make_disagg_policy("kvrouter_disagg", max_local_prefill_tokens=pair[0], prefill_busy_tokens=pair[1])
    result = simulate_disagg(requests, prefill_workers=run.prefill, decode_workers=run.decode, policy=policy)
    return {
        "run": run.name,
        "max_local_prefill_tokens": pair[0],
        "prefill_busy_tokens": pair[1],
        "ttft_p90_ms": result.ttft_p90_ms,
        "itl_p90_ms": result.itl_p90_ms,
        "local_prefill_share": result.local_prefill_share,
    }


def _pair_name(pair: tuple[int, int | None]) -> str:
    return f"{pair[0]:,}, {'off' if pair[1] is None else f'{pair[1]:,}'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=TRACES, metavar="DIR", help="folder of the Mooncake traces")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes (default: 2)")
    parser.add_argument("--limit", type=int, metavar="N", help="requests per run (default: the whole trace)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every run's figures here")
    args = parser.parse_args(argv)
    started, load_before = time.perf_counter(), os.getloadavg()
    work = [(run, pair) for run in RUNS for pair in PAIRS]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(run_one, [args.traces] * len(work), [args.limit] * len(work), *zip(*work, strict=True)))
    print("| run | " + " | ".join(_pair_name(pair) for pair in PAIRS) + " |")
    print("|---" * (len(PAIRS) + 1) + "|")
    for i, run in enumerate(RUNS):
        cells = [
            f"{row['ttft_p90_ms']:,.0f} / {row['itl_p90_ms']:.3g} / {row['local_prefill_share']:.0%}"
            for row in rows[i * len(PAIRS) : (i + 1) * len(PAIRS)]
        ]
        print(f"| {run.name} | " + " | ".join(cells) + " |")
    wall = time.perf_counter() - started
    print(
        f"\n{len(rows)} runs in {wall:.1f} s wall on {args.jobs} job(s); load average "
        f"{[round(x, 2) for x in load_before]} before, {[round(x, 2) for x in os.getloadavg()]} after; "
        f"python {sys.version.split()[0]}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
