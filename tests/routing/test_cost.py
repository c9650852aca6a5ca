from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from kvrouter.routing import Load, Overlap, RouterConfig, worker_cost

B = 16


def _cost(
    config: RouterConfig | None = None,
    *,
    isl: int = 10 * B,
    overlap: Overlap | None = None,
    load: Load | None = None,
    least: int = 0,
) -> float:
    return worker_cost(
        config or RouterConfig(),
        isl_tokens=isl,
        block_size=B,
        overlap=overlap or Overlap(),
        load=load or Load(),
        min_active_prefill_tokens=least,
    ).total


def test_worked_example_of_the_spec():
    """spec/dynamo-semantics.md §4.2a: raw prefill 10 blocks everywhere, costs 18 / 10 / 11."""
    rows = {1: (2, 10), 2: (5, 5), 3: (8, 9)}
    costs = {
        w: worker_cost(
            RouterConfig(),
            isl_tokens=10 * B,
            block_size=B,
            overlap=Overlap(device=dev),
            load=Load(potential_decode_blocks=dec),
            min_active_prefill_tokens=0,
        )
        for w, (dev, dec) in rows.items()
    }
    assert {w: c.total for w, c in costs.items()} == {1: 18, 2: 10, 3: 11}
    assert {w: c.adjusted_prefill_blocks for w, c in costs.items()} == {1: 8, 2: 5, 3: 2}
    assert min(costs, key=lambda w: costs[w].total) == 2


def test_more_device_overlap_costs_less():
    assert _cost(overlap=Overlap(device=4)) < _cost(overlap=Overlap(device=2))


def test_credit_scales_the_device_overlap():
    assert _cost(RouterConfig(overlap_score_credit=0.5), overlap=Overlap(device=4)) == 10 - 2
    assert _cost(RouterConfig(overlap_score_credit=0.0), overlap=Overlap(device=4)) == 10


def test_queued_prefill_costs_more():
    assert _cost(load=Load(active_prefill_tokens=4 * B)) == 14
    assert _cost(RouterConfig(router_track_prefill_tokens=False), load=Load(active_prefill_tokens=4 * B)) == 0


def test_lower_tiers_are_credited_only_for_what_they_add():
    overlap = Overlap(device=2, host=6, disk=8, shared=9)
    config = RouterConfig(shared_cache_type="hicache")
    expected = 10 - (2 + 0.75 * 4 + 0.25 * 2 + 0.5 * 1)
    assert _cost(config, overlap=overlap) == pytest.approx(expected)


def test_prefill_load_scale_multiplies_only_the_prefill_term():
    load = Load(potential_decode_blocks=3)
    assert _cost(RouterConfig(prefill_load_scale=2.0), overlap=Overlap(device=4), load=load) == 2 * 6 + 3


def test_decode_blocks_and_active_requests_add():
    assert _cost(load=Load(potential_decode_blocks=7)) == 17
    assert _cost(RouterConfig(decode_active_request_weight=1.5), load=Load(active_requests=4)) == 16


def test_credit_decay_shrinks_the_credit_of_workers_with_more_queued_prefill():
    config = RouterConfig(overlap_score_credit_decay=1.0)
    busy = Load(active_prefill_tokens=10 * B)
    # decay = 1 / (1 + 1 * (10B - 0) / B / 10) = 1/2: half of the 6 device blocks are credited.
    assert _cost(config, overlap=Overlap(device=6), load=busy) == 20 - 3
    assert _cost(config, overlap=Overlap(device=6), load=busy, least=10 * B) == 20 - 6


def test_adjusted_prefill_is_clamped_at_zero():
    cost = worker_cost(
        RouterConfig(overlap_score_credit=3.0),
        isl_tokens=4 * B,
        block_size=B,
        overlap=Overlap(device=4),
        load=Load(potential_decode_blocks=1),
        min_active_prefill_tokens=0,
    )
    assert cost.adjusted_prefill_blocks == 0
    assert cost.total == 1


weights = st.floats(0, 4, allow_nan=False)


@given(
    credit=weights,
    decay=weights,
    scale=weights,
    host=weights,
    disk=weights,
    request=weights,
    isl=st.integers(0, 4096),
    active=st.integers(0, 8192),
    least=st.integers(0, 8192),
    tiers=st.lists(st.integers(0, 300), min_size=4, max_size=4).map(sorted),
    decode=st.integers(0, 1000),
    requests=st.integers(0, 50),
)
def test_costs_are_never_negative(
    credit, decay, scale, host, disk, request, isl, active, least, tiers, decode, requests
):
    config = RouterConfig(
        overlap_score_credit=credit,
        overlap_score_credit_decay=decay,
        prefill_load_scale=scale,
        host_cache_hit_weight=host,
        disk_cache_hit_weight=disk,
        decode_active_request_weight=request,
        shared_cache_type="hicache",
    )
    cost = worker_cost(
        config,
        isl_tokens=isl,
        block_size=B,
        overlap=Overlap(*tiers),
        load=Load(active, decode, requests),
        min_active_prefill_tokens=min(least, active),
    )
    assert cost.adjusted_prefill_blocks >= 0
    assert cost.total >= 0
    assert cost.total == pytest.approx(cost.prefill_cost + cost.decode_blocks + cost.request_cost)


def test_lmetric_selection_multiplies_uncached_prefill_by_the_batch():
    config = RouterConfig(router_selection_policy="lmetric")
    cost = worker_cost(
        config,
        isl_tokens=10 * B,
        block_size=B,
        overlap=Overlap(device=4),
        load=Load(potential_decode_blocks=9),
        min_active_prefill_tokens=0,
    )
    assert (cost.adjusted_prefill_blocks, cost.decode_blocks) == (6, 9)
    assert cost.total == 6 * (9 + 1)


def _work(config: RouterConfig, recent: float, mean: float, **load: int) -> tuple[float, float]:
    cost = worker_cost(
        config,
        isl_tokens=10 * B,
        block_size=B,
        overlap=Overlap(device=4),
        load=Load(recent_prefill_tokens=recent, **load),
        min_active_prefill_tokens=0,
        mean_recent_prefill_tokens=mean,
    )
    return cost.total, cost.work_factor


def test_prefill_work_weight_off_leaves_the_reference_cost():
    assert _work(RouterConfig(), 300.0, 100.0, potential_decode_blocks=10) == (16.0, 1.0)  # 10 - 4 + 10


@pytest.mark.parametrize("policy", ["default", "lmetric"])
def test_prefill_work_scales_the_total_by_the_share_of_recent_work(policy: str):
    plain = RouterConfig(router_selection_policy=policy)  # type: ignore[arg-type]
    base, _ = _work(plain, 0.0, 0.0, potential_decode_blocks=10)
    config = RouterConfig(router_selection_policy=policy, prefill_work_weight=1.0)  # type: ignore[arg-type]
    # the share of the mean plus the request's own 160 tokens: (230 - 100) / 260 = 0.5
    assert _work(config, 230.0, 100.0, potential_decode_blocks=10) == (1.5 * base, 1.5)
    assert _work(config, 20.0, 200.0, potential_decode_blocks=10) == (0.5 * base, 0.5)  # -180 / 360
    assert _work(config, 500.0, 0.0, potential_decode_blocks=10) == (base, 1.0)  # no recent work anywhere
    half = RouterConfig(router_selection_policy=policy, prefill_work_weight=0.5)  # type: ignore[arg-type]
    assert _work(half, 620.0, 100.0, potential_decode_blocks=10)[1] == 2.0  # 1 + 0.5 * 2
    heavy = RouterConfig(router_selection_policy=policy, prefill_work_weight=3.0)  # type: ignore[arg-type]
    assert _work(heavy, 0.0, 100.0, potential_decode_blocks=10) == (0.0, 0.0)  # floored at 0, never negative
