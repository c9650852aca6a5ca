"""The supervisor restarts dead appliers behind a fence, keeps each shard's workers, and removes everything.

Every test owns its engine (one per process at a time) and checks ``/dev/shm`` is clean at the end.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from collections.abc import Callable

import pytest

from kvrouter.engine import Engine, ShardStats
from kvrouter.errors import EngineError
from kvrouter.events.codecs.kvrouter import Encoder
from kvrouter.events.model import EngineHash, EventBatch, LocalHash, Stored, StoredBlock
from kvrouter.index import supervisor as supervisor_module
from kvrouter.index.applier import flush_frames
from kvrouter.index.layout import STATUS_STARTING, STATUS_UP, lock_path
from kvrouter.index.supervisor import MAX_START_FAILURES, Supervisor

WaitUntil = Callable[..., None]


def chain(worker: int, hashes: list[int], *, parent: int | None = None) -> Stored:
    """A store whose engine hashes are ``100 + local hash``, so tests can name blocks."""
    blocks = tuple(StoredBlock(EngineHash(100 + h), LocalHash(h)) for h in hashes)
    return Stored(worker, None if parent is None else EngineHash(100 + parent), blocks)


def restarted(engine: Engine, shard: int, old_pid: int) -> Callable[[], bool]:
    """The shard's new applier is serving and done rebuilding: its workers are fed from Python here, so there
    is nothing to rebuild them from, and it is up again at once, with their rows marked partial."""

    def done() -> bool:
        stats = engine.stats()[shard]
        return stats.restarts == 1 and stats.status == "up" and stats.pid not in (0, old_pid)

    return done


def errors(stats: list[ShardStats]) -> int:
    return sum(sum(s.errors.values()) for s in stats)


def check_restarted_shard(engine: Engine, before: list[ShardStats], *, in_flight: bool = False) -> None:
    """Shard 0 was restarted: new segment, same workers, shard 1 untouched and still answering, and new
    events of shard 0's workers apply. What the dead applier had applied is gone; with ``in_flight``,
    messages still queued for the shard when it died reach the replacement, and worker 1 may hold some."""
    now = engine.stats()
    assert now[0].epoch > before[0].epoch
    assert now[0].segment != before[0].segment
    assert set(now[0].workers) == {(1, 0), (3, 0)}
    assert now[0].workers[3, 0] == 0
    assert in_flight or now[0].workers[1, 0] == 0
    workers = engine.workers()
    assert (workers[1, 0].state, workers[3, 0].state, workers[2, 0].state) == ("partial", "partial", "unknown")
    assert (now[1].status, now[1].pid, now[1].restarts, now[1].epoch) == (
        "up",
        before[1].pid,
        0,
        before[1].epoch,
    )
    engine.flush()
    assert engine.find_matches([1, 2, 3]) == {(2, 0): 2}
    engine.apply_event(1, chain(1, [1, 2]))
    engine.apply_event(3, chain(3, [1]))
    engine.apply_event(3, chain(3, [2], parent=1))
    engine.flush()
    assert engine.find_matches([1, 2, 3]) == {(1, 0): 2, (2, 0): 2, (3, 0): 2}
    assert engine.stats()[0].workers[3, 0] == 2
    assert errors(engine.stats()) == errors(now)


def seed(engine: Engine) -> list[ShardStats]:
    """Workers 1 and 3 on shard 0, worker 2 on shard 1 (round robin on first sight)."""
    engine.apply_event(1, chain(1, [1, 2, 3]))
    engine.apply_event(2, chain(2, [1, 2]))
    engine.apply_event(3, chain(3, [1]))
    engine.flush()
    before = engine.stats()
    assert [s.workers for s in before] == [{(1, 0): 3, (3, 0): 1}, {(2, 0): 2}]
    assert engine.find_matches([1, 2, 3]) == {(1, 0): 3, (2, 0): 2, (3, 0): 1}
    return before


@pytest.mark.timeout(120)
def test_a_killed_applier_is_restarted_with_its_workers(wait_until: WaitUntil, shm_entries: Callable[[int], list[str]]):
    with Engine(shards=2) as engine:
        before = seed(engine)
        os.kill(before[0].pid, signal.SIGKILL)
        wait_until(restarted(engine, 0, before[0].pid), what="shard 0 restarted")
        check_restarted_shard(engine, before)
    assert shm_entries(os.getpid()) == []


@pytest.mark.timeout(120)
def test_an_applier_killed_mid_write_is_restarted_and_leaves_nothing_behind(
    wait_until: WaitUntil, shm_entries: Callable[[int], list[str]]
):
    encoder = Encoder()
    burst = [
        encoder.encode(EventBatch((chain(1, list(range(1000 + 64 * i, 1064 + 64 * i))),))) for i in range(2000)
    ]  # 128 k distinct blocks: the table grows several times while the burst is applied
    with Engine(shards=2) as engine:
        before = seed(engine)
        for payload in burst:
            engine.apply_payload((1, 0), payload)
        os.kill(before[0].pid, signal.SIGKILL)
        wait_until(restarted(engine, 0, before[0].pid), what="shard 0 restarted")
        check_restarted_shard(engine, before, in_flight=True)
    assert shm_entries(os.getpid()) == []


@pytest.mark.timeout(120)
def test_an_applier_writes_only_once_it_holds_the_fence(wait_until: WaitUntil, shm_entries: Callable[[int], list[str]]):
    """The test process holds shard 0's lock, as a dying applier would: the new applier takes nothing
    up (no pid, no segment, status still starting, the flush not reached) until the lock is released."""
    path = lock_path(os.getpid(), 0)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    supervisor = Supervisor(1)
    try:
        control = supervisor.control
        supervisor.send(0, flush_frames(1))
        window = time.monotonic() + 0.5  # a negative can only be watched for a while
        while time.monotonic() < window:
            assert (control.status(0), control.pid(0), control.segment_name(0), control.flushed(0)) == (
                STATUS_STARTING,
                0,
                "",
                0,
            )
            time.sleep(0.01)
        assert os.pread(fd, 32, 0) == b""
        fcntl.flock(fd, fcntl.LOCK_UN)
        wait_until(lambda: control.flushed(0) == 1, what="the applier to take the fence and serve")
        assert control.status(0) == STATUS_UP
        assert control.pid(0) == supervisor.pids()[0]
        assert os.pread(fd, 32, 0).decode().strip() == str(control.pid(0))
    finally:
        os.close(fd)
        supervisor.close()
    supervisor.close()
    assert shm_entries(os.getpid()) == []


@pytest.mark.timeout(120)
def test_close_twice_is_fine_and_a_closed_engine_refuses_work(shm_entries: Callable[[int], list[str]]):
    engine = Engine(shards=2).start()
    engine.close()
    engine.close()
    with pytest.raises(EngineError, match="not running"):
        engine.flush()
    assert shm_entries(os.getpid()) == []


def _die_at_once(*args: object) -> None:
    os._exit(3)


@pytest.mark.timeout(120)
def test_an_applier_that_cannot_start_leaves_its_shard_stopped(
    monkeypatch: pytest.MonkeyPatch, shm_entries: Callable[[int], list[str]]
):
    """A crash loop before the applier ever takes up its shard ends after ``MAX_START_FAILURES``
    attempts; the engine's start fails with the shards' states, and nothing is left behind."""
    monkeypatch.setattr(supervisor_module, "run_applier", _die_at_once)  # the fork inherits it
    with pytest.raises(EngineError, match=r"did not come up .* \['stopped'\]"):
        Engine(shards=1).start()
    assert shm_entries(os.getpid()) == []
    assert MAX_START_FAILURES > 1
