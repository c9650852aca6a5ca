"""The predicted tier in the simulator, end to end on a short fan-out trace: with it a burst's requests find
each other's blocks in flight and stay together; without it (the same config, ``predicted_credit=0``) they
scatter and compute the shared context again. The grid's full figures are ``tools/bench_routing.py``'s."""

from __future__ import annotations

from dataclasses import replace

from kvrouter.routing.config import KVROUTER_CONFIG
from kvrouter.sim.policies import make_policy
from kvrouter.sim.simulator import simulate
from kvrouter.sim.workloads import FanoutOptions, generate


def test_a_fan_out_burst_stays_together_with_the_predicted_tier():
    requests = generate("fanout", FanoutOptions(requests=400), speedup=15).requests
    with_tier, without = (
        simulate(requests, workers=8, policy=make_policy("kvrouter", config=config, seed=0), seed=0)
        for config in (KVROUTER_CONFIG, replace(KVROUTER_CONFIG, predicted_credit=0.0))
    )
    assert with_tier.hit_rate > without.hit_rate + 0.15
    assert with_tier.ttft_p90_ms < without.ttft_p90_ms
