"""The predicted tier, case by case and term by term: what the router has just sent counts until the
worker's events confirm it or the requests holding it leave (``kvrouter/routing/cost.py``).

Prompts are local hashes in blocks of ``B`` tokens; the leader's blocks are booked on ``W1`` as a routed
request is, and nothing reaches the index unless a case stores it (the events have not arrived)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvrouter.events.model import EngineHash, LocalHash, Stored, StoredBlock, WorkerKey
from kvrouter.hashing import sequence_hashes
from kvrouter.index import RadixIndex
from kvrouter.routing import Router, RouterConfig, WorkerExplanation
from kvrouter.routing.config import KVROUTER_CONFIG
from kvrouter.routing.cost import PREDICTED_IDLE_SHARE
from kvrouter.routing.router import SWEEP_INTERVAL_SECS
from tests.clock import FakeClock

B = 4
W1, W2, W3 = (1, 0), (2, 0), (3, 0)
PREFIX = list(range(1, 9))
"""A fresh 8-block prefix: the leader's, shared by every follower."""
ADDITIVE = RouterConfig(predicted_credit=2.0)
"""The reference's sum with the tier on, so each term is plain arithmetic."""
ONE_OF_THREE = 1 + (2 - 1) * (1 / 3 - PREDICTED_IDLE_SHARE) / (1 - PREDICTED_IDLE_SHARE)
"""``ADDITIVE``'s credit per predicted block when the router's first decision finds one eligible candidate
of three with prefill queued: its seen load is that share, 1/3."""


def _rows(router: Router, index: RadixIndex, local: list[int], workers: tuple[WorkerKey, ...] = (W1, W2, W3)):
    selection = router.select(index, workers, local_hashes=local, explain=True)
    assert selection.explanation is not None
    rows: dict[WorkerKey, WorkerExplanation] = {row.worker: row for row in selection.explanation}
    return selection, rows


def _book_leader(router: Router, *, tail: list[int] | None = None, done_blocks: int = 0) -> None:
    """The leader on W1, routed and not yet through its prefill (``done_blocks`` of it already computed)."""
    local = PREFIX + (tail or [])
    router.slots.add_request("leader", W1, sequence_hashes(local), len(local) * B, done_blocks)


def _store(index: RadixIndex, worker: WorkerKey, local: list[int]) -> None:
    blocks = tuple(StoredBlock(EngineHash(5000 + h), LocalHash(h)) for h in local)
    index.apply_event(worker[0], Stored(worker[0], None, blocks))


def test_a_follower_is_credited_the_leaders_blocks_in_flight_term_by_term():
    router, index = Router(ADDITIVE, block_size=B, seed=0), RadixIndex()
    _book_leader(router, tail=[100])  # 9 blocks, 36 tokens queued on W1
    selection, rows = _rows(router, index, [*PREFIX, 200])  # 9 blocks, 8 shared
    weight = ONE_OF_THREE
    one = rows[W1]
    assert (one.overlap.device, one.overlap.predicted) == (0, 8)
    assert one.cost.raw_prefill_blocks == (36 + 36) / B
    assert one.cost.predicted_credit_blocks == pytest.approx(weight * 8)
    assert one.cost.overlap_credit_blocks == pytest.approx(weight * 8)
    assert one.cost.adjusted_prefill_blocks == pytest.approx(18 - weight * 8)
    assert one.cost.decode_blocks == 9 + 9 - 8  # the shared blocks are held once
    assert one.cost.total == pytest.approx(18 - weight * 8 + 10)
    for idle in (W2, W3):
        assert (rows[idle].overlap.predicted, rows[idle].cost.predicted_credit_blocks) == (0, 0.0)
        assert rows[idle].cost.total == 9 + 9
    assert selection.worker == W1
    assert selection.predicted_blocks == 8
    assert selection.overlap_blocks == 0  # the device overlap, as the reference reports it


def test_without_the_tier_the_same_follower_goes_elsewhere():
    router, index = Router(replace(ADDITIVE, predicted_credit=0.0), block_size=B, seed=0), RadixIndex()
    _book_leader(router, tail=[100])
    selection, rows = _rows(router, index, [*PREFIX, 200])
    assert rows[W1].overlap.predicted == 0
    assert rows[W1].cost.total == 18 + 10
    assert selection.worker != W1


def test_a_follower_booked_on_the_leaders_worker_queues_only_its_own_blocks():
    router, index = Router(ADDITIVE, block_size=B, seed=0), RadixIndex()
    _book_leader(router, tail=[100])
    selection = router.select(index, (W1, W2, W3), local_hashes=[*PREFIX, 200], request_id="follower")
    assert selection.worker == W1
    assert router.slots.active_prefill_tokens(W1) == 36 + (9 - 8) * B  # the leader's, then one block
    assert router.slots.active_blocks(W1) == 10


def _steady(router: Router, workers: tuple[WorkerKey, ...], *, queued: bool) -> None:
    """A minute of equal work on every worker (the recent-work factor at 1), and with ``queued`` a request of
    its own prefilling on each."""
    for n, worker in enumerate(workers):
        router.slots.add_request(f"warm{n}", worker, sequence_hashes([9000 + n]), 2000 * B, 0)
        router.slots.free(f"warm{n}")
        if queued:
            own = [7000 + 100 * n + k for k in range(20)]
            router.slots.add_request(f"own{n}", worker, sequence_hashes(own), 20 * B, 0)


@pytest.mark.parametrize("queued", [True, False], ids=["busy fleet", "idle fleet"])
def test_a_burst_on_a_fresh_prefix_lands_together(queued: bool):
    """Five requests sharing a prefix nobody has computed, sent together. With every worker prefilling when
    the burst arrives, recomputing the prefix elsewhere delays what is queued there, and the burst stays on
    the leader's worker. On an idle fleet the credit is 1, the rule of waiting against recomputing: each
    follower goes to an idle worker while there is one (the leader's prefill is longer than the follower's
    prompt), and the fifth joins a worker computing the prefix, credited its blocks. The burst's own queues
    do not raise the credit: the first request's view of the fleet weighs in full, the later ones' hardly.
    Without the tier each worker computes the prefix, the fifth too."""
    workers = tuple((w, 0) for w in range(1, 5))
    for credit in (KVROUTER_CONFIG.predicted_credit, 0.0):
        config = replace(KVROUTER_CONFIG, predicted_credit=credit)
        router, index = Router(config, block_size=B, seed=0, clock=FakeClock()), RadixIndex()  # all at one instant
        _steady(router, workers, queued=queued)
        picks = [router.select(index, workers, local_hashes=[*PREFIX, 1000 + n], request_id=f"r{n}") for n in range(5)]
        holders = {pick.worker for pick in picks}
        if credit and queued:
            assert len(holders) == 1
            assert [pick.predicted_blocks for pick in picks] == [0, 8, 8, 8, 8]
        else:
            assert len(holders) == 4
            assert [pick.predicted_blocks for pick in picks] == [0, 0, 0, 0, 8 if credit else 0]


def test_a_prediction_confirmed_by_the_events_becomes_device_overlap():
    router, index = Router(ADDITIVE, block_size=B, seed=0), RadixIndex()
    _book_leader(router, tail=[100])
    _store(index, W1, PREFIX[:5])  # the first chunk's events arrived
    _, rows = _rows(router, index, [*PREFIX, 200])
    assert (rows[W1].overlap.device, rows[W1].overlap.predicted) == (5, 3)
    assert rows[W1].cost.predicted_credit_blocks == pytest.approx(ONE_OF_THREE * 3)
    assert rows[W1].cost.overlap_credit_blocks == pytest.approx(1.0 * 5 + ONE_OF_THREE * 3)
    _store(index, W1, PREFIX)  # and the rest
    _, rows = _rows(router, index, [*PREFIX, 200])
    assert (rows[W1].overlap.device, rows[W1].overlap.predicted) == (8, 0)
    assert rows[W1].cost.predicted_credit_blocks == 0.0
    assert rows[W1].cost.overlap_credit_blocks == 8.0


def test_a_prediction_ends_when_the_requests_holding_it_leave():
    router, index = Router(ADDITIVE, block_size=B, seed=0), RadixIndex()
    _book_leader(router)
    router.slots.mark_prefill_completed("leader")
    _, rows = _rows(router, index, [*PREFIX, 200])
    assert rows[W1].overlap.predicted == 8  # first token out, events not yet in: still predicted
    router.slots.free("leader")  # finished, and no event ever confirmed its blocks
    _, rows = _rows(router, index, [*PREFIX, 200])
    assert rows[W1].overlap.predicted == 0
    assert rows[W1].cost.total == rows[W2].cost.total


def test_a_prediction_expires_with_the_stale_sweep():
    clock = FakeClock()
    router, index = Router(ADDITIVE, block_size=B, seed=0, clock=clock), RadixIndex()
    _book_leader(router)
    clock.now = 299.0
    _, rows = _rows(router, index, [*PREFIX, 200])
    assert rows[W1].overlap.predicted == 8
    clock.now = 300.0 + SWEEP_INTERVAL_SECS  # past the expiry at the next sweep (once a minute)
    _, rows = _rows(router, index, [*PREFIX, 200])
    assert rows[W1].overlap.predicted == 0


def test_a_worker_restart_clears_its_predictions():
    router, index = Router(ADDITIVE, block_size=B, seed=0), RadixIndex()
    _book_leader(router)
    router.slots.add_request("other", W2, sequence_hashes([300, 301]), 2 * B, 0)
    assert router.slots.drop_worker(W1) == ["leader"]
    _, rows = _rows(router, index, [*PREFIX, 200])
    assert rows[W1].overlap.predicted == 0
    assert router.slots.active_prefill_tokens(W1) == 0
    assert router.slots.request_ids() == ["other"]  # the other worker's requests stay


@pytest.mark.parametrize(
    ("leader_tail", "done_blocks", "joins"),
    [
        ([], 5, True),  # 3 blocks of the leader's prefill remain: waiting beats recomputing 8
        ([], 1, True),  # 7 remain
        (list(range(100, 110)), 0, False),  # 18 remain: recomputing the 8 shared blocks elsewhere is quicker
        (list(range(100, 103)), 0, False),  # 11 remain
    ],
)
def test_a_follower_waits_for_a_prefix_when_that_beats_recomputing_it(
    leader_tail: list[int], done_blocks: int, joins: bool
):
    """At credit 1 (the idle fleet's weight) the prefill term is the rule itself: joining W1 costs the
    leader's remaining prefill plus the follower's own block, going to the idle W2 costs the whole prompt."""
    router, index = Router(RouterConfig(predicted_credit=1.0), block_size=B, seed=0), RadixIndex()
    _book_leader(router, tail=leader_tail, done_blocks=done_blocks)
    remaining = len(PREFIX) + len(leader_tail) - done_blocks
    selection, rows = _rows(router, index, [*PREFIX, 200], (W1, W2))
    assert rows[W1].cost.adjusted_prefill_blocks == remaining + 1
    assert rows[W2].cost.adjusted_prefill_blocks == 9
    assert (selection.worker == W1) is joins
