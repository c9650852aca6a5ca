"""Appliers come from a single-threaded fork server with the kernels already compiled, restarts included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest

from kvrouter.engine import Engine
from kvrouter.events.model import EngineHash, LocalHash, Stored, StoredBlock

WaitUntil = Callable[..., None]


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as fh:
        return dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)


def _parent(pid: int) -> int:
    return int(_status(pid)["PPid"])


@pytest.mark.timeout(120)
def test_appliers_are_forked_by_a_single_threaded_server_also_on_restart(wait_until: WaitUntil):
    with Engine(shards=2) as engine:
        engine.apply_event(1, Stored(1, None, (StoredBlock(EngineHash(1), LocalHash(5)),)))
        engine.flush()
        assert int(_status(os.getpid())["Threads"]) > 1  # the supervisor's process has threads
        pids = [s.pid for s in engine.stats()]
        server = _parent(pids[0])
        assert server != os.getpid()
        assert _parent(pids[1]) == server
        assert _parent(server) == os.getpid()
        assert int(_status(server)["Threads"]) == 1

        os.kill(pids[0], signal.SIGKILL)
        wait_until(lambda: engine.stats()[0].pid not in (0, pids[0]), what="shard 0 restarted")
        assert _parent(engine.stats()[0].pid) == server
        assert int(_status(server)["Threads"]) == 1
        engine.flush()
        assert engine.find_matches([5]) == {}  # the killed shard's content is gone, and it serves again
        engine.apply_event(1, Stored(1, None, (StoredBlock(EngineHash(1), LocalHash(5)),)))
        engine.flush()
        assert engine.find_matches([5]) == {(1, 0): 1}
    with pytest.raises(FileNotFoundError):
        _status(server)  # the server ended with the engine, and was reaped


APPLIER_PATH = """
import os, sys
from kvrouter.events.codecs.kvrouter import Decoder, Encoder
from kvrouter.events.model import Cleared, EngineHash, EventBatch, LocalHash, Removed, Stored, StoredBlock
from kvrouter.index import _kernels as kernels
from kvrouter.index.forkserver import warm_up
from kvrouter.index.layout import MIN_CAPACITY, Control, control_name
from kvrouter.index.writer import ShardWriter

warm_up()
dispatchers = [name for name in kernels.__all__ if hasattr(getattr(kernels, name), "signatures")]
compiled = {name: len(getattr(kernels, name).signatures) for name in dispatchers}
control = Control.create(control_name((os.getpid() << 20) + 1), 1)
writer = ShardWriter(control, 0, (os.getpid() << 20) + 1, capacity=MIN_CAPACITY)
try:
    encoder, decode = Encoder(), Decoder().decode_raw
    for worker in range(1, 80):  # more workers than one mask word: the masks widen
        blocks = tuple(StoredBlock(EngineHash(10_000 * worker + i), LocalHash(i)) for i in range(40))
        batch = EventBatch((Stored(worker, None, blocks), Stored(worker, EngineHash(10_000 * worker), blocks[1:3]),
                            Removed(worker, (EngineHash(10_000 * worker + 39), EngineHash(7))), Cleared(worker)))
        writer.register((worker, 0))
        writer.apply_batch((worker, 0), decode(encoder.encode(batch)).events)
        writer.apply(Stored(worker, None, blocks))  # the table and the maps grow
    writer.clear_all_blocks(3)
    writer.forget((4, 0))
    writer.remove_worker(5)
finally:
    writer.close(unlink=True)
    control.close()
    control.unlink()
after = {name: len(getattr(kernels, name).signatures) for name in compiled}
print({name: (compiled[name], after[name]) for name in compiled if after[name] != compiled[name]})
"""


@pytest.mark.timeout(300)
def test_warm_up_compiles_every_kernel_signature_the_applier_path_uses():
    """In a fresh interpreter: after ``warm_up`` the applier's whole path (decoded batches, ``apply``,
    growth, wider masks, clears, removals) compiles nothing more."""
    done = subprocess.run([sys.executable, "-c", APPLIER_PATH], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{}"
