"""The routing benchmark's must-bars (``spec/routing-benchmark.md`` §7), checked on the full traces in the
same simulation as round robin: kvrouter's hit-rate multiples, its TTFT p90/p99 ratios against the
reference policy's, its uncached-prefill imbalance; ``dynamo_t0`` against the mocker's ``kv_default``
anchor; and the negative control, ``greedy_overlap``, collapsing on the conversation trace.

Runtime: about 25 s on a 2-core machine (three or four policies on each of the four workloads).
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
    "C4": ("conversation", 4, 2.0),
    "C8": ("conversation", 8, 4.0),
    "S4": ("synthetic", 4, 1.0),
    "S8": ("synthetic", 8, 2.0),
}
HIT_MULTIPLE = {"C4": 1.45, "C8": 2.0, "S4": 2.5, "S8": 3.9}
KV_DEFAULT_HIT = {"C4": 0.123, "C8": 0.169, "S4": 0.314, "S8": 0.458}
"""The mocker's kv_default hit rates (§6.1), which ``dynamo_t0`` must land within 0.01 of."""


@cache
def run(workload: str, policy: str) -> RunResult:
    trace, workers, speedup = WORKLOADS[workload]
    requests = load_trace(TRACES / f"mooncake_fast25_{trace}_trace.jsonl", speedup=speedup).requests
    return simulate(requests, workers=workers, policy=make_policy(policy, seed=0), seed=0)


@pytest.fixture(autouse=True)
def _traces() -> None:
    if not TRACES.is_dir():
        pytest.skip(f"traces not found at {TRACES}")


@pytest.mark.parametrize("workload", WORKLOADS)
def test_kvrouter_keeps_the_must_bars(workload: str):
    rr, reference, ours = (run(workload, p) for p in ("round_robin", "dynamo_t0", "kvrouter"))
    assert ours.hit_rate >= HIT_MULTIPLE[workload] * rr.hit_rate
    assert ours.ttft_p90_ms / rr.ttft_p90_ms <= reference.ttft_p90_ms / rr.ttft_p90_ms + 0.05
    assert ours.ttft_p99_ms / rr.ttft_p99_ms <= reference.ttft_p99_ms / rr.ttft_p99_ms + 0.05
    assert ours.prefill_imbalance <= 1.10


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_reference_policy_lands_on_the_mockers_anchor(workload: str):
    assert run(workload, "dynamo_t0").hit_rate == pytest.approx(KV_DEFAULT_HIT[workload], abs=0.01)


@pytest.mark.parametrize("workload", ["C4", "C8"])
def test_greedy_overlap_collapses_on_conversation(workload: str):
    greedy, rr = run(workload, "greedy_overlap"), run(workload, "round_robin")
    workers = WORKLOADS[workload][1]
    assert greedy.prefill_imbalance > 0.9 * workers  # everything on one worker
    assert greedy.ttft_p50_ms > 10 * rr.ttft_p50_ms
