"""The two choices of a split request and the conditional rule (``routing/disagg.py``), by hand, and
``select_split`` on a small fleet."""

from __future__ import annotations

from typing import Any

import pytest

from kvrouter.events.model import EngineHash, LocalHash, Stored, StoredBlock
from kvrouter.hashing import sequence_hashes
from kvrouter.index import RadixIndex
from kvrouter.routing import Router, SlotManager
from kvrouter.routing.config import KVROUTER_CONFIG
from kvrouter.routing.disagg import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    SAME_WORKER,
    Link,
    Split,
    choose_decode,
    decode_costs,
    local_prefill_reason,
    router_select,
    select_split,
)


def test_the_default_bytes_per_token_are_a_llama_3_8b_shape():
    assert DEFAULT_KV_BYTES_PER_TOKEN == 32 * 8 * 128 * 2 * 2


def test_a_transfer_is_its_fixed_cost_then_bytes_over_the_link():
    link = Link(kv_bytes_per_token=1000, gbps=10.0, gbps_local=80.0, overhead_ms=1.5)
    assert link.bytes(2500) == 2_500_000
    assert link.ms(2500, local=True) == pytest.approx(1.5 + 2_500_000 * 8 / 80e9 * 1e3)  # 0.25 ms
    assert link.ms(2500, local=False) == pytest.approx(1.5 + 2.0)
    assert link.ms(0, local=False) == 0.0  # nothing to move: no transfer at all
    assert (link.factor(True), link.factor(False)) == (1.0, 8.0)


@pytest.mark.parametrize("bad", [{"gbps": 0.0}, {"gbps_local": -1.0}, {"kv_bytes_per_token": 0}, {"overhead_ms": -0.1}])
def test_a_link_refuses_what_has_no_meaning(bad):
    with pytest.raises(ValueError, match="must be"):
        Link(**bad)


def test_the_decode_cost_is_load_plus_the_missing_blocks_times_the_link():
    """Three decode workers for a 10-block prompt from a prefill worker in domain 0."""
    a, b, c = (10, 0), (11, 0), (12, 0)
    costs = decode_costs(
        [a, b, c],
        10,
        overlaps={a: 0, b: 6, c: 10},
        loads={a: 5, b: 20, c: 40},
        factors={a: 1.0, b: 1.0, c: 8.0},
    )
    assert costs == [5 + 10 * 1.0, 20 + 4 * 1.0, 40 + 0 * 8.0]
    assert choose_decode(costs, [a, b, c]) == a
    # across a slow link the missing blocks weigh 8 times: a worker holding the prompt wins
    costs = decode_costs([a, c], 10, overlaps={c: 10}, loads={a: 5, c: 40}, factors={a: 8.0, c: 8.0})
    assert costs == [85.0, 40.0]
    assert choose_decode(costs, [a, c]) == c


def test_equal_decode_costs_go_to_the_first_worker():
    a, b = (1, 0), (2, 0)
    assert choose_decode(decode_costs([a, b], 4, {}, {}, {}), [a, b]) == a


@pytest.mark.parametrize(
    ("uncached", "queued", "busy", "local"),
    [
        (2048, [0], None, "short_prefill"),  # at the default bound: local
        (2049, [0], None, None),  # past it: split
        (0, [10**9], None, "short_prefill"),  # all cached on the decode worker
        (4096, [0, 0], None, None),  # a fresh 4k prompt on an idle fleet splits under the defaults
        (4096, [5000, 6000], 4000, "prefill_busy"),  # every prefill worker past the bound
        (4096, [5000, 4000], 4000, None),  # one at it: not every one is busy
        (4096, [10**9], None, None),  # the busy rule is off by default
        (4096, [], 0, None),  # no prefill worker to call busy
    ],
)
def test_the_edges_of_the_conditional_rule(uncached, queued, busy, local):
    reason = local_prefill_reason(uncached, queued, prefill_busy_tokens=busy)
    assert (reason.split(":")[0] if reason else None) == local


def stored(worker: int, blocks: list[int]) -> Stored:
    return Stored(worker, None, tuple(StoredBlock(EngineHash(b), LocalHash(b)) for b in blocks), dp_rank=0, event_id=0)


def test_select_split_makes_both_choices_as_the_rules_say():
    """Prefill workers 0 and 1, decode workers 2 and 3, a 10-block prompt of 512-token blocks. Worker 1 holds 6
    blocks of it, decode worker 3 holds 4 but carries 12 blocks of load; decode worker 2 is idle."""
    prompt = list(range(1, 11))
    index = RadixIndex()
    index.apply_event(1, stored(1, prompt[:6]))
    index.apply_event(3, stored(3, prompt[:4]))
    slots = SlotManager(block_size=512)
    slots.add_request("busy", (3, 0), sequence_hashes(list(range(100, 112))), 12 * 512, 12)
    router = Router(KVROUTER_CONFIG, block_size=512, slots=slots, seed=0)
    prefill, decode = [(0, 0), (1, 0)], [(2, 0), (3, 0)]

    def split_of(hashes: list[int], isl: int, factor: Any, book: str | None = None) -> Split:
        select = router_select(router, index, hashes, isl)
        return select_split(
            select, index, slots, 512, prefill, decode, local_hashes=hashes, isl_tokens=isl, factor=factor, book=book
        )

    split = split_of(prompt, 10 * 512, lambda p, d: 1.0)
    assert split.prefill is not None
    assert split.prefill.worker == (1, 0)  # the most overlap among idle prefill workers
    assert split.decode_costs == (((2, 0), 0 + 10 * 1.0), ((3, 0), 12 + 6 * 1.0))
    assert split.decode.worker == (2, 0)
    assert split.reason is None  # 5,120 uncached tokens on worker 2: split

    # across a slow link from worker 1 (factor 8 to worker 2), the 4 blocks worker 3 holds pay for its load
    split = split_of(prompt, 10 * 512, lambda p, d: 8.0 if d == (2, 0) else 1.0)
    assert split.decode_costs == (((2, 0), 80.0), ((3, 0), 18.0))
    assert (split.decode.worker, split.decode.overlap_blocks) == ((3, 0), 4)

    # a decode worker lacking at most the bound prefills locally: no prefill selection
    split = split_of(prompt[:4], 4 * 512 + 100, lambda p, d: 8.0)
    assert split.prefill is None
    assert split.decode.worker == (3, 0)
    assert str(split.reason).startswith("short_prefill: 100 uncached tokens")
    assert slots.active_requests((2, 0)) == slots.active_requests((1, 0)) == 0  # books nothing

    # booked: a split request's prefill on its prefill worker, the request on its decode worker
    split = split_of(prompt, 10 * 512, lambda p, d: 1.0, book="r1")
    assert split.prefill is not None
    assert slots.booked("r1#prefill").worker == split.prefill.worker == (1, 0)  # type: ignore[union-attr]
    assert slots.booked("r1").worker == split.decode.worker == (2, 0)  # type: ignore[union-attr]
    # a worker of role both chosen for both hops: nothing to transfer, so it is not split
    both = [(2, 0)]
    same = select_split(
        router_select(router, index, prompt, 10 * 512), index, slots, 512, both, both,
        local_hashes=prompt, isl_tokens=10 * 512, factor=lambda p, d: 1.0,
    )  # fmt: skip
    assert (same.prefill, same.decode.worker, same.reason) == (None, (2, 0), SAME_WORKER)
    lone = select_split(
        router_select(router, index, prompt, 10 * 512), index, slots, 512, [], decode,
        local_hashes=prompt, isl_tokens=10 * 512, factor=lambda p, d: 1.0,
    )  # fmt: skip
    assert (lone.prefill, lone.reason) == (None, "no_prefill_worker: no schedulable worker of role prefill or both")
