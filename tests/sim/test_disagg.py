"""The disaggregated simulator (``sim/disagg.py``): the two hops and the transfer against a hand computation,
its bookings, and its policies on the packaged sample."""

from __future__ import annotations

import dataclasses

import pytest

from kvrouter.routing.disagg import Link
from kvrouter.sim.disagg import DisaggPolicy, Fleet, Plan, simulate_disagg
from kvrouter.sim.policies.disagg import DISAGG_POLICIES, KvrouterDisaggPolicy, make_disagg_policy
from kvrouter.sim.policy import Request
from kvrouter.sim.trace import load_sample
from kvrouter.worker import WorkerModel
from kvrouter.worker.timing import decode_ms, prefill_ms

LINK = Link(kv_bytes_per_token=131_072, gbps=25.0, gbps_local=200.0, overhead_ms=2.0)


class Fixed(DisaggPolicy):
    """Every request to the same plan; remembers what each decision saw."""

    name = "fixed"

    def __init__(self, plan: Plan) -> None:
        self.fixed = plan
        self.seen: list[dict[str, object]] = []

    def plan(self, request: Request, fleet: Fleet) -> Plan:
        self.seen.append(
            {
                "request": request.request_id,
                "decode_blocks": fleet.slots.active_blocks(self.fixed.decode),
                "prefill_tokens": fleet.slots.active_prefill_tokens((0, 0)),
                "overlap": dict(fleet.index.find_matches(request.local_hashes)),
            }
        )
        return self.fixed


def request(name: str, at_s: float, isl: int, osl: int, blocks: list[int]) -> Request:
    return Request(name, at_s, isl, osl, tuple(blocks))


def transfer_ms(tokens: int, *, local: bool = True) -> float:
    rate = 200e9 if local else 25e9
    return 2.0 + tokens * 131_072 * 8 / rate * 1e3


def test_a_split_request_is_prefill_then_transfer_then_the_decode_workers_tail():
    """1P+1D, a fresh 4-block prompt and 100 tokens more: the prefill worker computes it all, the decode worker
    pulls all of it, the partial block too, and prefills nothing: its first token is one decode step over the
    prompt's 5 blocks."""
    isl = 4 * 512 + 100
    result = simulate_disagg(
        [request("a", 0.0, isl, 4, [1, 2, 3, 4])],
        prefill_workers=1,
        decode_workers=1,
        policy=Fixed(Plan((1, 0), (0, 0))),
        link=LINK,
    )
    assert result.ttft_ms[0] == pytest.approx(prefill_ms(isl) + transfer_ms(isl) + decode_ms(5 / 2048))
    assert result.bytes_transferred == isl * 131_072
    assert result.local_prefill_share == 0.0
    assert result.hit_rate == 0.0  # the prefill hop found nothing cached; the pulled blocks are no hit


def test_a_second_request_pulls_only_what_the_decode_worker_lacks_and_across_domains_the_slow_link():
    """The decode worker keeps what it pulled (its prefix cache). With two domains, decode worker 1 of its pool
    (key 2) is in domain 1 and prefill worker 0 in domain 0: every transfer crosses the slow link."""
    first = request("a", 0.0, 4 * 512, 2, [1, 2, 3, 4])
    second = request("b", 5.0, 6 * 512, 2, [1, 2, 3, 4, 5, 6])
    policy = Fixed(Plan((2, 0), (0, 0)))  # decode worker 1 of its pool: domain 1 of 2
    result = simulate_disagg([first, second], prefill_workers=1, decode_workers=2, policy=policy, link=LINK, domains=2)
    assert result.bytes_transferred == (4 * 512 + 2 * 512) * 131_072
    # the second prefill reuses the prefill worker's 4 cached blocks and computes 2; its transfer is 2 blocks
    second_ttft = prefill_ms(2 * 512) + transfer_ms(2 * 512, local=False) + decode_ms(6 / 2048)
    assert result.ttft_ms[1] == pytest.approx(second_ttft)
    assert result.hit_rate == pytest.approx((4 * 512) / (10 * 512))
    # the router saw the pulled blocks on the decode worker: its index follows the decode worker's events
    assert policy.seen[1]["overlap"] == {(0, 0): 4, (2, 0): 4}


def test_a_split_request_is_booked_on_both_workers_and_everything_is_freed():
    policy = Fixed(Plan((1, 0), (0, 0)))
    requests = [request("a", 0.0, 8 * 512, 50, list(range(1, 9))), request("b", 0.001, 512, 1, [100])]
    simulate_disagg(requests, prefill_workers=1, decode_workers=1, policy=policy, link=LINK)
    # at "b"'s arrival, "a" is booked: its prefill on the prefill worker, its 8 blocks on the decode worker
    assert policy.seen[1]["prefill_tokens"] == 8 * 512
    assert policy.seen[1]["decode_blocks"] == 8


def test_a_local_request_never_moves_kv():
    result = simulate_disagg(
        [request("a", 0.0, 2 * 512, 3, [1, 2])],
        prefill_workers=1,
        decode_workers=1,
        policy=Fixed(Plan((1, 0), None, "short_prefill")),
        link=LINK,
    )
    assert result.ttft_ms[0] == pytest.approx(prefill_ms(2 * 512))
    assert (result.bytes_transferred, result.local_prefill_share) == (0, 1.0)


def test_a_plan_outside_its_pool_is_refused():
    with pytest.raises(ValueError, match="not a prefill and a decode worker"):
        simulate_disagg(
            [request("a", 0.0, 512, 1, [1])],
            prefill_workers=1,
            decode_workers=1,
            policy=Fixed(Plan((0, 0), (1, 0))),  # the pools swapped
        )


@pytest.fixture(scope="module")
def sample() -> tuple[Request, ...]:
    return load_sample(speedup=4.0, limit=300).requests


def test_fast_forward_changes_nothing(sample, monkeypatch):
    """A decode worker's skipped stretches stop for every transfer that may reach it, as steps would."""
    policy = "kvrouter_always_split"
    skipped = simulate_disagg(sample, prefill_workers=2, decode_workers=2, policy=make_disagg_policy(policy))
    monkeypatch.setattr(WorkerModel, "decode_only", lambda self: False)
    stepped = simulate_disagg(sample, prefill_workers=2, decode_workers=2, policy=make_disagg_policy(policy))
    assert skipped.ttft_ms == pytest.approx(stepped.ttft_ms, rel=1e-9)
    assert skipped.itl_p90_ms == pytest.approx(stepped.itl_p90_ms, rel=1e-9)
    assert skipped.bytes_transferred == stepped.bytes_transferred


@pytest.mark.parametrize("name", list(DISAGG_POLICIES))
def test_every_policy_serves_the_sample_the_same_way_twice(sample, name):
    runs = [
        simulate_disagg(sample, prefill_workers=2, decode_workers=2, policy=make_disagg_policy(name, seed=3), seed=3)
        for _ in range(2)
    ]
    first, again = (
        {k: v for k, v in dataclasses.asdict(run).items() if not k.startswith("decision_us")} for run in runs
    )
    assert first == again
    result = runs[0]
    assert result.requests == len(sample)
    assert result.output_tokens_per_s > 0
    assert (result.local_prefill_share > 0) is (name == "kvrouter_disagg")  # conversations reuse their turns
    assert result.bytes_transferred > 0


def test_the_conditional_policy_prefills_locally_what_its_decode_worker_holds():
    """A conversation's next turn, decoded where its last turn was: only the new turn is uncached there."""
    turn = request("a", 0.0, 8 * 512, 4, list(range(1, 9)))
    nxt = request("b", 5.0, 8 * 512 + 300, 2000, list(range(1, 9)))  # 300 new tokens: under 512; long answer
    fresh = request("c", 10.0, 8 * 512, 4, list(range(50, 58)))
    plans: list[Plan] = []

    class Recorded(KvrouterDisaggPolicy):
        def plan(self, request: Request, fleet: Fleet) -> Plan:
            plans.append(super().plan(request, fleet))
            return plans[-1]

    policy = Recorded()
    simulate_disagg([turn, nxt, fresh], prefill_workers=2, decode_workers=2, policy=policy)
    assert plans[0].prefill is not None  # fresh 4k prompt on an idle fleet: split
    assert (plans[1].prefill, plans[1].decode) == (None, plans[0].decode)
    assert str(plans[1].reason).startswith("short_prefill: 300 uncached tokens")
    assert plans[2].prefill is not None
    assert plans[2].decode != plans[0].decode  # the idle decode worker: "b" is decoding on the other
