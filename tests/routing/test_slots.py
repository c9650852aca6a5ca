"""``SlotManager``: shared-prefix block counts, prefix overlap, prefill tokens, lifecycle, the stale sweep,
the three tracking switches, and a model check. Time is a :class:`FakeClock` moved by hand; nothing sleeps."""

from __future__ import annotations

import logging
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from kvrouter import DuplicateRequest, KvRouterError
from kvrouter.events.model import WorkerKey
from kvrouter.routing import ReferenceSlotManager
from kvrouter.routing.slots import DEFAULT_EXPIRY_SECS, LOAD_WINDOW_SECS, SlotManager
from tests.clock import FakeClock

BLOCK = 4
W1: WorkerKey = (1, 0)
W2: WorkerKey = (1, 1)
PREFIX = [11, 12, 13]
R1 = [*PREFIX, 14]
R2 = [*PREFIX, 25, 26]


@pytest.fixture
def slots(clock: FakeClock) -> SlotManager:
    return SlotManager(block_size=BLOCK, clock=clock)


def load(slots: SlotManager, worker: WorkerKey) -> tuple[int, int, int]:
    """(active blocks, active prefill tokens, active requests)."""
    return slots.active_blocks(worker), slots.active_prefill_tokens(worker), slots.active_requests(worker)


def test_shared_prefix_blocks_count_once(slots: SlotManager):
    slots.add_request("r1", W1, R1, isl_tokens=16, overlap_blocks=0)
    slots.add_request("r2", W1, R2, isl_tokens=20, overlap_blocks=0)
    assert slots.active_blocks(W1) == 3 + 1 + 2
    assert slots.active_requests(W1) == 2
    slots.free("r1")
    assert slots.active_blocks(W1) == len(R2)  # the shared prefix stays for r2
    assert slots.active_requests(W1) == 1


def test_potential_decode_blocks_counts_the_leading_overlap(slots: SlotManager):
    slots.add_request("r1", W1, R1, isl_tokens=16, overlap_blocks=0)
    slots.add_request("r2", W1, R2, isl_tokens=20, overlap_blocks=0)
    query = [11, 12, 97, 98, 99]
    assert slots.potential_decode_blocks(W1, query) == 6 + len(query) - 2
    assert slots.potential_decode_blocks(W1, R1) == 6  # wholly active already


def test_overlap_stops_at_the_first_block_not_active(slots: SlotManager):
    slots.add_request("r1", W1, R1, isl_tokens=16, overlap_blocks=0)
    query = [99, 12, 13, 14]  # later hashes are active, the first is not
    assert slots.potential_decode_blocks(W1, query) == 4 + 4


def test_unknown_worker_answers_zero_and_its_request_costs_its_blocks(slots: SlotManager):
    slots.add_request("r1", W1, R1, isl_tokens=16, overlap_blocks=0)
    assert load(slots, W2) == (0, 0, 0)
    assert slots.potential_decode_blocks(W2, R1) == len(R1)
    assert slots.potential_prefill_tokens(W2, 16, 1) == 12
    assert slots.workers() == {W1}


def test_prefill_tokens_discount_the_cached_overlap(slots: SlotManager):
    slots.add_request("r1", W1, R1, isl_tokens=18, overlap_blocks=2)
    slots.add_request("r2", W1, R2, isl_tokens=10, overlap_blocks=0)
    assert slots.active_prefill_tokens(W1) == (18 - 2 * BLOCK) + 10
    assert slots.potential_prefill_tokens(W1, 9, 1) == 20 + 5
    assert slots.potential_prefill_tokens(W1, 4, 3) == 20  # cached beyond the prompt adds nothing


def test_mark_prefill_completed_takes_back_only_that_request(slots: SlotManager):
    slots.add_request("r1", W1, R1, isl_tokens=18, overlap_blocks=2)
    slots.add_request("r2", W1, R2, isl_tokens=10, overlap_blocks=0)
    slots.mark_prefill_completed("r1")
    assert load(slots, W1) == (6, 10, 2)
    slots.mark_prefill_completed("r1")
    assert load(slots, W1) == (6, 10, 2)
    slots.free("r1")
    assert load(slots, W1) == (5, 10, 1)
    slots.free("r2")  # not marked: free takes back its prefill too
    assert load(slots, W1) == (0, 0, 0)
    assert slots.workers() == set()


def test_free_and_mark_are_idempotent_and_ignore_unknown_ids(slots: SlotManager):
    slots.mark_prefill_completed("nobody")
    slots.free("nobody")
    slots.add_request("r1", W1, R1, isl_tokens=16, overlap_blocks=0)
    slots.free("r1")
    slots.free("r1")
    slots.mark_prefill_completed("r1")
    assert load(slots, W1) == (0, 0, 0)
    assert slots.workers() == set()


def test_duplicate_request_id_is_refused_and_changes_nothing(slots: SlotManager):
    slots.add_request("r1", W1, R1, isl_tokens=16, overlap_blocks=0)
    with pytest.raises(DuplicateRequest, match=r"request 'r1' is already active on worker 1 dp 0"):
        slots.add_request("r1", W2, R2, isl_tokens=20, overlap_blocks=0)
    assert issubclass(DuplicateRequest, KvRouterError)
    assert load(slots, W1) == (4, 16, 1)
    assert slots.workers() == {W1}
    slots.free("r1")
    slots.add_request("r1", W2, R2, isl_tokens=20, overlap_blocks=0)  # a freed id may come back
    assert slots.workers() == {W2}


def test_sweep_drops_requests_at_expiry(slots: SlotManager, clock: FakeClock, caplog: pytest.LogCaptureFixture):
    assert DEFAULT_EXPIRY_SECS == 300.0
    slots.add_request("r1", W1, R1, isl_tokens=16, overlap_blocks=0)
    clock.now = 100.0
    slots.add_request("r2", W1, R2, isl_tokens=20, overlap_blocks=0)
    caplog.set_level(logging.WARNING, logger="kvrouter.routing.slots")
    clock.now = 299.9
    assert slots.sweep() == []
    assert not caplog.records
    clock.now = 300.0
    assert slots.sweep() == ["r1"]
    assert load(slots, W1) == (len(R2), 20, 1)
    assert len(caplog.records) == 1
    assert "count=1" in caplog.records[0].getMessage()
    slots.free("r1")  # the late completion of a swept request is a no-op
    clock.now = 400.5
    assert slots.sweep() == ["r2"]
    assert slots.workers() == set()
    assert len(caplog.records) == 2


@pytest.mark.parametrize("manager", [SlotManager, ReferenceSlotManager])
def test_sweep_measures_the_age_not_a_rounded_cutoff(manager: type[SlotManager | ReferenceSlotManager]):
    """Booked at 0.2 s, swept at 300.2 s: exactly 300 s old, so expired (``300.2 - 300`` rounds below 0.2,
    so a cutoff comparison kept it; found by the state machine below)."""
    clock = FakeClock()
    clock.now = 0.2
    slots = manager(block_size=4, clock=clock)
    slots.add_request("r0", W1, [], isl_tokens=0, overlap_blocks=0)
    clock.now += DEFAULT_EXPIRY_SECS
    assert slots.sweep() == ["r0"]


def test_sweep_returns_every_stale_request_oldest_first(slots: SlotManager, clock: FakeClock):
    for t, request_id in enumerate(["a", "b", "c", "d"]):
        clock.now = float(t)
        slots.add_request(request_id, W1 if t % 2 else W2, R1, isl_tokens=16, overlap_blocks=0)
    slots.free("b")
    clock.now = 302.0
    assert slots.sweep() == ["a", "c"]
    assert slots.workers() == {W1}
    assert load(slots, W1) == (len(R1), 16, 1)


def test_expiry_is_configurable(clock: FakeClock):
    slots = SlotManager(block_size=BLOCK, expiry_secs=5.0, clock=clock)
    slots.add_request("r1", W1, R1, isl_tokens=16, overlap_blocks=0)
    clock.now = 5.0
    assert slots.sweep() == ["r1"]


def test_without_active_block_tracking_block_figures_are_zero(clock: FakeClock):
    slots = SlotManager(block_size=BLOCK, track_active_blocks=False, clock=clock)
    slots.add_request("r1", W1, R1, isl_tokens=16, overlap_blocks=1)
    assert load(slots, W1) == (0, 12, 1)
    assert slots.potential_decode_blocks(W1, R2) == 0
    assert slots.potential_decode_blocks(W2, R2) == 0


def test_without_prefill_tracking_prefill_figures_are_zero(clock: FakeClock):
    slots = SlotManager(block_size=BLOCK, track_prefill_tokens=False, clock=clock)
    slots.add_request("r1", W1, R1, isl_tokens=16, overlap_blocks=1)
    assert load(slots, W1) == (4, 0, 1)
    assert slots.potential_prefill_tokens(W1, 16, 0) == 0
    slots.mark_prefill_completed("r1")
    assert load(slots, W1) == (4, 0, 1)


def test_without_kv_reuse_nothing_is_shared(clock: FakeClock):
    slots = SlotManager(block_size=BLOCK, assume_kv_reuse=False, clock=clock)
    slots.add_request("r1", W1, R1, isl_tokens=16, overlap_blocks=0)
    slots.add_request("r2", W1, R2, isl_tokens=20, overlap_blocks=0)
    slots.add_request("r3", W1, R1, isl_tokens=16, overlap_blocks=0)  # identical prompt, own blocks
    assert slots.active_blocks(W1) == 2 * len(R1) + len(R2)
    assert slots.potential_decode_blocks(W1, R1) == 13 + len(R1)
    slots.free("r1")
    assert slots.active_blocks(W1) == len(R1) + len(R2)
    slots.free("r2")
    slots.free("r3")
    assert load(slots, W1) == (0, 0, 0)
    assert slots.workers() == set()


def test_a_hash_repeated_within_a_request_is_freed_whole(slots: SlotManager):
    slots.add_request("r1", W1, [5, 5, 6], isl_tokens=12, overlap_blocks=0)
    slots.add_request("r2", W1, [5], isl_tokens=4, overlap_blocks=0)
    assert slots.active_blocks(W1) == 2
    slots.free("r1")
    assert slots.active_blocks(W1) == 1
    slots.free("r2")
    assert slots.workers() == set()


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": BLOCK, "expiry_secs": 0.0}, "expiry_secs"),
        ({"block_size": BLOCK, "expiry_secs": -1.0}, "expiry_secs"),
        ({"block_size": BLOCK, "expiry_secs": math.nan}, "expiry_secs"),
        ({"block_size": BLOCK, "work_window_secs": 0.0}, "work_window_secs"),
        ({"block_size": BLOCK, "work_window_secs": math.nan}, "work_window_secs"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict[str, float], argument: str):
    with pytest.raises(ValueError, match=argument):
        SlotManager(**kwargs)  # type: ignore[arg-type]


def test_recent_prefill_counts_uncached_tokens_decayed_and_outlives_the_request(clock: FakeClock):
    slots = SlotManager(block_size=BLOCK, work_window_secs=10.0, clock=clock)
    slots.add_request("a", W1, R1, 4 * BLOCK + 2, overlap_blocks=1)  # 3 blocks + 2 tokens uncached
    assert slots.recent_prefill_tokens(W1) == 3 * BLOCK + 2
    assert slots.recent_prefill_tokens(W2) == 0.0
    slots.mark_prefill_completed("a")
    slots.free("a")  # work done stays done
    clock.now = 10.0
    assert slots.recent_prefill_tokens(W1) == pytest.approx((3 * BLOCK + 2) / math.e)
    slots.add_request("b", W1, R2, 5 * BLOCK, overlap_blocks=5)  # nothing uncached: nothing added
    assert slots.recent_prefill_tokens(W1) == pytest.approx((3 * BLOCK + 2) / math.e)
    slots.add_request("c", W1, [31], BLOCK, overlap_blocks=0)
    clock.now = 20.0
    assert slots.recent_prefill_tokens(W1) == pytest.approx(((3 * BLOCK + 2) / math.e + BLOCK) / math.e)


@pytest.mark.parametrize("manager", [SlotManager, ReferenceSlotManager])
def test_recent_prefill_stays_finite_and_exact_across_days(manager: type[SlotManager | ReferenceSlotManager]):
    """Booked work is kept scaled to an epoch that moves forward every 512 windows: over days of a 1 s
    window (about 170 moves) the figures neither overflow nor drift from the plain decay."""
    clock = FakeClock()
    slots = manager(block_size=BLOCK, work_window_secs=1.0, clock=clock)
    recent = 0.0
    for n in range(400):  # a booking every 0.5-1,000 s, over about 2 days
        step = 0.5 if n % 2 else 1000.0 + n
        recent *= math.exp(-step)
        clock.now += step
        slots.add_request(f"r{n}", W1, [n + 1], BLOCK, overlap_blocks=0)
        slots.free(f"r{n}")
        recent += BLOCK
        assert slots.recent_prefill_tokens(W1) == pytest.approx(recent, rel=1e-12)
    clock.now += 1e6  # idle far beyond the epoch: decayed to nothing, not NaN
    assert slots.recent_prefill_tokens(W1) == 0.0


@pytest.mark.parametrize("manager", [SlotManager, ReferenceSlotManager])
def test_the_seen_load_weighs_each_decisions_share_by_the_quiet_before_it(
    manager: type[SlotManager | ReferenceSlotManager],
):
    """The first decision's share stands alone; each later one is held over the time since the one before, so
    a burst's later decisions, milliseconds apart, hardly move the average that its first one set."""
    clock = FakeClock()
    slots = manager(block_size=BLOCK, clock=clock)
    clock.now = 3.0
    assert slots.seen_load(0.25) == 0.25
    average = 0.25
    for _ in range(20):  # a burst: its own queues fill every worker, 1 ms apart
        clock.now += 0.001
        fade = math.exp(-0.001 / LOAD_WINDOW_SECS)
        average = average * fade + 1.0 * (1.0 - fade)
        assert slots.seen_load(1.0) == average  # float for float: the decision kernel's arithmetic
    assert average < 0.25 + 0.01
    clock.now += LOAD_WINDOW_SECS  # the next request comes after a quiet spell, and finds the fleet idle
    assert slots.seen_load(0.0) == pytest.approx(average / math.e)


def test_the_seen_load_survives_the_work_epoch_moving(clock: FakeClock):
    """The epoch that booked work is kept scaled to moves forward (every 512 work windows); the seen load's
    time of the last decision moves with it, so its fade still measures the real gap."""
    slots = SlotManager(block_size=BLOCK, work_window_secs=1.0, clock=clock)
    reference = ReferenceSlotManager(block_size=BLOCK, work_window_secs=1.0, clock=clock)
    clock.now = 1.0
    for each in (slots, reference):
        each.seen_load(0.5)
    clock.now = 1000.0  # past 512 windows: the next booking moves the epoch
    for each in (slots, reference):
        each.add_request("a", W1, R1, 4 * BLOCK, overlap_blocks=0)
    assert slots.work_epoch == 1000.0
    clock.now = 1000.0 + LOAD_WINDOW_SECS
    expected = 0.5 * math.exp(-(999.0 + LOAD_WINDOW_SECS) / LOAD_WINDOW_SECS) + 1.0 * (
        1.0 - math.exp(-(999.0 + LOAD_WINDOW_SECS) / LOAD_WINDOW_SECS)
    )
    assert slots.seen_load(1.0) == pytest.approx(expected)
    assert reference.seen_load(1.0) == slots.seen[0]


def test_without_prefill_tracking_no_recent_prefill(clock: FakeClock):
    slots = SlotManager(block_size=BLOCK, track_prefill_tokens=False, clock=clock)
    slots.add_request("a", W1, R1, 4 * BLOCK, overlap_blocks=0)
    assert slots.recent_prefill_tokens(W1) == 0.0


# -- model check ------------------------------------------------------------------------------------

WORKERS: list[WorkerKey] = [(1, 0), (1, 1), (2, 0)]
EXPIRY = 300.0

paths = st.lists(st.integers(0, 2), max_size=5)
"""Branch choices in a small tree of prompts: requests share prefixes often and diverge at any depth."""


def chain(path: list[int]) -> list[int]:
    """Stand-in sequence hashes: one distinct int per prefix of ``path``, as chained hashes are."""
    return [int("1" + "".join(map(str, path[: i + 1]))) for i in range(len(path))]


class SlotModel(RuleBasedStateMachine):
    """Random add / mark / free / sweep / clock steps against a model that recomputes every figure
    from the list of active requests."""

    request_ids = Bundle("request_ids")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.next_id = 0
        self.active: dict[str, tuple[WorkerKey, list[object], int, float]] = {}
        """request id -> (worker, block identities, prefill tokens left, start time)."""

    @initialize(track_blocks=st.booleans(), track_prefill=st.booleans(), reuse=st.booleans())
    def setup(self, track_blocks: bool, track_prefill: bool, reuse: bool) -> None:
        self.track_blocks, self.track_prefill, self.reuse = track_blocks, track_prefill, reuse
        self.slots = SlotManager(
            block_size=BLOCK,
            track_active_blocks=track_blocks,
            track_prefill_tokens=track_prefill,
            assume_kv_reuse=reuse,
            expiry_secs=EXPIRY,
            clock=self.clock,
        )

    def model_blocks(self, worker: WorkerKey) -> set[object]:
        return {block for w, blocks, _, _ in self.active.values() if w == worker for block in blocks}

    def new_prefill(self, isl: int, overlap: int) -> int:
        return max(0, isl - overlap * BLOCK) if self.track_prefill else 0

    @rule(
        target=request_ids,
        worker=st.sampled_from(WORKERS),
        path=paths,
        isl=st.integers(0, 30),
        overlap=st.integers(0, 6),
    )
    def add(self, worker: WorkerKey, path: list[int], isl: int, overlap: int) -> str:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        hashes = chain(path)
        self.slots.add_request(request_id, worker, hashes, isl, overlap)
        blocks: list[object] = []
        if self.track_blocks:  # without reuse, a request's blocks are its own whatever their hashes
            blocks = [h if self.reuse else (request_id, h) for h in hashes]
        self.active[request_id] = (worker, blocks, self.new_prefill(isl, overlap), self.clock.now)
        return request_id

    @rule(request_id=request_ids)
    def add_again(self, request_id: str) -> None:
        if request_id in self.active:
            with pytest.raises(DuplicateRequest):
                self.slots.add_request(request_id, WORKERS[0], [1], 4, 0)

    @rule(request_id=request_ids)
    def mark(self, request_id: str) -> None:
        self.slots.mark_prefill_completed(request_id)
        if request_id in self.active:
            worker, blocks, _, started = self.active[request_id]
            self.active[request_id] = (worker, blocks, 0, started)

    @rule(request_id=request_ids)
    def free(self, request_id: str) -> None:
        self.slots.free(request_id)
        self.active.pop(request_id, None)

    @rule(seconds=st.sampled_from([0.0, 0.1, 60.0, 150.0, 299.9, 300.0]))
    def advance(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule()
    def sweep(self) -> None:
        stale = sorted(
            (started, int(rid[1:]), rid)
            for rid, (_, _, _, started) in self.active.items()
            if self.clock.now - started >= EXPIRY
        )
        assert self.slots.sweep() == [rid for _, _, rid in stale]
        for _, _, rid in stale:
            del self.active[rid]

    @rule(
        worker=st.sampled_from(WORKERS),
        path=paths,
        spliced=st.booleans(),
        isl=st.integers(0, 30),
        overlap=st.integers(0, 6),
    )
    def potential(self, worker: WorkerKey, path: list[int], spliced: bool, isl: int, overlap: int) -> None:
        query = chain(path)
        if spliced:  # a first block no request holds, then blocks that may be held: the overlap is 0
            query = [0, *query[1:]]
        held = self.model_blocks(worker)
        leading = 0
        while self.reuse and leading < len(query) and query[leading] in held:
            leading += 1
        expected_blocks = len(held) + len(query) - leading if self.track_blocks else 0
        assert self.slots.potential_decode_blocks(worker, query) == expected_blocks
        every = self.slots.active_overlaps(np.array(query, dtype=np.uint64))
        slot = self.slots.numbering.get(worker)
        found = 0 if every is None or slot is None or slot >= len(every) else int(every[slot])
        assert found == (leading if self.track_blocks else 0)
        expected_tokens = self.slots.active_prefill_tokens(worker) + self.new_prefill(isl, overlap)
        assert self.slots.potential_prefill_tokens(worker, isl, overlap) == expected_tokens

    @invariant()
    def figures_match_the_model(self) -> None:
        requests = Counter(worker for worker, _, _, _ in self.active.values())
        assert self.slots.workers() == set(requests)
        for worker in WORKERS:
            prefill = sum(tokens for w, _, tokens, _ in self.active.values() if w == worker)
            assert load(self.slots, worker) == (len(self.model_blocks(worker)), prefill, requests[worker])

    def teardown(self) -> None:
        if not hasattr(self, "slots"):
            return
        for request_id in list(self.active):
            self.slots.free(request_id)
        assert self.slots.workers() == set()
        for worker in WORKERS:
            assert load(self.slots, worker) == (0, 0, 0)
        assert not self.slots.pairs.any()  # every refcount row deleted, and no row left behind
        assert not self.slots.holders.any()
        assert self.slots._requests == {}
        assert not self.slots.requests.any()
        assert not self.slots.blocks.any()
        assert not self.slots.prefill_tokens.any()


TestSlotModel = SlotModel.TestCase
TestSlotModel.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
