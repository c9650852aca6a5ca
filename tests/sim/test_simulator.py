"""``kvrouter.sim.simulator`` and ``kvrouter.sim.metrics``: determinism, the request lifecycle as the router
sees it, event lag, fast-forward exactness, and the metric definitions."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvrouter.events.model import WorkerKey
from kvrouter.sim.metrics import RunResult, imbalance, percentile, weighted_percentile
from kvrouter.sim.policy import Cluster, Policy, Request
from kvrouter.sim.simulator import simulate
from kvrouter.sim.trace import load_sample
from kvrouter.worker import WorkerModel
from kvrouter.worker.timing import prefill_ms

WALL_CLOCK_FIELDS = {"decision_us_p50", "decision_us_p99"}


class Cycle(Policy):
    name = "cycle"

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
        self.turn += 1
        return cluster.workers[(self.turn - 1) % len(cluster.workers)]


class Uniform(Policy):
    name = "uniform"

    def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
        return cluster.rng.choice(cluster.workers)


class Recorder(Cycle):
    """Round robin that writes down what it saw at each decision and completion."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, dict[str, object]] = {}
        self.done: list[tuple[str, WorkerKey, float]] = []

    def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
        worker = (0, 0)
        self.seen[request.request_id] = {
            "now": cluster.now,
            "overlap": cluster.index.find_matches(request.local_hashes).get(worker, 0),
            "requests": cluster.slots.active_requests(worker),
            "prefill": cluster.slots.active_prefill_tokens(worker),
        }
        return worker

    def finished(self, request: Request, worker: WorkerKey, cluster: Cluster) -> None:
        self.done.append((request.request_id, worker, cluster.now))


def request(name: str, at_s: float, isl: int, osl: int, blocks: list[int]) -> Request:
    return Request(name, at_s, isl, osl, tuple(blocks))


@pytest.fixture(scope="module")
def sample() -> tuple[Request, ...]:
    return load_sample(speedup=2.0, limit=400).requests


def comparable(result: RunResult) -> dict[str, object]:
    return {k: v for k, v in dataclasses.asdict(result).items() if k not in WALL_CLOCK_FIELDS}


def test_a_seed_gives_the_same_run(sample):
    first = simulate(sample, workers=4, policy=Uniform(), seed=3)
    second = simulate(sample, workers=4, policy=Uniform(), seed=3)
    assert comparable(first) == comparable(second)
    other = simulate(sample, workers=4, policy=Uniform(), seed=4)
    assert other.requests_per_worker != first.requests_per_worker


def test_every_request_is_served(sample):
    result = simulate(sample, workers=4, policy=Cycle())
    assert result.requests == len(sample) == len(result.ttft_ms)
    assert result.requests_per_worker == (100, 100, 100, 100)
    assert result.request_imbalance == 1.0
    assert all(ttft > 0 for ttft in result.ttft_ms)
    assert 0 < result.hit_rate < 1
    assert result.ttft_p50_ms <= result.ttft_p90_ms <= result.ttft_p99_ms
    assert result.e2e_p99_ms > result.ttft_p99_ms
    assert result.itl_p50_ms >= 5.74  # the decode polynomial at zero usage
    # No lag, yet not 0: between routing and admission a queued request's worker may evict or store blocks.
    assert 0 <= result.overlap_mae_blocks < 0.1
    assert sum(result.prefill_tokens_per_worker) == pytest.approx(
        (1 - result.hit_rate) * sum(r.input_tokens for r in sample), rel=0.01
    )
    assert result.summary()["policy"] == "cycle"
    assert "ttft_ms" not in result.summary()


def test_a_lone_request_waits_only_for_its_prefill():
    result = simulate([request("r", 1.5, 16384, 3, list(range(32)))], workers=2, policy=Cycle())
    assert result.ttft_ms == pytest.approx((2 * prefill_ms(8192),))
    assert result.hit_rate == 0.0


def test_the_router_sees_prefill_first_token_and_completion():
    ttft_s = prefill_ms(4096) / 1000.0
    policy = Recorder()
    requests = [
        request("a", 0.0, 4096, 200, list(range(8))),
        request("b", ttft_s / 2, 600, 1, [100]),  # a is still prefilling
        request("c", ttft_s + 0.5, 600, 1, [200]),  # a is decoding
        request("d", 10.0, 600, 1, [300]),  # a is done
    ]
    simulate(requests, workers=1, policy=policy)
    seen = policy.seen
    assert (seen["b"]["requests"], seen["b"]["prefill"]) == (1, 4096)
    assert (seen["c"]["requests"], seen["c"]["prefill"]) == (1, 0)
    assert (seen["d"]["requests"], seen["d"]["prefill"]) == (0, 0)
    assert seen["c"]["now"] == pytest.approx(ttft_s + 0.5)
    assert [name for name, _, _ in policy.done] == ["b", "c", "a", "d"]
    assert {worker for _, worker, _ in policy.done} == {(0, 0)}


@pytest.mark.parametrize(("lag_ms", "overlap"), [(0.0, 4), (50.0, 0)])
def test_kv_events_reach_the_index_after_the_lag(lag_ms, overlap):
    first_done_s = prefill_ms(4 * 512) / 1000.0
    policy = Recorder()
    requests = [
        request("a", 0.0, 4 * 512, 1, [1, 2, 3, 4]),
        request("b", first_done_s + 0.010, 4 * 512, 1, [1, 2, 3, 4]),
    ]
    result = simulate(requests, workers=1, policy=policy, event_lag_ms=lag_ms)
    assert policy.seen["b"]["overlap"] == overlap
    assert result.hit_rate == 0.5  # the engine reuses all of it either way
    assert result.overlap_mae_blocks == (4 - overlap) / 2


def test_fast_forward_changes_nothing(sample, monkeypatch):
    requests = sample[:150]
    skipped = simulate(requests, workers=2, policy=Cycle())
    monkeypatch.setattr(WorkerModel, "decode_only", lambda self: False)
    stepped = simulate(requests, workers=2, policy=Cycle())
    assert skipped.hit_rate == stepped.hit_rate
    assert skipped.requests_per_worker == stepped.requests_per_worker
    assert skipped.ttft_ms == pytest.approx(stepped.ttft_ms, rel=1e-9)
    assert skipped.itl_p50_ms == pytest.approx(stepped.itl_p50_ms, rel=1e-9)
    assert skipped.makespan_ms == pytest.approx(stepped.makespan_ms, rel=1e-9)


def test_a_worker_outside_the_fleet_is_refused():
    class Stray(Policy):
        name = "stray"

        def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
            return (5, 0)

    with pytest.raises(ValueError, match="not one of the 2 workers"):
        simulate([request("r", 0.0, 600, 1, [1])], workers=2, policy=Stray())


def test_bad_runs_are_refused():
    twice = [request("r", 0.0, 600, 1, [1]), request("r", 1.0, 600, 1, [1])]
    with pytest.raises(ValueError, match="unique"):
        simulate(twice, workers=1, policy=Cycle())
    with pytest.raises(ValueError, match="workers"):
        simulate([], workers=0, policy=Cycle())
    with pytest.raises(ValueError, match="event_lag_ms"):
        simulate([], workers=1, policy=Cycle(), event_lag_ms=-1.0)


# -- metrics ------------------------------------------------------------------------------------


def test_percentiles_are_numpys_linear_definition():
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([10.0, 20.0, 30.0, 40.0, 50.0], 90) == 46.0
    assert math.isnan(percentile([], 50))


def test_weighted_percentile_counts_each_value_weight_times():
    assert weighted_percentile([5.0, 1.0, 3.0], [1, 1, 1], 50) == 3.0
    assert weighted_percentile([5.0, 1.0], [1, 3], 50) == 1.0
    assert weighted_percentile([5.0, 1.0], [3, 1], 50) == 5.0
    assert math.isnan(weighted_percentile([1.0], [0], 50))


def test_imbalance_is_max_over_mean():
    assert imbalance([1, 1, 2]) == pytest.approx(1.5)
    assert imbalance([0, 0]) == 1.0
