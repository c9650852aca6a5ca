"""``ServiceCounters`` across fronts: what one front publishes, another decodes and adds, exactly."""

from __future__ import annotations

import orjson
import pytest

from kvrouter.service.core.counters import ServiceCounters
from kvrouter.service.core.histogram import Buckets


def sample(scale: int) -> ServiceCounters:
    counters = ServiceCounters()
    counters.decisions = 3 * scale
    counters.reservations = scale
    counters.selections = {(1, 0): 2 * scale, (2, 1): scale}
    counters.overlap_blocks, counters.prompt_blocks = 40 * scale, 64 * scale
    counters.overloaded, counters.no_worker, counters.expired_reservations = scale, 2 * scale, 3 * scale
    counters.connections, counters.handovers = 5 * scale, scale
    for i in range(3 * scale):
        counters.decision.observe(1e-5 * (i + 1))
        counters.hit_rate.observe(0.5)
        counters.phases["parse"].observe(3e-5)
    counters.http_requests = {("/select", "POST"): 3 * scale}
    counters.http_errors = {("/select", "4xx"): scale}
    counters.http_seconds = {("/select", "POST"): 0.25 * scale}
    return counters


def test_wire_round_trip_and_sum() -> None:
    one, two = sample(1), sample(2)
    back = ServiceCounters.from_wire(orjson.loads(orjson.dumps(two.to_wire())))
    assert back.to_wire() == two.to_wire()
    total = ServiceCounters()
    total.add(one)
    total.add(back)
    assert total.decisions == 9
    assert total.selections == {(1, 0): 6, (2, 1): 3}
    assert (total.overloaded, total.no_worker, total.expired_reservations) == (3, 6, 9)
    assert (total.connections, total.handovers) == (15, 3)
    assert total.decision.count == 9
    assert total.decision.counts == [a + b for a, b in zip(one.decision.counts, two.decision.counts, strict=True)]
    assert total.hit_rate.cumulative()[-1] == ("+Inf", 9.0)
    assert total.phases["parse"].count == 9
    assert total.phases["hash"].count == 0
    assert total.http_requests == {("/select", "POST"): 9}
    assert total.http_seconds == {("/select", "POST"): 0.75}


def test_mismatched_histograms_are_refused() -> None:
    with pytest.raises(ValueError, match="different bounds"):
        Buckets((1.0, 2.0)).add(Buckets((1.0, 3.0)))
    with pytest.raises(ValueError, match="counts"):
        Buckets.from_wire([[1, 2], 3, 0.5])
    with pytest.raises(KeyError):
        ServiceCounters.from_wire({"decisions": 1})
