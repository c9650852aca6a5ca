"""``Engine`` through real applier processes answers exactly as ``RadixIndex`` does, and cleans up after itself.

The oracle tests share one engine per shard count (a class-scoped fixture: starting appliers is the
slow part) and keep scenarios apart by giving each one a fresh range of worker ids, removed again at
its end. Application is asynchronous, so the contract replay sees the engine through an adapter that
flushes before every query and reads an event's error kind from the per-kind counters it moved.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvrouter.engine import TOUCH_QUEUE, Engine, EngineView, ReaderHandle, attach, default_shards
from kvrouter.errors import EVENT_ERROR_KINDS, BadEvent, ConfigError, EngineError, FlushTimeout, InvalidHashInput
from kvrouter.events.codecs.kvrouter import Encoder
from kvrouter.events.model import (
    Cleared,
    EngineHash,
    EventBatch,
    KvEvent,
    LocalHash,
    Removed,
    StorageTier,
    Stored,
    StoredBlock,
    WorkerKey,
)
from kvrouter.hashing import sequence_hashes_array
from kvrouter.index import RadixIndex
from kvrouter.index.dense import WorkerSlots, overlaps_from_tiers
from kvrouter.routing import Router
from kvrouter.routing.config import KVROUTER_CONFIG
from tests.index.contract import error_kind, replay

SHARD_COUNTS = (1, 2, 4)
ID_SPAN = 1000
"""Worker ids each scenario or example gets to itself: ``[offset, offset + ID_SPAN)``."""


class SharedEngine:
    """One running engine and the worker-id ranges handed out on it so far."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._ranges = itertools.count(1)

    def fresh_offset(self) -> int:
        return next(self._ranges) * ID_SPAN


@pytest.fixture(scope="class", params=SHARD_COUNTS, ids=lambda n: f"{n}shards")
def shared(request: pytest.FixtureRequest) -> Iterator[SharedEngine]:
    with Engine(shards=request.param) as engine:
        yield SharedEngine(engine)


def error_totals(engine: Engine) -> Counter[str]:
    totals: Counter[str] = Counter()
    for shard in engine.stats():
        totals.update(shard.errors)
    return totals


class EngineAsIndex:
    """The contract's synchronous interface over an engine, with worker ids shifted by ``offset``."""

    def __init__(self, engine: Engine, offset: int) -> None:
        self.engine = engine
        self.offset = offset
        self.workers: set[int] = set()

    def apply_event(self, worker_id: int, event: Any) -> None:
        self.workers.add(worker_id)
        before = error_totals(self.engine)
        self.engine.apply_event(worker_id + self.offset, event)  # BadEvent for an undecodable dict, at once
        self.engine.flush()
        moved = error_totals(self.engine) - before
        assert sum(moved.values()) <= 1, moved
        for kind in moved:
            raise EVENT_ERROR_KINDS[kind](f"counted by the applier: {kind}")

    def find_matches(self, local_hashes: list[int], early_exit: bool = False) -> dict[WorkerKey, int]:
        self.engine.flush()
        scores = self.engine.find_matches(local_hashes, early_exit)
        return {(worker - self.offset, rank): score for (worker, rank), score in scores.items()}

    def remove_worker(self, worker_id: int) -> None:
        self.workers.add(worker_id)
        self.engine.remove_worker(worker_id + self.offset)

    def clear_all_blocks(self, worker_id: int) -> None:
        self.workers.add(worker_id)
        self.engine.clear_all_blocks(worker_id + self.offset)

    def forget_all(self) -> None:
        """Remove every worker this scenario touched, so the next one starts from an empty index."""
        for worker_id in self.workers:
            self.engine.remove_worker(worker_id + self.offset)
        self.engine.flush()


# -- the oracle, on one engine per shard count ------------------------------------------------------

CONTENT = st.sampled_from([0, 1, 2, 3, 4, (1 << 64) - 1]).map(LocalHash)
"""Few local hashes (and the extremes), so paths branch and collide often."""
ANY_HASH = st.sampled_from([0, *range(1, 25), (1 << 64) - 1]).map(EngineHash)
"""A small pool of engine hashes, so hashes move between paths and unknown parents and blocks occur."""
WORKERS = st.integers(1, 6)
RANKS = st.integers(0, 2)
TIERS = st.sampled_from(list(StorageTier))
OPS = st.sampled_from(["store", "store", "store", "remove", "remove", "cleared", "batch", "clear", "drop", "check"])


class RandomStream:
    """One hypothesis example: events drawn against the reference's state, sent to both indexes."""

    def __init__(self, engine: Engine, offset: int, data: st.DataObject) -> None:
        self.engine = engine
        self.offset = offset
        self.data = data
        self.reference = RadixIndex()
        self.expected_errors: Counter[str] = Counter()
        engine.flush()  # an example hypothesis cut short may have left events in flight
        self.errors_before = error_totals(engine)
        self.event_ids = itertools.count()
        self.encoder = Encoder()

    def held(self, worker: int, rank: int, tier: StorageTier) -> list[EngineHash]:
        return sorted(self.reference.holdings().get(((worker, rank), tier), {}))

    def draw_event(self, worker: int, rank: int) -> KvEvent:
        draw = self.data.draw
        tier = draw(TIERS, label="tier")
        held = self.held(worker, rank, tier)
        kind = draw(st.sampled_from(["store", "store", "remove", "cleared"]), label="event")
        event_id = next(self.event_ids)
        if kind == "store":
            parent = draw(st.none() | st.sampled_from(held) | ANY_HASH if held else st.none() | ANY_HASH)
            blocks = draw(st.lists(st.builds(StoredBlock, ANY_HASH, CONTENT), max_size=4), label="blocks")
            return Stored(worker, parent, tuple(blocks), dp_rank=rank, event_id=event_id, tier=tier)
        if kind == "remove":
            known = draw(st.lists(st.sampled_from(held), max_size=3, unique=True)) if held else []
            unknown = draw(st.lists(ANY_HASH, max_size=1), label="maybe unknown")
            return Removed(worker, tuple(known + unknown), dp_rank=rank, event_id=event_id, tier=tier)
        return Cleared(worker, dp_rank=rank, event_id=event_id, tier=tier)

    def to_reference(self, event: KvEvent) -> None:
        kind = error_kind(self.reference, event.worker_id, event)
        if kind is not None:
            self.expected_errors[kind] += 1

    def step(self) -> None:
        draw = self.data.draw
        op = draw(OPS, label="op")
        worker = self.offset + draw(WORKERS, label="worker")
        if op == "clear":
            self.reference.clear_all_blocks(worker)
            self.engine.clear_all_blocks(worker)
        elif op == "drop":
            self.reference.remove_worker(worker)
            self.engine.remove_worker(worker)
        elif op == "check":
            self.check()
        elif op == "batch":  # several events in one pre-encoded batch: the fast path
            rank = draw(RANKS, label="rank")
            events = []
            for _ in range(draw(st.integers(1, 4), label="batch size")):
                event = self.draw_event(worker, rank)
                self.to_reference(event)  # drawn against the state the earlier events of the batch left
                events.append(event)
            self.engine.apply_payload((worker, rank), self.encoder.encode(EventBatch(tuple(events), dp_rank=rank)))
        else:
            event = self.draw_event(worker, draw(RANKS, label="rank"))
            self.to_reference(event)
            self.engine.apply_event(worker, event)

    def ours(self, scores: Mapping[WorkerKey, int]) -> dict[WorkerKey, int]:
        return {key: score for key, score in scores.items() if self.offset <= key[0] < self.offset + ID_SPAN}

    def check(self) -> None:
        self.engine.flush()
        held = [path for lookup in self.reference.holdings().values() for path in lookup.values()]
        paths = {path[:n] for path in held for n in range(1, len(path) + 1)}
        extra = self.data.draw(st.lists(CONTENT, max_size=5), label="extra query")
        numbered = self.data.draw(st.lists(st.tuples(WORKERS, RANKS), max_size=12), label="slots")
        slots = WorkerSlots((self.offset + worker, rank) for worker, rank in numbered)
        ntiers = self.data.draw(st.integers(1, len(StorageTier)), label="ntiers")
        for query in sorted(paths | {tuple(extra)}):
            assert self.ours(self.engine.find_matches(query)) == self.reference.find_matches(query), query
            by_tier = self.engine.find_matches_by_tier(query)
            expected = self.reference.find_matches_by_tier(query)
            assert {tier: self.ours(scores) for tier, scores in by_tier.items()} == expected, query
            dense = self.engine.overlaps(np.array(query, dtype=np.uint64), slots, ntiers)
            assert np.array_equal(dense, overlaps_from_tiers(expected, slots, ntiers)), (query, ntiers)
        assert error_totals(self.engine) - self.errors_before == self.expected_errors

    def forget_all(self) -> None:
        for worker in range(self.offset, self.offset + ID_SPAN // 100):
            self.engine.remove_worker(worker)
        self.engine.flush()


class TestAgainstReference:
    @pytest.mark.timeout(300)
    def test_contract_scenario(self, shared: SharedEngine, contract_scenario: dict[str, Any]):
        """Every op of every scenario: the expected error kind, or exactly the expected score list."""
        index = EngineAsIndex(shared.engine, shared.fresh_offset())
        try:
            for where, got, expected in replay(index, contract_scenario):
                assert got == expected, where
        finally:
            index.forget_all()

    @pytest.mark.timeout(600)
    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_random_streams(self, shared: SharedEngine, data: st.DataObject):
        """Random streams (dp ranks, tiers, moves, unknown parents and blocks, clears, worker removals,
        multi-event batches) leave the engine answering every query, per tier, as the reference does,
        with the same errors counted; ``overlaps`` over a random numbering answers the same as arrays."""
        stream = RandomStream(shared.engine, shared.fresh_offset(), data)
        try:
            for _ in range(data.draw(st.integers(1, 40), label="ops")):
                stream.step()
            stream.check()
        finally:
            stream.forget_all()

    @pytest.mark.timeout(120)
    def test_reader_in_another_process(self, shared: SharedEngine):
        """A pickled handle attached in a freshly spawned interpreter answers as the engine does."""
        engine, offset = shared.engine, shared.fresh_offset()
        queries = _store_some(engine, offset)
        handle = pickle.loads(pickle.dumps(engine.reader_handle()))
        assert handle == engine.reader_handle()
        spawn = multiprocessing.get_context("spawn")
        receiving, sending = spawn.Pipe(duplex=False)
        child = spawn.Process(target=_query_in_child, args=(handle, queries, sending))
        child.start()
        try:
            sending.close()
            theirs = receiving.recv()
        finally:
            child.join(60)
        assert child.exitcode == 0
        assert theirs == [(engine.find_matches(q), engine.find_matches_by_tier(q)) for q in queries]
        assert any(found for found, _ in theirs)
        for worker in range(offset, offset + 4):
            engine.remove_worker(worker)


def _store_some(engine: Engine, offset: int) -> list[list[int]]:
    """Four workers with overlapping chains in several tiers; returns queries that hit them."""
    for i, tier in enumerate(StorageTier):
        worker = offset + i
        blocks = tuple(StoredBlock(EngineHash(100 + h), LocalHash(h)) for h in range(1, 3 + i))
        engine.apply_event(worker, Stored(worker, None, blocks, dp_rank=i % 2, tier=tier))
        engine.apply_event(worker, Stored(worker, None, blocks[:2]))
    engine.flush()
    return [[1], [1, 2, 3], [1, 2, 3, 4, 5, 6], [9]]


def _query_in_child(handle: ReaderHandle, queries: Sequence[Sequence[int]], conn: Connection) -> None:
    reader = attach(handle)
    try:
        conn.send([(reader.find_matches(q), reader.find_matches_by_tier(q)) for q in queries])
    finally:
        reader.close()
        conn.close()


# -- lifetime, each test with an engine of its own --------------------------------------------------


def _leftover_sockets() -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"kvrouter-{os.getpid()}-*"))


@pytest.mark.timeout(120)
def test_nothing_is_left_behind_after_close(shm_entries: Callable[[int], list[str]]):
    with Engine(shards=2) as engine:
        chain = tuple(StoredBlock(EngineHash(h), LocalHash(h)) for h in range(1, 3000))
        engine.apply_event(7, Stored(7, None, chain))
        engine.flush()
        assert engine.find_matches([1, 2, 3]) == {(7, 0): 3}
        assert shm_entries(os.getpid())
    assert shm_entries(os.getpid()) == []
    assert _leftover_sockets() == []


@pytest.mark.timeout(120)
def test_nothing_is_left_behind_after_an_exception_in_the_with(shm_entries: Callable[[int], list[str]]):
    def fail_inside() -> None:
        with Engine(shards=2) as engine:
            engine.apply_event(1, Stored(1, None, (StoredBlock(EngineHash(1), LocalHash(1)),)))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside()
    assert shm_entries(os.getpid()) == []
    assert _leftover_sockets() == []


@pytest.mark.timeout(120)
def test_one_engine_per_process_and_the_first_keeps_working():
    with Engine(shards=1) as engine:
        with pytest.raises(EngineError, match="another engine"):
            Engine(shards=1).start()
        engine.apply_event(1, Stored(1, None, (StoredBlock(EngineHash(1), LocalHash(5)),)))
        engine.flush()
        assert engine.find_matches([5]) == {(1, 0): 1}


@pytest.mark.timeout(120)
def test_caller_errors_raise_at_once_and_nothing_is_sent():
    with Engine(shards=1) as engine:
        with pytest.raises(BadEvent, match="event_id"):
            engine.apply_event(1, {"data": "cleared"})
        with pytest.raises(BadEvent, match="of worker 2 applied as worker 1"):
            engine.apply_event(1, Cleared(2))
        with pytest.raises(BadEvent):
            engine.apply_event(1, Stored(1, None, (StoredBlock(EngineHash(-1), LocalHash(1)),)))
        engine.flush()
        assert engine.stats()[0].events_applied == 0
    with pytest.raises(EngineError, match="not running"):
        engine.find_matches([1])
    with pytest.raises(EngineError, match="not running"):
        Engine(shards=1).apply_event(1, Cleared(1))


@pytest.mark.timeout(120)
def test_lists_the_kernel_refuses_are_answered_or_refused_as_the_reader_does():
    """``Engine.find_matches`` answers a list itself (``ListMatch``); a list the kernel does not convert
    (longer than the reader's query buffer, or an item outside u64) goes on through the reader."""
    from kvrouter.index.reader import SCRATCH_BLOCKS

    long = SCRATCH_BLOCKS + 10
    with Engine(shards=1) as engine:
        chain = tuple(StoredBlock(EngineHash(10 + h), LocalHash(h)) for h in range(1, long + 1))
        engine.apply_event(1, Stored(1, None, chain))
        engine.flush()
        assert engine.find_matches(list(range(1, long + 1))) == {(1, 0): long}
        for bad in ([1, -1], [1, 2**64], [1, "2"]):
            with pytest.raises(InvalidHashInput):
                engine.find_matches(bad)  # type: ignore[arg-type]
        assert engine.find_matches([1, 2]) == {(1, 0): 2}


@pytest.mark.timeout(120)
def test_runs_ending_in_the_second_mask_word_are_scored_where_they_end():
    """70 workers widen a shard's masks to two words; three of them hold one prefix to different depths,
    one in the first word and two in the second. After the first block the walk reads only the columns
    with a worker left: each run must still end where the worker's blocks end, as the oracle says."""
    prefix = list(range(501, 511))
    held = {1: 10, 66: 6, 70: 3}
    oracle = RadixIndex()
    with Engine(shards=1) as engine:
        for worker in range(1, 71):  # first events in id order: worker w gets bit w - 1
            own = Stored(worker, None, (StoredBlock(EngineHash(100_000 + worker), LocalHash(90_000 + worker)),))
            engine.apply_event(worker, own)
            oracle.apply_event(worker, own)
        for worker, depth in held.items():
            chain = tuple(StoredBlock(EngineHash(1000 * worker + h), LocalHash(h)) for h in prefix[:depth])
            engine.apply_event(worker, Stored(worker, None, chain))
            oracle.apply_event(worker, Stored(worker, None, chain))
        engine.flush()
        assert engine.find_matches(prefix) == oracle.find_matches(prefix) == {(w, 0): d for w, d in held.items()}
        assert engine.find_matches_by_tier(prefix) == oracle.find_matches_by_tier(prefix)


@pytest.mark.timeout(120)
def test_a_router_that_decided_on_an_engine_raises_once_the_engine_closed():
    """The router keeps the engine's decision walk (the reader's ``overlaps_and``) between decisions: after
    the close it must refuse, not walk unmapped segments; before the start it refuses as every query does."""
    router = Router(KVROUTER_CONFIG, block_size=16, seed=1)
    local = np.array([11, 12, 13], dtype=np.uint64)
    unstarted = Engine(shards=1)
    with pytest.raises(EngineError, match="not running"):
        router.select(unstarted, ((1, 0),), local_hashes=local)
    with Engine(shards=1) as engine:
        engine.apply_event(1, Stored(1, None, tuple(StoredBlock(EngineHash(h), LocalHash(h)) for h in (11, 12))))
        engine.flush()
        assert router.select(engine, ((1, 0), (2, 0)), local_hashes=local).worker == (1, 0)
    with pytest.raises(EngineError, match="not running"):
        router.select(engine, ((1, 0), (2, 0)), local_hashes=local)


@pytest.mark.timeout(120)
def test_flush_times_out_while_an_applier_is_stopped_and_succeeds_after():
    with Engine(shards=2) as engine:
        pid = engine.stats()[1].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(FlushTimeout, match=r"shards \{1: 'up'\}"):
                engine.flush(timeout=0.2)
        finally:
            os.kill(pid, signal.SIGCONT)
        engine.flush()
        assert [s.restarts for s in engine.stats()] == [0, 0]


@pytest.mark.timeout(120)
def test_stats_name_status_segment_and_workers():
    with Engine(shards=2) as engine:
        for worker in (1, 2, 3):
            engine.apply_event(worker, Stored(worker, None, (StoredBlock(EngineHash(9), LocalHash(worker)),)))
        engine.apply_event(1, Removed(1, (EngineHash(8),)))
        engine.flush()
        stats = engine.stats()
        words_only = engine.stats(workers=False)
    assert words_only == [dataclasses.replace(s, workers={}) for s in stats]  # the shards' words, no row read
    assert [s.status for s in stats] == ["up", "up"]
    assert [s.workers for s in stats] == [{(1, 0): 1, (3, 0): 1}, {(2, 0): 1}]
    assert [s.errors["block_not_found"] for s in stats] == [1, 0]
    assert [s.events_applied for s in stats] == [3, 1]
    assert all(s.segment.startswith(f"kvrouter-{os.getpid()}-s{s.shard}-") and s.pid > 0 for s in stats)


def test_default_shards_follow_the_core_count(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert default_shards() == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert default_shards() == 4
    assert Engine().shards == 4
    with pytest.raises(ConfigError, match="shards"):
        Engine(shards=0)


# -- forks of the engine's process ------------------------------------------------------------------

FORKED_CHILDREN = """
import multiprocessing, os, sys
from kvrouter.engine import Engine
from kvrouter.events.model import EngineHash, LocalHash, Stored, StoredBlock

engine = Engine(shards=1).start()
engine.apply_event(1, Stored(1, None, (StoredBlock(EngineHash(1), LocalHash(5)),)))
engine.flush()
appliers = [s.pid for s in engine.stats()]
child = os.fork()
if child == 0:
    engine.close()  # an explicit close in the child, then a normal exit: the atexit hook runs too
    sys.exit(0)
assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
process = multiprocessing.get_context("fork").Process(target=engine.close)
process.start()
process.join()
assert process.exitcode == 0
engine.apply_event(1, Stored(1, EngineHash(1), (StoredBlock(EngineHash(2), LocalHash(6)),)))
engine.flush()
assert engine.find_matches([5, 6]) == {(1, 0): 2}, engine.find_matches([5, 6])
assert [s.pid for s in engine.stats()] == appliers
assert [s.restarts for s in engine.stats()] == [0]
print("parent ok", flush=True)
sys.exit(0)  # the parent's own normal exit: the atexit hook closes its engine
"""


@pytest.mark.timeout(120)
def test_a_forked_child_that_closes_or_exits_leaves_the_parents_engine_alone(
    shm_entries: Callable[[int], list[str]],
):
    """The engine's process forks (``os.fork`` and a multiprocessing fork child); the children close the
    inherited engine and exit normally, running the ``atexit`` hook. The parent's appliers, segments and
    sockets are untouched: it keeps applying and answering. Its own exit then removes everything."""
    with subprocess.Popen(
        [sys.executable, "-c", FORKED_CHILDREN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as parent:
        try:
            out, err = parent.communicate(timeout=110)
        finally:
            parent.kill()
    assert parent.returncode == 0, err
    assert out.strip() == "parent ok"
    assert shm_entries(parent.pid) == []
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"kvrouter-{parent.pid}-*")) == []


def test_a_view_reads_the_empty_shards_while_the_appliers_start():
    """``kvrouter up`` compiles its front's kernels on such a view while the fork server compiles the
    appliers': before ``finish_start`` the handle is valid and the view answers as an empty index does,
    then sees what the appliers apply."""
    engine = Engine(shards=2)
    with pytest.raises(EngineError, match="not started"):
        engine.reader_handle()
    engine.start(wait=False)
    try:
        view = EngineView(engine.reader_handle())
        try:
            assert view.find_matches([1, 2, 3]) == {}
            slots = WorkerSlots()
            slot = slots.slot((1, 0))
            out = view.overlaps(np.array([1, 2, 3], dtype=np.uint64), slots, 1)
            assert out[:, slot].tolist() == [0]
            chosen = Router(KVROUTER_CONFIG, block_size=16, seed=0).select(view, ((1, 0),), tokens=list(range(64)))
            assert (chosen.worker, chosen.overlap_blocks) == ((1, 0), 0)
            engine.finish_start()
            engine.apply_event(1, Stored(1, None, (StoredBlock(EngineHash(1), LocalHash(1)),)))
            engine.flush()
            assert view.find_matches([1, 2, 3]) == {(1, 0): 1}
        finally:
            view.close()
    finally:
        engine.close()


def test_an_engine_view_feeds_the_cap_from_its_own_socket_and_never_waits(wait_until: Callable[..., None]):
    """What another front of ``--fronts N`` does with its decisions' matches: the owning applier stamps
    them as the owner's own ``touch`` would; with no applier listening, the message is dropped and counted
    at once rather than waited for."""
    local = [11, 12, 13, 14]
    blocks = tuple(StoredBlock(EngineHash(100 + i), LocalHash(h)) for i, h in enumerate(local))
    seqs = sequence_hashes_array(np.array(local, dtype=np.uint64))
    with Engine(shards=1, max_index_blocks=1000) as engine:
        engine.apply_event(1, Stored(1, None, blocks))
        engine.flush()
        view = EngineView(engine.reader_handle(), engine.applier_endpoints())
        try:
            view.touch((1, 0), seqs)
            wait_until(lambda: engine.stats()[0].touched == len(local), timeout=10, what="the view's touch stamped")
            view.touch((2, 0), seqs)  # a worker no shard has a row for: nothing to send
            assert view.touches_dropped == 0
        finally:
            view.close()
        nobody = EngineView(engine.reader_handle(), ("ipc:///nonexistent/kvrouter-test/shard-0.sock",))
        try:
            for _ in range(TOUCH_QUEUE + 1):
                nobody.touch((1, 0), seqs)
            assert nobody.touches_dropped == 1  # the queue filled; the last one was dropped, not waited for
        finally:
            nobody.close()
        assert engine.stats()[0].touched == len(local)
