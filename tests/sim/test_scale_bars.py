"""Issue 10's bars at 16 workers, where ``KVROUTER_CONFIG`` used to lose balance: kvrouter's
uncached-prefill imbalance at most 1.10, its hit rate at least ``dynamo_t0``'s and its TTFT p90 below it.

Workloads are the grid's C16 and S16 (``tools/bench_routing.py``: speed-up W / 2 and W / 4, the load per
worker of C4/C8 and S4/S8), both whole traces (without the recent-prefill term kvrouter's imbalance was
1.22 on the first 3,000 conversation requests and 1.21 on the synthetic trace). The conversation trace
used to be cut to its first 3,000 requests; on that cut the imbalance depends on the seed more than on
the policy (seeds 0-5 without the predicted tier: 1.065 to 1.141, four of six above 1.10), while on the
whole trace it stays within 1.04-1.09 on every seed, with or without the tier (with ``KVROUTER_CONFIG`` as
issue 34 left it, 1.047-1.075).

Runtime: about 20 s on a 2-core machine (two policies on each of two workloads).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from kvrouter.sim.metrics import RunResult
from kvrouter.sim.policies import make_policy
from kvrouter.sim.simulator import simulate
from kvrouter.sim.trace import load_trace

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
WORKLOADS = {
    "C16": ("conversation", 16, 8.0, None),
    "S16": ("synthetic", 16, 4.0, None),
}


@cache
def run(workload: str, policy: str) -> RunResult:
    trace, workers, speedup, limit = WORKLOADS[workload]
    requests = load_trace(TRACES / f"mooncake_fast25_{trace}_trace.jsonl", speedup=speedup, limit=limit).requests
    return simulate(requests, workers=workers, policy=make_policy(policy, seed=0), seed=0)


@pytest.fixture(autouse=True)
def _traces() -> None:
    if not TRACES.is_dir():
        pytest.skip(f"traces not found at {TRACES}")


@pytest.mark.parametrize("workload", WORKLOADS)
def test_kvrouter_keeps_balance_and_beats_the_reference_at_16_workers(workload: str):
    ours, reference = run(workload, "kvrouter"), run(workload, "dynamo_t0")
    assert ours.prefill_imbalance <= 1.10
    assert ours.hit_rate >= reference.hit_rate
    assert ours.ttft_p90_ms < reference.ttft_p90_ms
