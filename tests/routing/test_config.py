from __future__ import annotations

import inspect
from dataclasses import fields

import pytest
from dynamo._core import KvRouterConfig

from kvrouter.errors import ConfigError
from kvrouter.routing import RouterConfig


def test_defaults_match_the_reference_field_by_field():
    reference = inspect.signature(KvRouterConfig).parameters
    ours = {f.name: f.default for f in fields(RouterConfig)}
    shared = set(ours) & set(reference)
    assert len(shared) >= 13, sorted(shared)
    for name in sorted(shared):
        assert ours[name] == reference[name].default, name


def test_defaults_match_the_reference_getters():
    reference, ours = KvRouterConfig(), RouterConfig()
    for name in (
        "overlap_score_credit",
        "overlap_score_credit_decay",
        "prefill_load_scale",
        "decode_active_request_weight",
    ):
        assert getattr(ours, name) == getattr(reference, name), name


def test_named_defaults_from_the_spec():
    config = RouterConfig()
    assert (config.overlap_score_credit, config.prefill_load_scale) == (1.0, 1.0)
    assert (config.host_cache_hit_weight, config.disk_cache_hit_weight) == (0.75, 0.25)
    assert (config.router_temperature, config.router_ttl_secs) == (0.0, 120.0)


@pytest.mark.parametrize(
    "field",
    [
        "overlap_score_credit",
        "prefill_load_scale",
        "host_cache_hit_weight",
        "disk_cache_hit_weight",
        "router_temperature",
        "decode_active_request_weight",
        "overlap_score_credit_decay",
        "active_decode_blocks_threshold",
        "active_prefill_tokens_threshold",
        "shared_cache_multiplier",
    ],
)
@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf")])
def test_a_negative_or_non_finite_value_names_the_field(field: str, value: float):
    with pytest.raises(ConfigError, match=field):
        RouterConfig(**{field: value})  # type: ignore[arg-type]  # each field takes a float here


def test_ttl_must_be_positive_and_cache_type_known():
    with pytest.raises(ConfigError, match="router_ttl_secs"):
        RouterConfig(router_ttl_secs=0)
    with pytest.raises(ConfigError, match="shared_cache_type"):
        RouterConfig(shared_cache_type="redis")  # type: ignore[arg-type]


def test_shared_credit_defaults_only_when_a_shared_cache_is_on():
    assert RouterConfig().shared_credit == 0.0
    assert RouterConfig(shared_cache_type="hicache").shared_credit == 0.5
    assert RouterConfig(shared_cache_type="hicache", shared_cache_multiplier=0.2).shared_credit == 0.2


def test_selection_policy_is_default_or_lmetric():
    assert RouterConfig().router_selection_policy == "default"
    with pytest.raises(ConfigError, match="router_selection_policy"):
        RouterConfig(router_selection_policy="greedy")  # type: ignore[arg-type]
