from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvrouter.errors import ConfigError, NoWorkerAvailable
from kvrouter.events.model import EngineHash, LocalHash, StorageTier, Stored, StoredBlock, WorkerKey
from kvrouter.hashing import block_hashes
from kvrouter.index import ApproxIndex, RadixIndex
from kvrouter.index.dense import WorkerSlots, overlaps_from_tiers
from kvrouter.routing import Router, RouterConfig
from kvrouter.routing.config import KVROUTER_CONFIG
from tests.clock import FakeClock

B = 4
W1, W2, W3 = (1, 0), (2, 0), (3, 0)


def _cache(index: RadixIndex, worker: int, local: list[int], tier: StorageTier = StorageTier.DEVICE) -> None:
    blocks = tuple(StoredBlock(EngineHash(1000 + i), LocalHash(h)) for i, h in enumerate(local))
    index.apply_event(worker, Stored(worker, None, blocks, tier=tier))


def test_the_worker_holding_the_prefix_wins_and_the_explanation_shows_why():
    tokens = list(range(8 * B))
    local = block_hashes(tokens, B)
    index = RadixIndex()
    _cache(index, 2, local[:6])
    _cache(index, 3, local[:2])
    selection = Router(block_size=B, seed=1).select(index, [W1, W2, W3], tokens=tokens, explain=True)
    assert selection.worker == W2
    assert selection.overlap_blocks == 6
    assert selection.isl_tokens == 8 * B
    assert selection.explanation is not None
    rows = {row.worker: row for row in selection.explanation}
    assert {w: r.overlap.device for w, r in rows.items()} == {W1: 0, W2: 6, W3: 2}
    assert {w: r.cost.total for w, r in rows.items()} == {W1: 16, W2: 10, W3: 14}
    assert [w for w, r in rows.items() if r.selected] == [W2]
    assert rows[W2].probability == 1.0
    assert rows[W2].cost.adjusted_prefill_blocks == 2
    assert rows[W2].cost.decode_blocks == 8


def test_booked_requests_load_their_worker_until_freed():
    router = Router(block_size=B, seed=0)
    index = RadixIndex()
    local = list(range(1, 9))
    first = router.select(index, [W1, W2], local_hashes=local, request_id="a")
    second = router.select(index, [W1, W2], local_hashes=[9, 10, 11, 12], request_id="b")
    assert second.worker != first.worker  # the first request's load pushes the second away
    assert router.slots.active_prefill_tokens(first.worker) == 8 * B
    router.slots.mark_prefill_completed("a")
    router.slots.free("a")
    router.slots.free("b")
    assert router.slots.workers() == set()


def test_host_overlap_counts_for_less_than_device_overlap():
    index = RadixIndex()
    local = [1, 2, 3, 4]
    _cache(index, 1, local[:3], tier=StorageTier.HOST)  # cost 4 - 0.75 * 3 + 4 = 5.75
    _cache(index, 2, local[:3])  # cost 4 - 3 + 4 = 5
    selection = Router(block_size=B, seed=0).select(index, [W1, W2], local_hashes=local, explain=True)
    assert selection.worker == W2
    assert selection.explanation is not None
    host_row = next(r for r in selection.explanation if r.worker == W1)
    assert (host_row.overlap.device, host_row.overlap.host) == (0, 3)
    assert host_row.cost.overlap_credit_blocks == 0.75 * 3


def test_ties_are_split_over_many_seeded_draws():
    router = Router(block_size=B, seed=5)
    counts = Counter(router.select(RadixIndex(), [W1, W2, W3], local_hashes=[1, 2]).worker for _ in range(3000))
    assert set(counts) == {W1, W2, W3}
    assert min(counts.values()) > 850


def test_busy_workers_are_not_candidates():
    config = RouterConfig(active_prefill_tokens_threshold=10)
    router = Router(config, block_size=B, seed=0)
    index = RadixIndex()
    _cache(index, 1, [1, 2, 3, 4])
    router.slots.add_request("load", W1, [77], isl_tokens=40, overlap_blocks=0)
    selection = router.select(index, [W1, W2], local_hashes=[1, 2, 3, 4], explain=True)
    assert selection.worker == W2
    assert selection.explanation is not None
    assert {r.worker: (r.busy, r.probability) for r in selection.explanation} == {W1: (True, 0.0), W2: (False, 1.0)}
    router.slots.add_request("load2", W2, [78], isl_tokens=40, overlap_blocks=0)
    with pytest.raises(NoWorkerAvailable, match="busy"):
        router.select(index, [W1, W2], local_hashes=[1, 2, 3, 4])


def test_decode_threshold_is_a_fraction_of_capacity():
    router = Router(RouterConfig(active_decode_blocks_threshold=0.5), block_size=B, seed=0)
    router.slots.add_request("r", W1, [1, 2, 3], isl_tokens=3 * B, overlap_blocks=0)
    index = RadixIndex()
    assert router.select(index, [W1], local_hashes=[9], capacities={W1: 8}).worker == W1
    with pytest.raises(NoWorkerAvailable):
        router.select(index, [W1], local_hashes=[9], capacities={W1: 4})


def test_no_candidates_is_an_error():
    with pytest.raises(NoWorkerAvailable, match="no candidate"):
        Router(block_size=B).select(RadixIndex(), [], local_hashes=[1])


def test_approximate_mode_records_each_decision():
    clock = FakeClock()
    index = ApproxIndex(ttl=120.0, clock=clock)
    router = Router(RouterConfig(use_kv_events=False), block_size=B, seed=0)
    first = router.select(index, [W1, W2], local_hashes=[1, 2, 3])
    assert index.find_matches([1, 2, 3]) == {first.worker: 3}
    assert router.select(index, [W1, W2], local_hashes=[1, 2, 3, 4]).worker == first.worker
    clock.now = 500.0
    assert index.find_matches([1, 2, 3]) == {}
    with pytest.raises(ConfigError, match="ApproxIndex"):
        router.select(RadixIndex(), [W1], local_hashes=[1])


def test_stale_requests_are_swept_while_routing():
    clock = FakeClock()
    router = Router(block_size=B, seed=0, clock=clock)
    router.select(RadixIndex(), [W1], local_hashes=[1, 2], request_id="forgotten")
    clock.now = 299.0
    router.select(RadixIndex(), [W1], local_hashes=[3])
    assert router.slots.active_requests(W1) == 1
    clock.now = 360.0
    router.select(RadixIndex(), [W1], local_hashes=[3])
    assert router.slots.active_requests(W1) == 0


def test_prefill_work_weight_sends_new_work_to_the_worker_that_did_less_lately():
    clock = FakeClock()
    index = RadixIndex()
    for config, expected in ((RouterConfig(prefill_work_weight=1.0), W2), (RouterConfig(), None)):
        router = Router(config, block_size=B, seed=0, clock=clock)
        router.slots.add_request("old", W1, [1, 2], 2 * B, overlap_blocks=0)  # W1 prefilled 2 blocks lately
        router.slots.mark_prefill_completed("old")
        router.slots.free("old")  # nothing in flight: only the work term tells the workers apart
        chosen = {router.select(index, [W1, W2], local_hashes=[7, 8], explain=True).worker for _ in range(20)}
        if expected is None:
            assert chosen == {W1, W2}  # the reference cost ties them
        else:
            assert chosen == {expected}
            selection = router.select(index, [W1, W2], local_hashes=[7, 8], explain=True)
            assert selection.explanation is not None
            factors = {row.worker: row.cost.work_factor for row in selection.explanation}
            # the mean, 4 tokens, plus the request's 8: W1 is 4 above it (1 + 4/12), W2 4 below
            assert factors == pytest.approx({W1: 4 / 3, W2: 2 / 3})


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_a_recorded_decision_explains_later_as_an_explained_one_did(temperature):
    """``record=True`` keeps arrays only; explained later they say what ``explain=True`` said then."""
    tokens = list(range(8 * B))
    local = block_hashes(tokens, B)
    index = RadixIndex()
    _cache(index, 2, local[:6])
    _cache(index, 3, local[:2], StorageTier.HOST)
    config = RouterConfig(router_temperature=temperature)
    recorder, explainer = Router(config, block_size=B, seed=7), Router(config, block_size=B, seed=7)
    for n in range(6):  # booked requests between decisions: loads differ from one decision to the next
        recorded = recorder.select(index, [W1, W2, W3], tokens=tokens, record=True, request_id=f"r{n}")
        explained = explainer.select(index, [W1, W2, W3], tokens=tokens, explain=True, request_id=f"r{n}")
        assert recorded.explanation is None
        assert recorded.record is not None
        assert explained.record is None
        assert recorded.worker == explained.worker
        assert recorded.record.explain() == explained.explanation
        assert recorded.record.nbytes > 0


def test_an_untrusted_workers_overlap_credit_is_weighted_down():
    tokens = list(range(8 * B))
    local = block_hashes(tokens, B)
    index = RadixIndex()
    _cache(index, 2, local[:6])
    _cache(index, 3, local[:4])
    config = RouterConfig(untrusted_overlap_weight=0.5)
    router = Router(config, block_size=B, seed=1)
    trusted = router.select(index, [W1, W2, W3], tokens=tokens, explain=True)
    assert trusted.worker == W2
    router.set_untrusted([W2, (9, 0)])  # a worker it has never seen is fine
    halved = router.select(index, [W1, W2, W3], tokens=tokens, explain=True)
    assert halved.explanation is not None
    rows = {row.worker: row for row in halved.explanation}
    assert rows[W2].cost.overlap_credit_blocks == 3.0  # 6 blocks, credit 1 a block, halved
    assert rows[W3].cost.overlap_credit_blocks == 4.0
    assert halved.worker == W3  # 4 trusted blocks now beat 6 untrusted ones
    router.set_untrusted([])
    assert router.select(index, [W1, W2, W3], tokens=tokens).worker == W2
    with pytest.raises(ConfigError, match="untrusted_overlap_weight"):
        RouterConfig(untrusted_overlap_weight=1.5)


class _ArrayAnswers:
    """An ``ArrayOverlapSource`` answering as another index may: a Fortran-ordered array (the router asks
    ``overlaps`` first; the dict answer is there for the protocol's sake)."""

    def __init__(self, index: RadixIndex) -> None:
        self.index = index

    def overlaps(self, local: npt.NDArray[np.uint64], slots: WorkerSlots, ntiers: int) -> npt.NDArray[Any]:
        answer = overlaps_from_tiers(self.index.find_matches_by_tier(local.tolist()), slots, ntiers)
        return np.asfortranarray(answer)

    def find_matches_by_tier(self, local_hashes: Sequence[int]) -> dict[StorageTier, dict[WorkerKey, int]]:
        raise AssertionError("the router asks an array index for arrays")


def test_an_array_index_answering_in_another_layout_decides_as_the_dict_answer():
    """The decision kernel reads the overlaps unchecked (its entry point): the router makes any array
    answer C-contiguous ``int64`` first, so the layout an index chooses cannot change a decision."""
    tokens = list(range(8 * B))
    local = block_hashes(tokens, B)
    index = RadixIndex()
    _cache(index, 2, local[:6])
    _cache(index, 3, local[:2], StorageTier.HOST)
    fleet = (W1, W2, W3)
    mine = Router(block_size=B, seed=1).select(_ArrayAnswers(index), fleet, tokens=tokens, explain=True)
    theirs = Router(block_size=B, seed=1).select(index, fleet, tokens=tokens, explain=True)
    assert mine.worker == theirs.worker == W2
    assert mine.explanation == theirs.explanation


def test_a_conversations_next_turn_stays_where_it_is_cached_on_an_idle_fleet():
    """The work factor balances what workers have done lately, but on an idle fleet, where a worker's recent
    work is one request's, a worker that did nothing must not price at 0: the next turn of a conversation goes
    where its history is cached (it went to the idle worker, whose cost the factor zeroed, before)."""
    clock = FakeClock()
    router = Router(KVROUTER_CONFIG, block_size=B, seed=0, clock=clock)
    index = RadixIndex()
    first = list(range(1, 33))
    chosen = router.select(index, [W1, W2], local_hashes=first, request_id="turn-1")
    router.slots.mark_prefill_completed("turn-1")
    router.slots.free("turn-1")
    _cache(index, chosen.worker[0], first)
    clock.now += 30.0  # the user reads the answer
    second = router.select(index, [W1, W2], local_hashes=[*first, 33, 34], request_id="turn-2", explain=True)
    assert second.worker == chosen.worker, second.explanation
    assert second.overlap_blocks == len(first)
