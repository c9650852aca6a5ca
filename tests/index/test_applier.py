"""The applier loop survives any input, and cleans up after a supervisor that died without doing so."""

from __future__ import annotations

import glob
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import pytest

from kvrouter.engine import Engine
from kvrouter.events.codecs.kvrouter import Encoder
from kvrouter.events.model import EngineHash, EventBatch, LocalHash, Stored, StoredBlock
from kvrouter.index.applier import EVENTS, assign_frames, flush_frames
from kvrouter.index.layout import STATUS_UP
from kvrouter.index.reader import IndexReader
from kvrouter.index.supervisor import Supervisor

WaitUntil = Callable[..., None]

MALFORMED = [
    [b"X"],
    [b""],
    [b"EE", b"x"],
    [b"E"],
    [b"E", b"a", b"b"],
    [b"E", b"\xc1 is never msgpack"],
    [b"E", b"\x80"],  # msgpack, but an empty map: no version
    [b"F"],
    [b"F", b"short"],
    [b"R", b""],
    [b"C", b"nine byte"],
    [b"Q", b"extra"],
    [b"A", b"eight by"],
]
"""Unknown tags, wrong frame counts, wrong value sizes, payloads that do not decode: one bad_event each."""


def stored(worker: int, hashes: list[int]) -> Stored:
    return Stored(worker, None, tuple(StoredBlock(EngineHash(100 + h), LocalHash(h)) for h in hashes))


@pytest.mark.timeout(120)
def test_malformed_messages_are_counted_and_the_applier_keeps_serving(
    wait_until: WaitUntil, shm_entries: Callable[[int], list[str]]
):
    supervisor = Supervisor(1)
    try:
        control = supervisor.control
        wait_until(lambda: control.status(0) == STATUS_UP, what="the applier up")
        for frames in MALFORMED:
            supervisor.send(0, frames)
        assert supervisor.shard_for((1, 0)) == 0
        supervisor.send(0, [EVENTS, Encoder().encode(EventBatch((stored(1, [1, 2]),)))])
        supervisor.send(0, flush_frames(1))
        wait_until(lambda: control.flushed(0) == 1, what="the flush after the bad messages")
        assert control.stats(0)["bad_event"] == len(MALFORMED)
        assert control.stats(0)["events_applied"] == 1
        assert (control.pid(0), control.restarts(0), control.status(0)) == (supervisor.pids()[0], 0, STATUS_UP)
        reader = IndexReader(control.name)
        try:
            assert reader.find_matches([1, 2, 3]) == {(1, 0): 2}
        finally:
            reader.close()
    finally:
        supervisor.close()
    assert shm_entries(os.getpid()) == []


@pytest.mark.timeout(120)
def test_bad_payloads_on_the_fast_path_are_counted_per_batch():
    encoder = Encoder()
    with Engine(shards=1) as engine:
        engine.apply_payload((1, 0), b"garbage")
        engine.apply_payload((1, 0), encoder.encode(EventBatch((stored(1, [1]),))).replace(b"device", b"dennis"))
        engine.apply_payload((1, 0), encoder.encode(EventBatch((stored(1, [1, 2]),))))
        engine.flush()
        (stats,) = engine.stats()
        assert stats.errors["bad_event"] == 2
        assert stats.events_applied == 1
        assert engine.find_matches([1, 2]) == {(1, 0): 2}


@pytest.mark.timeout(120)
def test_a_batch_for_a_worker_another_shard_owns_is_refused(
    wait_until: WaitUntil, shm_entries: Callable[[int], list[str]]
):
    """Worker 1 is assigned to shard 0; its batch sent straight to shard 1 is counted there as bad_event
    and not applied: the worker lives in shard 0 only. An assign message makes shard 1 accept a worker."""
    encoder = Encoder()
    supervisor = Supervisor(2)
    try:
        control = supervisor.control
        assert [supervisor.shard_for((1, 0)), supervisor.shard_for((2, 0))] == [0, 1]
        supervisor.send(0, [EVENTS, encoder.encode(EventBatch((stored(1, [1, 2]),)))])
        supervisor.send(1, [EVENTS, encoder.encode(EventBatch((stored(1, [1, 2, 3]),)))])  # misrouted
        supervisor.send(1, [EVENTS, encoder.encode(EventBatch((stored(1, [4]),)))])  # again: counted, logged once
        supervisor.send(1, [EVENTS, encoder.encode(EventBatch((stored(2, [1]),)))])
        for shard in (0, 1):
            supervisor.send(shard, flush_frames(1))
        wait_until(lambda: control.flushed(0) == control.flushed(1) == 1, what="both shards flushed")
        assert [control.stats(k)["bad_event"] for k in (0, 1)] == [0, 2]
        assert [control.stats(k)["events_applied"] for k in (0, 1)] == [1, 1]
        assert [sorted(control.workers(k).values()) for k in (0, 1)] == [[(1, 0, 2)], [(2, 0, 1)]]
        reader = IndexReader(control.name)
        try:
            assert reader.find_matches([1, 2, 3]) == {(1, 0): 2, (2, 0): 1}
        finally:
            reader.close()
        supervisor.send(1, assign_frames((5, 0)))
        supervisor.send(1, [EVENTS, encoder.encode(EventBatch((stored(5, [9]),)))])
        supervisor.send(1, flush_frames(2))
        wait_until(lambda: control.flushed(1) == 2, what="shard 1 flushed")
        assert sorted(control.workers(1).values()) == [(2, 0, 1), (5, 0, 1)]
    finally:
        supervisor.close()
    assert shm_entries(os.getpid()) == []


def _own_an_engine(conn: Connection) -> None:
    """A supervisor that will be SIGKILLed: it never gets to clean up."""
    with Engine(shards=2) as engine:
        engine.apply_event(1, stored(1, [1, 2, 3]))
        engine.flush()
        conn.send([s.pid for s in engine.stats()])
        time.sleep(120)


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for whoever adopted it to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_appliers_of_a_dead_supervisor_remove_its_segments(
    wait_until: WaitUntil, shm_entries: Callable[[int], list[str]]
):
    fork = multiprocessing.get_context("fork")
    receiving, sending = fork.Pipe(duplex=False)
    owner = fork.Process(target=_own_an_engine, args=(sending,))
    owner.start()
    try:
        appliers = receiving.recv()
    finally:
        assert owner.pid is not None
        owner_pid = owner.pid
        os.kill(owner_pid, signal.SIGKILL)
        owner.join()

    def gone() -> bool:
        return not shm_entries(owner_pid) and not any(_running(pid) for pid in appliers)

    wait_until(gone, timeout=30, what="the orphaned appliers to clean up and exit")
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"kvrouter-{owner_pid}-*")) == []
