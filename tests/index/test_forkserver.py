"""Appliers come from a single-threaded fork server with the kernels already compiled, restarts included."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest

from kvrouter.engine import Engine
from kvrouter.events.model import EngineHash, LocalHash, Stored, StoredBlock
from kvrouter.index.forkserver import ForkServer

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
from kvrouter.events.codecs import sglang, vllm
import zmq
from kvrouter.events.codecs._prescan import lift_arrays
from kvrouter.events.codecs._runs_engine import decode_engine_runs
from kvrouter.events.codecs._runs_kvrouter import decode_kvrouter_runs
from kvrouter.events.codecs.frames import encode_live
from kvrouter.events.codecs.runs import C_EVENTS, C_MIXED, RunBuffers, RunDecoder
from kvrouter.plane import receive
from kvrouter.events.codecs.kvrouter import Decoder, Encoder
from kvrouter.events.model import Cleared, EngineHash, EventBatch, LocalHash, Removed, Stored, StoredBlock
from kvrouter.hashing import _xxh3
from kvrouter.index import _kernels as kernels
from kvrouter.index.forkserver import warm_up
from kvrouter.index.layout import MIN_CAPACITY, Control, control_name
from kvrouter.index.writer import ShardWriter

warm_up()
watched = {name: getattr(kernels, name) for name in kernels.__all__ if hasattr(getattr(kernels, name), "signatures")}
watched |= {"lift_arrays": lift_arrays, "hash_blocks": _xxh3.hash_blocks, "chain_hashes": _xxh3.chain_hashes}
watched |= {"decode_engine_runs": decode_engine_runs, "decode_kvrouter_runs": decode_kvrouter_runs,
            "receive._drain": receive._drain}
compiled = {name: len(kernel.signatures) for name, kernel in watched.items()}
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
    tokens = lambda first: tuple(range(first, first + 4))  # two blocks of 2 tokens each
    chain = (StoredBlock(EngineHash(900), LocalHash(0), tokens(1)),
             StoredBlock(EngineHash(901), LocalHash(0), tokens(5)))
    engine_events = [
        Stored(1, None, chain),  # alone in its batch: store, not a run
        Stored(1, EngineHash(901), (StoredBlock(EngineHash(902), LocalHash(0), tokens(9)),)),
        Removed(1, (EngineHash(902),)),
        Cleared(1),
    ]
    for codec in (vllm, sglang):  # engine frames as the applier decodes them, lone events and whole batches
        for encoding in ("map", "array"):
            decode = codec.Decoder(1, 2).decode_raw
            for events in [[event] for event in engine_events] + [engine_events]:
                payload = codec.Encoder(encoding).encode(EventBatch(tuple(events), timestamp=0.0))
                writer.apply_batch((1, 0), decode(payload).events)
            alone = codec.Encoder(encoding).encode(EventBatch((engine_events[0],), timestamp=0.0))
            other_size = codec.Decoder(1, 4).decode_raw(alone)  # not the registered block size: blocks dropped
            writer.apply_batch((1, 0), other_size.events)
    context = zmq.Context()  # the batch path: frames received from a socket, decoded and applied in one call each
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.bind("inproc://warm")
    push.connect("inproc://warm")
    buffers = RunBuffers()
    receiver = receive.Receiver(buffers)
    batch = EventBatch(tuple(engine_events[:2]), timestamp=0.0)
    for dialect, payload in [(None, Encoder().encode(batch))] + [
        (codec.Decoder.dialect, codec.Encoder(encoding).encode(batch))
        for codec in (vllm, sglang) for encoding in ("map", "array")
    ]:
        push.send_multipart(encode_live(b"kv", 0, payload))
        while not receiver.drain(pull, 256, b"kv", 1 << 20).count:
            pass
        runs = RunDecoder(dialect, 1, 0, 2, buffers)
        runs.decode(0, 0)
        b, events = runs.buffers, int(runs.buffers.counts[C_EVENTS])
        writer.apply_packed((1, 0), b.kinds[:events], b.tiers[:events], b.parents[:events], b.offsets[: events + 1],
                            b.engine, b.local, float(b.stamps[0]), mixed=bool(b.counts[C_MIXED]))
    pull.close()
    push.close()
    context.term()
    writer.clear_all_blocks(3)
    writer.forget((4, 0))
    writer.remove_worker(5)
finally:
    writer.close(unlink=True)
    control.close()
    control.unlink()
after = {name: len(kernel.signatures) for name, kernel in watched.items()}
print({name: (compiled[name], after[name]) for name in compiled if after[name] != compiled[name]})
"""


@pytest.mark.timeout(300)
def test_warm_up_compiles_every_kernel_signature_the_applier_path_uses():
    """In a fresh interpreter: after ``warm_up`` the applier's whole path (decoded batches, ``apply``,
    growth, wider masks, clears, removals, and the batch path: a drain received, decoded and applied in one
    call each) compiles nothing more."""
    done = subprocess.run([sys.executable, "-c", APPLIER_PATH], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{}"


WARM_ALONE = """
import os
from kvrouter.events.codecs import _prescan
from kvrouter.hashing import _xxh3
from kvrouter.index import _kernels as kernels
from kvrouter.index import forkserver

def no_fork():
    raise OSError(11, "Resource temporarily unavailable")

os.fork = no_fork
forkserver.warm_up()
print(len(_prescan.lift_arrays.signatures), len(_xxh3.hash_blocks.signatures), len(kernels.store.signatures))
"""


@pytest.mark.timeout(300)
def test_warm_up_without_its_helper_loads_both_halves_itself():
    """No helper can be forked: the server compiles (here: loads) the decoders' and hashing kernels too,
    and says why."""
    done = subprocess.run([sys.executable, "-c", WARM_ALONE], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr
    prescan, hashing, store = map(int, done.stdout.split())
    assert prescan >= 1
    assert hashing >= 1
    assert store == 1  # read-only arrays only: the writer hands every event's as such
    assert "no warm-up helper" in done.stderr


WARM_REAPED = """
import os
from kvrouter.index.forkserver import warm_up

warm_up()
try:
    print(os.waitpid(-1, os.WNOHANG))
except ChildProcessError:
    print("no child")
"""


@pytest.mark.timeout(300)
def test_warm_up_reaps_its_helper():
    done = subprocess.run([sys.executable, "-c", WARM_REAPED], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no child"


HELPER_ORPHANED = """
import os, signal, sys, time
from kvrouter.index.forkserver import _fork_helper

helper = _fork_helper(lambda: time.sleep(60))
print(helper, flush=True)
time.sleep(0.5)  # the helper is past its prctl
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(60)
def test_a_helper_dies_with_the_server_that_forked_it(wait_until: WaitUntil):
    """A close mid-start kills the compiling server: its helper must not compile on for minutes, unowned."""
    done = subprocess.run([sys.executable, "-c", HELPER_ORPHANED], capture_output=True, text=True, timeout=30)
    assert done.returncode == -signal.SIGKILL, done.stderr
    helper = int(done.stdout)

    def gone() -> bool:
        try:
            return _status(helper)["State"].startswith("Z")  # dead, its new parent not yet reaping
        except FileNotFoundError:
            return True

    wait_until(gone, what="the helper killed with its parent", timeout=10)


HELPER_FAILING = """
import os
from kvrouter.index.forkserver import _fork_helper

helper = _fork_helper(lambda: 1 / 0)
print(os.waitstatus_to_exitcode(os.waitpid(helper, 0)[1]))
"""


def test_a_failing_helper_exits_1_and_says_why():
    done = subprocess.run([sys.executable, "-c", HELPER_FAILING], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    assert "warm-up helper failed" in done.stderr
    assert "ZeroDivisionError" in done.stderr


CLOSED_MID_COMPILE = """
import json, os, time
from kvrouter.engine import Engine

engine = Engine(shards=1)
engine.start(wait=False)  # the fork server compiles, on this empty cache, with its helper
time.sleep(1.0)
below = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and os.path.exists(f"/proc/{pid}/stat")
         and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid())]
helpers = [int(p) for server in below for p in open(f"/proc/{server}/task/{server}/children").read().split()]
engine.close()
print(json.dumps({"servers": len(below), "helpers": len(helpers),
                  "left": [pid for pid in below + helpers if os.path.exists(f"/proc/{pid}")]}))
"""


@pytest.mark.timeout(60)
def test_a_server_closed_mid_compile_reaps_its_helper_before_it_exits(tmp_path):
    """An engine closed while its fork server compiles on a cold cache: the server gets SIGTERM, kills and
    reaps its helper, and is reaped by the close, so nothing is left when ``close`` returns, not even a
    zombie waiting for init (``kvrouter up`` stopped mid-start checks this too)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cold-cache")}
    done = subprocess.run(
        [sys.executable, "-c", CLOSED_MID_COMPILE], capture_output=True, text=True, timeout=50, env=env
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"servers": 1, "helpers": 1, "left": []}


def _prepared(path: str, marker: bytes) -> None:
    """A ``prepare``: notes the process it runs in; fails when told to (the child is forked all the same)."""
    with open(path, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    if marker == b"fail":
        raise RuntimeError("prepare failed on purpose")


def _write_to(path: str, marker: bytes, fd: int) -> None:
    """A child: writes ``marker`` to the descriptor it was forked with."""
    os.write(fd, marker)


def _read_to_end(fd: int, seconds: float) -> bytes:
    """Everything written to ``fd`` until every copy of its write end is closed; fails after ``seconds``."""
    got = b""
    while True:
        ready, _, _ = select.select([fd], [], [], seconds)
        assert ready, f"a copy of the write end is still open after {seconds}s; read so far {got!r}"
        chunk = os.read(fd, 64)
        if not chunk:
            return got
        got += chunk


@pytest.mark.timeout(60)
@pytest.mark.parametrize("marker", [b"ok", b"fail"])
def test_a_spawn_hands_the_child_its_descriptors_and_prepare_runs_in_the_server_first(tmp_path, marker: bytes):
    """``spawn(args, fds)``: the child gets its own copy of each descriptor and the server keeps none (the
    pipe reaches end of file once the child exits); ``prepare(*args)`` ran in the server before the fork, and
    a failing one still forks the child."""
    notes = tmp_path / "prepared"
    server = ForkServer(_write_to, warm=None, prepare=_prepared)
    read, write = os.pipe()
    try:
        pid = server.spawn((str(notes), marker), (write,))
        os.close(write)
        write = -1
        assert _read_to_end(read, 10.0) == marker
        assert server.reports.recv() == (pid, 0)
        assert notes.read_text().split() == [str(server.pid)]
    finally:
        server.close()
        os.close(read)
        if write >= 0:
            os.close(write)
