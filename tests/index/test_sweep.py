"""An engine starting after an OOM kill sweeps the dead owner's files, its own pid's included; live
owners' files are never touched."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

import pytest

from kvrouter.engine import Engine
from kvrouter.errors import EngineError
from kvrouter.index.sweep import owner_lock_path, sweep_leftovers, take_owner_lock


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    return int(done.stdout)


def _fake_leftovers(pid: int) -> list[str]:
    """What an engine of ``pid`` killed with its process group leaves: control and shard segments, its service's
    stats segment and fronts' words, fences, its owner lock, and its socket directory with a socket file in it."""
    paths = [
        f"/dev/shm/kvrouter-{pid}-ctl",
        f"/dev/shm/kvrouter-{pid}-stats",
        f"/dev/shm/kvrouter-{pid}-fronts",
        f"/dev/shm/kvrouter-{pid}-s0-e3",
        f"/dev/shm/kvrouter-{pid}-s1-e1",
        f"/dev/shm/kvrouter-{pid}-s0.lock",
        owner_lock_path(pid),
    ]
    for path in paths:
        with open(path, "wb") as fh:
            fh.write(b"left behind")
    directory = os.path.join(tempfile.gettempdir(), f"kvrouter-{pid}-abc_1234")
    os.mkdir(directory)
    with open(os.path.join(directory, "shard-0.sock"), "wb"):
        pass
    return [*paths, directory]


def _left_behind(path: str) -> bool:
    if os.path.isdir(path):
        return True
    try:
        with open(path, "rb") as fh:
            return fh.read(len(b"left behind")) == b"left behind"
    except FileNotFoundError:
        return False


@pytest.fixture
def live_process() -> Iterator[subprocess.Popen[bytes]]:
    """Another process that stays alive until the test ends."""
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def leftovers() -> Iterator[Callable[[int], list[str]]]:
    """``leftovers(pid)`` makes fake leftovers and removes whatever of them is left at the end."""
    made: list[str] = []

    def make(pid: int) -> list[str]:
        paths = _fake_leftovers(pid)
        made.extend(paths)
        return paths

    yield make
    for path in made:
        if os.path.isdir(path):
            for name in os.listdir(path):
                os.unlink(os.path.join(path, name))
            os.rmdir(path)
        elif os.path.exists(path):
            os.unlink(path)


@pytest.mark.timeout(120)
def test_an_engine_sweeps_a_dead_owners_and_its_own_pids_leftovers_and_starts(
    leftovers: Callable[[int], list[str]],
    live_process: subprocess.Popen[bytes],
    shm_entries: Callable[[int], list[str]],
):
    dead = leftovers(_dead_pid())
    ours = leftovers(os.getpid())  # a restart that got the killed engine's pid
    alive = leftovers(live_process.pid)
    with Engine(shards=2) as engine:
        assert [path for path in dead if os.path.exists(path)] == []
        assert [path for path in ours if _left_behind(path)] == []  # gone, or the new engine's own file
        assert all(os.path.exists(path) for path in alive)
        assert [s.status for s in engine.stats()] == ["up", "up"]
        assert os.path.exists(owner_lock_path(os.getpid()))
    assert shm_entries(os.getpid()) == []
    assert all(os.path.exists(path) for path in alive)


@pytest.mark.timeout(60)
def test_a_held_owner_lock_or_fence_is_never_swept(leftovers: Callable[[int], list[str]]):
    """A dead pid whose owner lock some process still holds (a forked child of the dead engine, say) is
    live; a held fence of a dead owner is kept while the rest of its files go."""
    pid = _dead_pid()
    paths = leftovers(pid)
    lock = take_owner_lock(pid)
    try:
        assert [path for path in sweep_leftovers() if f"-{pid}-" in path] == []
        assert all(os.path.exists(path) for path in paths)
    finally:
        os.close(lock)
    fence = f"/dev/shm/kvrouter-{pid}-s0.lock"
    fd = os.open(fence, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        removed = [path for path in sweep_leftovers() if f"-{pid}-" in path]
        assert sorted(removed) == sorted(path for path in paths if path != fence)
        assert os.path.exists(fence)
    finally:
        os.close(fd)


def test_a_second_owner_lock_in_one_process_is_refused():
    pid = _dead_pid()
    first = take_owner_lock(pid)
    try:
        with pytest.raises(EngineError, match="another engine"):
            take_owner_lock(pid)
    finally:
        os.unlink(owner_lock_path(pid))
        os.close(first)
