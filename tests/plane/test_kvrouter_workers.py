"""kvrouter-format workers followed over real sockets: a ``KvPublisher`` in this process (the engine), the
shared-memory engine's applier in its own (the router). After each scenario the index answers, for every
block the publisher holds, exactly what the publisher's own index answers: the truth."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvrouter import Engine, KvPublisher, RadixIndex
from kvrouter.engine import WorkerStats
from kvrouter.events.model import WorkerKey
from kvrouter.plane import PlaneConfig, WorkerSpec
from kvrouter.plane.stream import TAIL_CHECK_S

BLOCK = 4
WORKER = 5
KEY: WorkerKey = (WORKER, 0)


def held_paths(truth: RadixIndex) -> list[tuple[int, ...]]:
    return [path for held in truth.holdings().values() for path in held.values()]


def matches_truth(engine: Engine, truth: RadixIndex, key: WorkerKey = KEY) -> bool:
    """Every path the truth holds scores the same for ``key`` in the engine (and nothing else is held)."""
    paths = held_paths(truth)
    stats = engine.workers().get(key)
    if stats is None or stats.state == "restoring" or stats.cached_blocks != truth.block_counts().get(key, 0):
        return False
    return all(engine.find_matches(list(p)).get(key, 0) == truth.find_matches(list(p)).get(key, 0) for p in paths)


class StepEngine:
    """A publisher with a random workload: chains of blocks stored under each other, evictions, clears."""

    def __init__(self, publisher: KvPublisher, seed: int) -> None:
        self.publisher = publisher
        self.rng = random.Random(seed)
        self.next_hash = 1000
        self.leaves: list[int] = []

    def step(self, *, send: bool = True) -> None:
        rng = self.rng
        if self.leaves and rng.random() < 0.3:
            victims = rng.sample(self.leaves, min(len(self.leaves), rng.randint(1, 3)))
            for victim in victims:
                self.leaves.remove(victim)
            self.publisher.remove(victims)
        else:
            parent = rng.choice(self.leaves) if self.leaves and rng.random() < 0.5 else None
            count = rng.randint(1, 4)
            hashes = list(range(self.next_hash, self.next_hash + count))
            self.next_hash += count
            tokens = [rng.randrange(1 << 32) for _ in range(count * BLOCK)]
            self.publisher.store(hashes, tokens, parent=parent)
            self.leaves.append(hashes[-1])
        self.publisher.publish(send=send)


@pytest.fixture
def publisher() -> Iterator[KvPublisher]:
    with KvPublisher(
        WORKER, block_size=BLOCK, endpoint="tcp://127.0.0.1:*", query_endpoint="tcp://127.0.0.1:*", buffer_events=16
    ) as pub:
        yield pub


def spec_of(publisher: KvPublisher) -> WorkerSpec:
    return WorkerSpec(
        WORKER, publisher.endpoint, format="kvrouter", query_endpoint=publisher.query_endpoint, block_size=BLOCK
    )


def caught_up(engine: Engine, publisher: KvPublisher) -> Callable[[], bool]:
    """The router applied the publisher's last event and nothing is in flight for the worker."""

    def done() -> bool:
        stats = worker(engine)
        return stats.last_id == publisher.last_event_id and stats.state != "restoring"

    return done


def accounted(engine: Engine, publisher: KvPublisher, before: WorkerStats | None = None) -> Callable[[], bool]:
    """:func:`caught_up`, and every gap detected (since ``before``) has ended ``recovered`` or ``lost``. The
    stream writes a gap's outcome after the batches that close it (``_finish`` after the apply), so a
    reader can see the last id before the count: waiting for the ids alone raced the count (CI, once)."""
    applied = caught_up(engine, publisher)

    def done() -> bool:
        if not applied():
            return False
        now = worker(engine)
        then = (0, 0, 0) if before is None else (before.gaps_detected, before.gaps_recovered, before.gaps_lost)
        ended = now.gaps_recovered - then[1] + now.gaps_lost - then[2]
        return now.gaps_detected - then[0] == ended

    return done


def follow(engine: Engine, publisher: KvPublisher, steps: StepEngine, events: int, what: str) -> None:
    """Register the worker, wait for its join, then publish ``events`` steps and wait until they are applied."""
    engine.add_worker(spec_of(publisher))
    pump(publisher, lambda: worker(engine).state == "exact", "the join")
    for _ in range(events):
        steps.step()
    pump(publisher, caught_up(engine, publisher), what)


def pump(publisher: KvPublisher, condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Answer the router's queries (the engine's loop would) until ``condition`` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        publisher.serve(5)


def worker(engine: Engine) -> WorkerStats:
    """The worker's row, once its applier has registered it (the registration is asynchronous)."""
    for _ in range(10_000):
        stats = engine.workers().get(KEY)
        if stats is not None:
            return stats
        time.sleep(0.001)
    pytest.fail(f"worker {KEY} never registered")


def test_a_worker_joining_late_is_restored_from_its_dump_then_follows_live(publisher: KvPublisher):
    engine_ = StepEngine(publisher, seed=1)
    for _ in range(40):  # history before the router knew the worker: only a dump can bring it
        engine_.step()
    with Engine(shards=1) as engine:
        engine.add_worker(spec_of(publisher))
        pump(publisher, lambda: matches_truth(engine, publisher.index), "the join restore")
        for _ in range(20):
            engine_.step()
        pump(publisher, accounted(engine, publisher), "live events")
        assert matches_truth(engine, publisher.index)
        stats = worker(engine)
        assert (stats.state, stats.gaps_lost) == ("exact", 0)
        assert stats.gaps_detected == stats.gaps_recovered  # a slow joiner's first live events may be missed


@pytest.mark.parametrize("dropped", [3, 40], ids=["in-ring", "older-than-ring"])
def test_batches_lost_on_the_wire_are_recovered_by_query(publisher: KvPublisher, dropped: int):
    """A range still in the ring comes back as Events; one older than the ring as a TreeDump."""
    engine_ = StepEngine(publisher, seed=2)
    with Engine(shards=1) as engine:
        follow(engine, publisher, engine_, 1, "the first event")
        before = worker(engine)
        for _ in range(dropped):
            engine_.step(send=False)
        engine_.step()
        pump(publisher, accounted(engine, publisher, before), "the recovery")
        assert matches_truth(engine, publisher.index)
        stats = worker(engine)
        assert stats.gaps_detected - before.gaps_detected == 1
        assert (stats.gaps_recovered - before.gaps_recovered, stats.gaps_lost, stats.state) == (1, 0, "exact")


@pytest.mark.parametrize("dropped", [3, 40], ids=["in-ring", "older-than-ring"])
def test_the_last_batches_before_a_silence_are_fetched_by_the_quiet_tail_check(publisher: KvPublisher, dropped: int):
    """No later batch reveals these gaps: the stream, quiet for ``TAIL_CHECK_S``, asks the local indexer for
    what follows its cursor (Events from the ring, or a TreeDump once the ring no longer reaches back), as
    after a NATS relay's reconnection. A quiet stream that lost nothing is asked too, and nothing changes."""
    engine_ = StepEngine(publisher, seed=4)
    with Engine(shards=1) as engine:
        follow(engine, publisher, engine_, 1, "the first event")
        quiet_until = time.monotonic() + TAIL_CHECK_S + 1.0
        pump(publisher, lambda: time.monotonic() > quiet_until, "a quiet period with nothing lost")
        before = worker(engine)
        assert (before.gaps_detected, before.state) == (0, "exact")
        for _ in range(dropped):
            engine_.step(send=False)
        pump(publisher, accounted(engine, publisher, before), "the tail check")
        assert matches_truth(engine, publisher.index)
        stats = worker(engine)
        assert stats.gaps_detected - before.gaps_detected == 1
        assert (stats.gaps_recovered - before.gaps_recovered, stats.gaps_lost, stats.state) == (1, 0, "exact")


def test_a_batch_arriving_while_a_tail_check_goes_unanswered_is_applied_at_once(publisher: KvPublisher):
    """The worker stops answering queries (nothing serves its query socket) and goes quiet, so the stream's
    tail check waits for an answer; the next batch, in order, is applied without waiting for the check's
    30 s timeout, and nothing is counted lost or partial."""
    engine_ = StepEngine(publisher, seed=5)
    with Engine(shards=1, plane=PlaneConfig(recovery_timeout=30.0)) as engine:
        follow(engine, publisher, engine_, 1, "the first event")
        time.sleep(TAIL_CHECK_S + 0.5)  # the check is asked, and left unanswered
        engine_.step()
        deadline = time.monotonic() + 10.0
        while not caught_up(engine, publisher)():
            assert time.monotonic() < deadline, "the batch waited behind the unanswered tail check"
            time.sleep(0.01)
        assert matches_truth(engine, publisher.index)
        stats = worker(engine)
        assert (stats.gaps_detected, stats.gaps_lost, stats.state) == (0, 0, "exact")


def test_an_engine_restart_is_a_fresh_worker_state(publisher: KvPublisher):
    engine_ = StepEngine(publisher, seed=3)
    with Engine(shards=1) as engine:
        follow(engine, publisher, engine_, 10, "the first life")
        assert worker(engine).cached_blocks > 0
        publisher.reset()
        engine_.leaves.clear()
        for _ in range(3):
            engine_.step()
        pump(publisher, lambda: worker(engine).restarts == 1, "the restart seen")
        pump(publisher, caught_up(engine, publisher), "the second life")
        assert matches_truth(engine, publisher.index)
        assert worker(engine).state == "exact"


def test_a_restart_whose_first_batches_were_lost_is_told_from_a_late_copy_by_asking_the_worker(
    publisher: KvPublisher,
):
    """Ids behind the cursor but not from 0: the worker's local indexer answers TooNew, so it did restart."""
    engine_ = StepEngine(publisher, seed=5)
    with Engine(shards=1) as engine:
        follow(engine, publisher, engine_, 20, "the first life")
        publisher.reset()
        engine_.leaves.clear()
        for _ in range(3):  # the new incarnation's first batches never arrive
            engine_.step(send=False)
        engine_.step()
        pump(publisher, lambda: worker(engine).restarts == 1, "the restart seen")
        pump(publisher, caught_up(engine, publisher), "the second life")
        assert matches_truth(engine, publisher.index)
        assert worker(engine).state == "exact"


@pytest.fixture
def silent_peer() -> Iterator[str]:
    """A ROUTER that takes requests and never answers: a worker whose indexer hangs."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind("tcp://127.0.0.1:*")
    yield socket.getsockopt_string(zmq.LAST_ENDPOINT)
    socket.close(linger=0)
    context.term()


def test_a_local_indexer_that_never_answers_times_out_into_partial_never_a_hang(
    publisher: KvPublisher, silent_peer: str, wait_until
):
    engine_ = StepEngine(publisher, seed=4)
    spec = WorkerSpec(WORKER, publisher.endpoint, format="kvrouter", query_endpoint=silent_peer, block_size=BLOCK)
    config = PlaneConfig(recovery_timeout=0.3, restore_retry=0.3)
    with Engine(shards=1, plane=config) as engine:
        engine.add_worker(spec)
        wait_until(lambda: worker(engine).state == "partial", what="the restore given up")
        for _ in range(5):  # live events keep flowing meanwhile
            engine_.step()
        wait_until(lambda: worker(engine).events >= 1, what="live events applied while partial")
        assert engine.stats()[0].status == "up"
        engine.flush()  # the applier still serves its supervisor


def test_a_silent_worker_is_reported_stale_then_heard_again(publisher: KvPublisher, wait_until):
    engine_ = StepEngine(publisher, seed=5)
    with Engine(shards=1, plane=PlaneConfig(stale_after=0.3)) as engine:
        engine.add_worker(spec_of(publisher))
        pump(publisher, lambda: worker(engine).stale, "stale")
        engine_.step()
        pump(publisher, lambda: not worker(engine).stale, "heard again")


def test_a_removed_worker_leaves_the_index_at_once(publisher: KvPublisher, wait_until):
    engine_ = StepEngine(publisher, seed=6)
    with Engine(shards=1) as engine:
        engine.add_worker(spec_of(publisher))
        for _ in range(5):
            engine_.step()
        pump(publisher, caught_up(engine, publisher), "events")
        engine.remove_worker(WORKER)
        engine.flush()
        assert KEY not in engine.workers()
        assert all(not engine.find_matches(list(p)) for p in held_paths(publisher.index))
        assert engine.followed() == []


def test_a_restarted_applier_rebuilds_its_workers_then_leaves_recovering(publisher: KvPublisher, wait_until):
    engine_ = StepEngine(publisher, seed=7)
    with Engine(shards=1) as engine:
        engine.add_worker(spec_of(publisher))
        for _ in range(30):
            engine_.step()
        pump(publisher, caught_up(engine, publisher), "events")
        before = engine.stats()[0]
        os.kill(before.pid, signal.SIGKILL)
        pump(publisher, lambda: engine.stats()[0].restarts == 1, "the restart")
        for _ in range(5):  # the engine goes on while the shard is rebuilt
            engine_.step()
        pump(publisher, lambda: engine.stats()[0].status == "up" and caught_up(engine, publisher)(), "the rebuild")
        assert matches_truth(engine, publisher.index)
        stats = worker(engine)
        assert (stats.state, stats.gaps_lost) == ("exact", 0)


def test_a_batch_naming_another_worker_is_refused_on_this_stream(wait_until):
    """Worker 5's socket carries a batch that says it is worker 6's: an unknown worker here, refused."""
    with (
        KvPublisher(6, block_size=BLOCK, endpoint="tcp://127.0.0.1:*") as impostor,
        Engine(shards=1) as engine,
    ):
        engine.add_worker(WorkerSpec(WORKER, impostor.endpoint, format="kvrouter", block_size=BLOCK))
        wait_until(lambda: KEY in engine.workers(), what="the worker registered")

        def refused() -> bool:  # the subscription may take a moment: publish until one lands
            impostor.store([1], [1, 2, 3, 4])
            impostor.publish()
            return worker(engine).bad_frames > 0

        wait_until(refused, what="a batch of worker 6 refused")
        stats = worker(engine)
        assert (stats.events, stats.cached_blocks, stats.last_id) == (0, 0, None)
        assert (6, 0) not in engine.workers()


def test_a_copy_already_in_a_dump_arriving_after_it_is_skipped_not_taken_for_a_restart(publisher: KvPublisher):
    """A relay (as the NATS one is) delivers a batch late, after the dump that answered the gap before it
    already held it: the router skips the copy, and counts no engine restart nor clears the worker."""
    engine_ = StepEngine(publisher, seed=4)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    tap, relay = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
    try:
        tap.setsockopt(zmq.SUBSCRIBE, b"")
        tap.connect(publisher.endpoint)
        relay.bind("tcp://127.0.0.1:*")
        spec = WorkerSpec(
            WORKER,
            relay.getsockopt_string(zmq.LAST_ENDPOINT),
            format="kvrouter",
            query_endpoint=publisher.query_endpoint,
            block_size=BLOCK,
        )

        def step(*, send: bool = True) -> list[list[bytes]]:
            """One engine step; what the relay received of it (nothing when the engine dropped it)."""
            engine_.step(send=send)
            frames = []
            while send and tap.poll(2000):
                frames.append(tap.recv_multipart())
                if not tap.poll(0):
                    break
            return frames

        with Engine(shards=1) as engine:
            engine.add_worker(spec)
            if not any(step() for _ in range(50)):  # the tap's subscription takes a moment
                pytest.fail("the relay's tap never received a batch")
            pump(publisher, lambda: worker(engine).state == "exact", "the join")
            for _ in range(3):
                for frame in step():
                    relay.send_multipart(frame)
            pump(publisher, caught_up(engine, publisher), "live events through the relay")
            for _ in range(40):  # older than the ring: the gap comes back as a dump
                step(send=False)
            held = step()  # the relay holds this one back
            assert held
            for frame in step():
                relay.send_multipart(frame)
            pump(publisher, caught_up(engine, publisher), "the dump")
            before = worker(engine)
            for frame in held:  # now the late copy, ids the dump already holds
                relay.send_multipart(frame)
            for frame in step():
                relay.send_multipart(frame)
            pump(publisher, caught_up(engine, publisher), "live events after the copy")
            assert matches_truth(engine, publisher.index)
            stats = worker(engine)
            assert (stats.restarts, stats.state) == (before.restarts, "exact") == (0, "exact")
    finally:
        tap.close(linger=0)
        relay.close(linger=0)


def test_a_restart_while_a_gap_is_recovered_drops_the_old_lifes_buffered_batches(publisher: KvPublisher):
    """A gap's query is in flight, the batches after the gap wait in the buffer, and the engine restarts
    before it answers. Its local indexer then answers for the new life, whose ids are far below those
    buffered batches: they are the old life's, and must go. Kept, each drain took the first of them for a
    new gap, asked again, and the worker stayed restoring for ever (a chaos run under load met it)."""
    engine_ = StepEngine(publisher, seed=11)
    with Engine(shards=1) as engine:
        follow(engine, publisher, engine_, 20, "the first life")
        engine_.step(send=False)  # lost on the wire: the next batch opens a gap and a query
        for _ in range(3):
            engine_.step()  # the old life's batches after the gap, buffered while the query waits
        time.sleep(0.5)  # they reach the router; nothing answers its query yet
        publisher.reset()
        engine_.leaves.clear()
        for _ in range(3):
            engine_.step()  # the new life's first batches, far below the buffered ones
        pump(publisher, caught_up(engine, publisher), "the second life", timeout=30)
        assert matches_truth(engine, publisher.index)
        assert worker(engine).state == "exact"
        assert worker(engine).restarts >= 1  # 2 here: the new life's batch 0, buffered, counts once more
