"""Growth beside the writer (``index/growth.py``): the successor the helper builds while the writer goes
on writing equals the old table once published, whatever the interleaving. Stepped by hand against the
oracle (hypothesis chooses when the helper runs), then with the real helper thread under readers."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from multiprocessing.sharedctypes import Synchronized
from typing import Any, Final

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvrouter.events.model import Cleared, EngineHash, LocalHash, Removed, StorageTier, Stored, StoredBlock
from kvrouter.index import RadixIndex, growth as growth_module, writer as writer_module
from kvrouter.index.layout import H_CAPACITY, H_DIRTY, MIN_CAPACITY, Control, control_name
from kvrouter.index.reader import IndexReader
from kvrouter.index.writer import ShardWriter
from tests.index.contract import error_kind
from tests.index.shm import remove_left_shard

FORK = mp.get_context("fork")
_owners = itertools.count((os.getpid() << 20) + 700_000)


class _Deferred(Future[Any]):
    """A helper task that runs when the test steps it, or when the writer waits for it."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        super().__init__()
        self._call = fn, args

    def step(self) -> None:
        if not self.done():
            fn, args = self._call
            try:
                self.set_result(fn(*args))
            except BaseException as exc:
                self.set_exception(exc)

    def result(self, timeout: float | None = None) -> Any:
        self.step()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.step()
        return super().exception(timeout)


class SteppedHelper(Executor):
    """The writer's helper, run by the test: nothing happens beside the writer until ``step``."""

    def __init__(self) -> None:
        self.pending: list[_Deferred] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        task = _Deferred(fn, args)
        self.pending.append(task)
        return task

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As a thread pool's: what was submitted runs (the old tables' releases among it)."""
        while self.step():
            pass

    def step(self) -> bool:
        """Run the oldest task not yet run; False when there was none."""
        self.pending = [task for task in self.pending if not task.done()]
        if not self.pending:
            return False
        self.pending.pop(0).step()
        return True


class Stepped:
    """One shard, its writer stepped by hand, and a reader."""

    def __init__(self) -> None:
        self.owner = next(_owners)
        self.control = Control.create(control_name(self.owner), 1)
        self.helper = SteppedHelper()
        self.writer = ShardWriter(self.control, 0, self.owner, capacity=MIN_CAPACITY, helper=self.helper)
        self.reader = IndexReader(self.control.name)

    def close(self) -> None:
        """Close everything; every segment of every epoch must be gone (the old ones are released by the
        helper, which closing the writer runs to its end)."""
        self.reader.close()
        self.writer.close(unlink=True)
        self.control.close()
        self.control.unlink()
        assert [name for name in os.listdir("/dev/shm") if name.startswith(f"kvrouter-{self.owner}-")] == []


@pytest.fixture
def stepped() -> Iterator[Stepped]:
    shard = Stepped()
    try:
        yield shard
    finally:
        shard.close()


def _chain(worker: int, first: int, n: int, parent: int | None = None) -> Stored:
    blocks = tuple(StoredBlock(EngineHash(first + i), LocalHash(first + i)) for i in range(n))
    return Stored(worker, None if parent is None else EngineHash(parent), blocks)


def _engine_hashes(oracle: RadixIndex) -> dict[tuple[tuple[int, int], int], set[int]]:
    """The oracle's holdings as ``ShardWriter.engine_hashes`` lists them."""
    return {(worker, tier.rank): {int(h) for h in held} for (worker, tier), held in oracle.holdings().items() if held}


def _copied(stepped: Stepped, part: str = "table") -> None:
    """Run the helper until ``part``'s successor is made, populated and copied, starting the copy between
    batches as the writer does; the other parts' copies are not started."""
    growth = stepped.writer._growths[part]
    while not growth._copying:
        assert stepped.helper.step()
        stepped.writer.advance()
    while not growth._future.done():
        assert stepped.helper.step()


def _published(stepped: Stepped) -> None:
    """Run the helper and the writer's checks between batches until every growth is published."""
    for _ in range(8):
        while stepped.helper.step():
            pass
        stepped.writer.advance()
    assert not stepped.writer.growing


def test_writes_before_during_and_after_the_copy_all_reach_the_successor(
    stepped: Stepped, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(growth_module, "COPY_CHUNK", 100)  # each copy in several calls, the last a part
    oracle = RadixIndex()

    def apply(event: Stored | Removed) -> None:
        assert stepped.writer.apply(event) == error_kind(oracle, event.worker_id, event)

    for doc in range(5):  # 500 keys of 1024 slots: the next store starts a growth of every part
        apply(_chain(1, doc * 1000, 100))
    apply(_chain(2, 9000, 100))
    assert stepped.writer.growing
    old = stepped.writer.table
    assert int(old[H_DIRTY]) != 0  # the writer marks what it writes from the start (the growing load)
    apply(Removed(1, tuple(EngineHash(i) for i in range(50, 100))))  # while the successors are populated
    _copied(stepped)
    apply(_chain(2, 9100, 20, parent=9099))  # after the table's copy, before the maps'
    apply(Removed(2, (EngineHash(9000),)))
    _published(stepped)  # little was dirtied: published by the writer's own last round
    assert int(stepped.writer.table[H_CAPACITY]) == 2 * MIN_CAPACITY
    assert stepped.control.epoch(0) == 2
    for query in ([0, *range(1, 120)], list(range(9000, 9120)), [4000, 4001]):
        expected = oracle.find_matches_by_tier(query)
        assert stepped.reader.find_matches_by_tier(query) == expected
    assert stepped.writer.engine_hashes() == _engine_hashes(oracle)


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(f"/{name} " in line or line.rstrip().endswith(f"/{name}") for line in maps)


def test_an_old_table_is_unlinked_at_once_and_unmapped_after_its_readers_moved_on(stepped: Stepped):
    """The last process to unmap a segment frees its pages: the writer keeps the old table mapped for
    ``RETIRE_S``, so a reader's next query (which maps the new one and unmaps the old) is not that process."""
    for doc in range(6):
        assert stepped.writer.apply(_chain(1, doc * 1000, 100)) is None
    old = stepped.control.segment_name(0)
    assert stepped.reader.find_matches([0]) == {(1, 0): 1}  # the reader maps the old table
    while stepped.writer.growing:
        while stepped.helper.step():
            pass
        stepped.writer.advance()
    assert stepped.control.segment_name(0) != old
    assert not os.path.exists(f"/dev/shm/{old}")  # a start's sweep would find nothing of it
    assert _mapped(old)
    assert stepped.reader.find_matches([0]) == {(1, 0): 1}  # the reader moved to the new table
    stepped.writer.release_retired(time.monotonic())
    assert not stepped.helper.step()  # not yet: its second has not passed
    assert _mapped(old)
    stepped.writer.release_retired(time.monotonic() + writer_module.RETIRE_S)
    assert stepped.helper.step()
    assert not _mapped(old)


@pytest.mark.parametrize(("part", "docs", "dirty"), [("table", 6, 90), ("emap", 8, 60)])
def test_a_writer_that_dirties_much_gives_the_helper_another_round(
    stepped: Stepped, monkeypatch: pytest.MonkeyPatch, part: str, docs: int, dirty: int
):
    """``docs`` start the part's first growth; ``dirty`` new blocks then dirty as many slots or rows, more than
    one of a round's batches (``RECONCILE_BATCH``) and than the writer's own round takes, and less than the
    old part's growing load."""
    monkeypatch.setattr(growth_module, "FINAL_DIRTY", 16)
    oracle = RadixIndex()
    for doc in range(docs):
        event = _chain(1, doc * 1000, 100)
        assert stepped.writer.apply(event) is None
        oracle.apply_event(1, event)
    growth = stepped.writer._growths[part]
    _copied(stepped, part)
    event = _chain(2, 10_000, dirty)
    assert stepped.writer.apply(event) is None
    oracle.apply_event(2, event)
    assert growth.rounds == 1
    assert stepped.writer.growing
    _published(stepped)
    assert growth.reconciled >= dirty
    for query in (list(range(5000, 5100)), list(range(10_000, 10_000 + dirty))):
        assert stepped.reader.find_matches_by_tier(query) == oracle.find_matches_by_tier(query)
    assert stepped.writer.engine_hashes() == _engine_hashes(oracle)


def test_what_is_written_while_the_successor_is_populated_reaches_it_by_the_copy_alone(
    stepped: Stepped, monkeypatch: pytest.MonkeyPatch
):
    """The copy reads every slot after it starts: the writes before it (while the helper made and populated
    the successor) need no round."""
    monkeypatch.setattr(growth_module, "FINAL_DIRTY", 16)
    oracle = RadixIndex()
    for doc in range(6):
        event = _chain(1, doc * 1000, 100)
        assert stepped.writer.apply(event) is None
        oracle.apply_event(1, event)
    growth = stepped.writer._growths["table"]
    event = _chain(2, 6000, 90)  # 90 slots written before the successor exists: more than the last round takes
    assert stepped.writer.apply(event) is None
    oracle.apply_event(2, event)
    _copied(stepped)
    stepped.writer.advance()
    assert "table" not in stepped.writer._growths
    assert (growth.rounds, growth.reconciled) == (0, 0)
    _published(stepped)
    for query in (list(range(5000, 5100)), list(range(6000, 6090))):
        assert stepped.reader.find_matches_by_tier(query) == oracle.find_matches_by_tier(query)
    assert stepped.writer.engine_hashes() == _engine_hashes(oracle)


def test_a_successor_too_full_to_reconcile_is_copied_afresh(stepped: Stepped, monkeypatch: pytest.MonkeyPatch):
    """Dropped slots stay in the successor as keys without holders; were churn to pile them up past
    ``FULL_LOAD``, the round stops and the writer copies the old table afresh when it settles."""
    monkeypatch.setattr(growth_module, "FULL_LOAD", 0.0)  # any slot the rounds copy is one too many
    oracle = RadixIndex()

    def apply(event: Stored | Removed) -> None:
        assert stepped.writer.apply(event) == error_kind(oracle, event.worker_id, event)

    for doc in range(6):
        apply(_chain(1, doc * 1000, 100))
    growth = stepped.writer._growths["table"]
    _copied(stepped)
    apply(_chain(2, 6000, 90))
    apply(Removed(1, tuple(EngineHash(i) for i in range(1000, 1050))))
    for _ in range(3):
        while stepped.helper.step():
            pass
        stepped.writer.advance()
    assert not stepped.writer.growing
    assert growth.overfull
    for query in (list(range(1000, 1100)), list(range(6000, 6090)), list(range(5000, 5100))):
        assert stepped.reader.find_matches_by_tier(query) == oracle.find_matches_by_tier(query)
    assert stepped.writer.engine_hashes() == _engine_hashes(oracle)


class GrowsBesideItsWriter(RuleBasedStateMachine):
    """Streams of stores, removes and clears big enough to grow the table and both maps several times, with
    the helper's copies and rounds run whenever hypothesis says: every event fares as in the oracle, and
    every answer read, before and after each publication, is the oracle's."""

    def __init__(self) -> None:
        super().__init__()
        self.oracle = RadixIndex()
        self.shard = Stepped()
        self.next_hash = itertools.count(1)
        self.patch = pytest.MonkeyPatch()
        self.patch.setattr(growth_module, "COPY_CHUNK", 96)  # every copy in several calls, as a big table's

    def teardown(self) -> None:
        self.patch.undo()
        self.shard.close()

    def apply(self, event: Stored | Removed | Cleared) -> None:
        expected = error_kind(self.oracle, event.worker_id, event)
        assert self.shard.writer.apply(event) == expected, event

    def held(self, worker: int, tier: StorageTier) -> list[EngineHash]:
        return sorted(self.oracle.holdings().get(((worker, 0), tier), {}))

    @rule(
        worker=st.integers(1, 3),
        tier=st.sampled_from([StorageTier.DEVICE, StorageTier.HOST]),
        size=st.integers(1, 90),
        shared=st.integers(0, 30),
        data=st.data(),
    )
    def store(self, worker: int, tier: StorageTier, size: int, shared: int, data: st.DataObject):
        """A chain of new engine hashes; its first ``shared`` contents repeat a common prefix (one table
        slot for several workers), the rest are new."""
        held = self.held(worker, tier)
        parent = data.draw(st.none() | st.sampled_from(held), label="parent") if held else None
        blocks = tuple(
            StoredBlock(EngineHash(next(self.next_hash)), LocalHash(i if i < shared else 10**6 + next(self.next_hash)))
            for i in range(size)
        )
        self.apply(Stored(worker, parent, blocks, tier=tier))

    @rule(worker=st.integers(1, 3), tier=st.sampled_from([StorageTier.DEVICE, StorageTier.HOST]), data=st.data())
    def remove(self, worker: int, tier: StorageTier, data: st.DataObject):
        held = self.held(worker, tier)
        if held:
            chosen = data.draw(st.lists(st.sampled_from(held), max_size=40, unique=True), label="removed")
            self.apply(Removed(worker, tuple(chosen), tier=tier))

    @rule(worker=st.integers(1, 3))
    def clear(self, worker: int):
        self.apply(Cleared(worker))

    @precondition(lambda self: self.shard.writer.growing)
    @rule(steps=st.integers(1, 3))
    def helper_runs(self, steps: int):
        for _ in range(steps):
            self.shard.helper.step()

    @rule()
    def between_batches(self):
        self.shard.writer.advance()

    @invariant()
    def same_answers(self) -> None:
        """Every chain's longest path: the longest paths cover every slot a query can reach."""
        paths = {p for held in self.oracle.holdings().values() for p in held.values()}
        for path in [p for p in paths if not any(len(q) > len(p) and q[: len(p)] == p for q in paths)][:40]:
            assert self.shard.reader.find_matches_by_tier(path) == self.oracle.find_matches_by_tier(path)

    @invariant()
    def same_engine_map_once_settled(self) -> None:
        """Settling publishes every growth: what the maps then hold is what the oracle holds."""
        if self.shard.writer.growing and len(self.shard.helper.pending) > 2:
            self.shard.writer.settle()
            assert not self.shard.writer.growing
        assert self.shard.writer.engine_hashes() == _engine_hashes(self.oracle)


GrowsBesideItsWriter.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestGrowsBesideItsWriter = GrowsBesideItsWriter.TestCase


PACE: Final = 5
"""The writer waits for one more check by the reader every this many documents: the reads happen during the
growths, however the two processes are scheduled."""


def _burst(control_name_: str, owner: int, docs: int, checks: Synchronized[int]) -> None:
    """Writer process: a burst of new 64-block documents from 8 workers, flushed after each, until the table
    and the engine map have grown several times on the real helper threads."""
    control = Control.attach(control_name_, writable=True)
    control.set_pid(0, os.getpid())
    writer = ShardWriter(control, 0, owner, capacity=MIN_CAPACITY)
    for doc in range(docs):
        writer.apply(_chain(1 + doc % 8, doc * 64, 64))
        control.set_flushed(0, doc + 1)
        if doc % PACE == 0:
            seen, deadline = checks.value, time.monotonic() + 5
            while checks.value == seen and time.monotonic() < deadline:
                time.sleep(0)
    writer.settle()
    control.set_flushed(0, docs + 1)
    writer.close(unlink=False)  # the test unlinks what is left, as the supervisor does for a dead applier
    control.close()


@pytest.mark.timeout(120)
def test_readers_see_every_flushed_document_while_the_tables_grow_beside_the_writer():
    owner = next(_owners)
    control = Control.create(control_name(owner), 1)
    reader = IndexReader(control.name)
    docs = 600  # 38k keys from 1024 slots: five doublings of the table and of the engine map
    checks = FORK.Value("q", 0)
    writer = FORK.Process(target=_burst, args=(control.name, owner, docs, checks))
    rng = np.random.default_rng(7)
    try:
        assert reader.find_matches([1]) == {}
        writer.start()
        while (flushed := control.flushed(0)) <= docs:
            if flushed == 0:
                continue
            doc = int(rng.integers(0, flushed))  # any document flushed so far answers in full
            query = list(range(doc * 64, doc * 64 + 64))
            assert reader.find_matches(query) == {(1 + doc % 8, 0): 64}, doc
            checks.value += 1
        assert control.epoch(0) >= 6
        for doc in range(docs):
            assert reader.find_matches(list(range(doc * 64, doc * 64 + 64))) == {(1 + doc % 8, 0): 64}
    finally:
        if writer.pid is not None:
            writer.join(timeout=60)
        reader.close()
        remove_left_shard(control)
    assert writer.exitcode == 0
    assert checks.value > 100


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_helper_threads_run_as_batch_and_leave_the_writer_ordinary():
    helper = growth_module.Helper()
    try:
        assert helper.submit(os.sched_getscheduler, 0).result() == os.SCHED_BATCH
    finally:
        helper.close()
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
