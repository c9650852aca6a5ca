"""The applier process: the one writer of one shard, fed over a ZMQ PULL socket.

One process per shard rather than a thread, because decoding, re-hashing and the table writes are
CPU-bound Python and numba work that a thread would serialise on the GIL, and because a crash then
costs one shard, not the router (``DESIGN.md`` component 4). Messages arrive over ZMQ PUSH/PULL on an
``ipc://`` socket: 375 k events/s, 84% of the bare decode rate, with bursts buffered in the queue
while the applier is busy growing its table (``spec/shm-engine.md`` §5). The price is one copy of
each payload through the kernel; a shared ring would only pay above ~400 k events/s.

Every message is a multipart frame list whose first frame is a one-byte tag:

| tag | frames | meaning |
|---|---|---|
| ``A`` | worker id, dp rank (u64 LE each) | the supervisor assigns this (worker, dp_rank) to the shard |
| ``E`` | payload | one kvrouter batch (``events/codecs/kvrouter.py``); the batch names its worker |
| ``F`` | token (u64 LE) | flush: reached once every earlier message is applied; written to the control segment |
| ``R`` | worker id (u64 LE) | remove every dp rank of the worker from this shard |
| ``C`` | worker id (u64 LE) | release every block of every dp rank of the worker; it stays known |
| ``W`` | spec, ranks (u64 LE) | follow these dp ranks of a worker (``plane/registry.py``) |
| ``T`` | sequence hashes (u64 LE) | blocks the front's decisions matched: the cap's recency (``ShardWriter.touch``) |
| ``Q`` | (none) | stop: unlink the shard segment, status stopped, exit 0 |

The socket orders messages, so a flush token is a barrier for everything sent before it, and worker
operations apply in order with events. The supervisor's assignment is the authority on which shard
owns a worker: it sends ``A`` before a new worker's first event (a restarted applier is given its
workers at start), and a batch for a worker this shard was not given is counted as ``bad_event`` and
not applied, so a (worker, dp_rank) never lives in two shards. A malformed message is counted as
``bad_event`` (the first of each sort is logged) and skipped: bad input never ends the loop.

Fencing: before it writes anything the applier takes ``fcntl.flock`` on its shard's lock file and
keeps it until it exits; the kernel drops the lock when the process dies, even by SIGKILL, so a
replacement can start writing only once the previous writer is gone (``docs/shm-engine.md``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import struct
import time
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
import zmq

from ..errors import BadEvent, ConfigError
from ..events.codecs.kvrouter import Decoder
from ..events.model import WorkerKey
from ..plane.config import PlaneConfig
from ..plane.ingest import Ingest
from ..plane.registry import WorkerSpec
from ..plane.wakes import Wakes
from .heap import Heap
from .layout import (
    STATUS_RECOVERING,
    STATUS_STOPPED,
    STATUS_UP,
    W_STATE,
    WORKER_PARTIAL,
    Control,
    lock_path,
    unlink_segment,
)
from .sweep import owner_lock_path
from .writer import ShardWriter

__all__ = [
    "ASSIGN_WORKER",
    "CLEAR_WORKER",
    "EVENTS",
    "FLUSH",
    "QUEUE_LIMIT",
    "REMOVE_WORKER",
    "STOP",
    "TOUCH",
    "WORKER",
    "assign_frames",
    "clear_frames",
    "flush_frames",
    "remove_frames",
    "run_applier",
    "stop_frames",
    "touch_frames",
    "worker_frames",
]

log = logging.getLogger(__name__)

ASSIGN_WORKER: Final = b"A"
EVENTS: Final = b"E"
FLUSH: Final = b"F"
REMOVE_WORKER: Final = b"R"
CLEAR_WORKER: Final = b"C"
STOP: Final = b"Q"
WORKER: Final = b"W"
TOUCH: Final = b"T"

QUEUE_LIMIT: Final = 1 << 20
"""Messages a shard's queue holds (sender and receiver high-water marks). Deep enough to absorb a
table growth at full event rate (tens of ms, ``spec/shm-engine.md`` §4.3); beyond it the sender
blocks, which is back pressure rather than loss."""
TICK_MS: Final = 100
"""How often the applier runs its timers (recovery timeouts, stale workers, a rebuilt shard) and checks
that its supervisor is still alive; also the longest a poll waits."""
GROWTH_TICK_MS: Final = 2
"""The longest a poll waits while a table or map grows (``ShardWriter.advance``): a quiet shard still
publishes its successor within milliseconds of the helper finishing it."""
PULL_DRAIN_LIMIT: Final = 1024
"""Supervisor messages taken per wake-up before the workers' sockets get their turn."""
FENCE_POLL_MAX_S: Final = 0.05
"""Longest sleep between two attempts to take the fence; the wait itself has no end but the owner's death."""

_U64: Final = struct.Struct("<Q")
_WORKER: Final = struct.Struct("<QQ")


def assign_frames(worker: WorkerKey) -> list[bytes]:
    return [ASSIGN_WORKER, _WORKER.pack(*worker)]


def _ranks(frame: bytes) -> list[int]:
    """The dp ranks of a ``W`` message: packed little-endian u64 values."""
    if len(frame) % _U64.size:
        raise ValueError(f"{len(frame)} bytes is not a list of u64")
    return list(struct.unpack(f"<{len(frame) // _U64.size}Q", frame))


def flush_frames(token: int) -> list[bytes]:
    return [FLUSH, _U64.pack(token)]


def remove_frames(worker_id: int) -> list[bytes]:
    return [REMOVE_WORKER, _U64.pack(worker_id)]


def clear_frames(worker_id: int) -> list[bytes]:
    return [CLEAR_WORKER, _U64.pack(worker_id)]


def touch_frames(seqs: npt.NDArray[np.uint64]) -> list[bytes]:
    return [TOUCH, seqs.astype("<u8", copy=False).tobytes()]


def stop_frames() -> list[bytes]:
    return [STOP]


def worker_frames(spec: WorkerSpec, ranks: Sequence[int]) -> list[bytes]:
    return [WORKER, spec.to_wire(), struct.pack(f"<{len(ranks)}Q", *ranks)]


def run_applier(
    control_name: str,
    shard: int,
    owner_pid: int,
    endpoint: str,
    workers: Sequence[WorkerKey],
    status: int,
    specs: Sequence[tuple[bytes, Sequence[int]]] = (),
    config: PlaneConfig | None = None,
    budget: int = 0,
) -> None:
    """The applier's whole life, run in a process forked by the supervisor.

    Takes the shard's fence (waiting for as long as another process holds it), builds a fresh shard
    segment with ``workers`` registered, publishes its pid and ``status`` (up on a first start,
    recovering on a restart), follows the workers of ``specs`` (rebuilding each from its replay socket or
    local indexer as far as it allows; a restarted shard is up again once every one has joined), then
    serves ``endpoint`` and the workers' sockets until it receives a stop, or until its supervisor dies
    (it then removes what the supervisor can no longer remove).

    Args:
        control_name: the control segment to attach read-write.
        shard: the shard this process writes.
        owner_pid: the supervisor's pid, which every segment and lock name carries.
        endpoint: the ``ipc://`` address to bind the PULL socket to.
        workers: the (worker_id, dp_rank) the shard owns already (empty on a first start).
        status: the status to publish once the shard is writable.
        specs: the followed workers the shard owns, as ``(WorkerSpec.to_wire(), dp ranks)``.
        config: the event plane's bounds and timers.
        budget: the (worker, block) entries the shard may hold (its share of the index cap; 0: no cap).
    """
    for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C and systemd signal the whole group at once:
        signal.signal(signum, signal.SIG_IGN)  # the supervisor decides when appliers stop
    parent = os.getppid()
    fence = _take_fence(lock_path(owner_pid, shard), parent)
    if fence is None:
        log.warning("applier gave up waiting for the fence shard=%d: supervisor %d is gone", shard, parent)
        return
    control = Control.attach(control_name, writable=True)
    creating_ns = time.monotonic_ns()
    writer = ShardWriter(control, shard, owner_pid, workers=workers, budget=budget)
    if status == STATUS_RECOVERING:
        for worker in workers:  # what they held died with the previous applier; followed ones are rebuilt
            row = writer.row(worker)
            if row is not None:
                row[W_STATE] = WORKER_PARTIAL
    control.set_pid(shard, os.getpid())
    control.set_status(shard, status)
    created_ns = time.monotonic_ns()  # readers may answer from the new, empty segment from here on
    log.info(
        "applier up shard=%d pid=%d segment=%s workers=%d followed=%d status=%d",
        shard,
        os.getpid(),
        writer.segment_name,
        len(workers),
        len(specs),
        status,
    )
    context = zmq.Context()  # never the parent's: a forked copy of a context must not be used
    socket = context.socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, QUEUE_LIMIT)
    socket.bind(endpoint)
    wakes = Wakes()
    wakes.watch(socket)
    ingest = Ingest(context, wakes, writer, config or PlaneConfig())
    if ingest.tap is not None:  # the owned workers' blocks went with the old segment, for readers too
        for worker in workers:
            ingest.tap.cleared(worker, "segment", at=(creating_ns, created_ns))
    for spec, ranks in specs:
        ingest.add(WorkerSpec.from_wire(spec), ranks)
    orphaned = False
    try:
        orphaned = _serve(socket, wakes, ingest, control, writer, shard, parent)
    finally:
        control.set_status(shard, STATUS_STOPPED)
        ingest.close()
        wakes.close()
        writer.close(unlink=True)
        socket.close(linger=0)
        context.term()
        if orphaned:  # nobody else will remove them now
            unlink_segment(control.name)
            _remove_file(lock_path(owner_pid, shard))
            _remove_file(owner_lock_path(owner_pid))
            socket_path = endpoint.removeprefix("ipc://")
            _remove_file(socket_path)
            with contextlib.suppress(OSError):  # the last applier out removes the directory
                os.rmdir(os.path.dirname(socket_path))
        control.close()
        os.close(fence)  # releases the lock
    log.info("applier stopped shard=%d pid=%d orphaned=%s", shard, os.getpid(), orphaned)


def _serve(
    socket: zmq.Socket[bytes],
    wakes: Wakes,
    ingest: Ingest,
    control: Control,
    writer: ShardWriter,
    shard: int,
    parent: int,
) -> bool:
    """Apply messages until a stop (returns False) or the supervisor's death (returns True)."""
    apply_payload = _payload_applier(writer, shard)
    recv = socket.recv_multipart
    logged: set[str] = set()
    next_tick = 0.0
    heap = Heap(time.monotonic())
    while True:  # hot path: one poll, then every readable socket drained
        ready = wakes.poll(GROWTH_TICK_MS if writer.growing else TICK_MS)
        if writer.growing:
            writer.advance()
        now = time.monotonic()
        if not ready and not writer.growing:  # a whole tick without a wake: a burst's buffers go back (heap.py)
            heap.idle(now)
        if now >= next_tick:
            next_tick = now + TICK_MS / 1000
            if os.getppid() != parent:
                return True
            ingest.tick(now)
            writer.release_retired(now)
            if not writer.growing:
                heap.tick(now)
            if control.status(shard) == STATUS_RECOVERING and not ingest.joining:
                control.set_status(shard, STATUS_UP)
                log.info("shard rebuilt shard=%d: every followed worker has joined", shard)
        for sock in ready:
            if sock is not socket:
                if ingest.on_ready(sock, now):
                    heap.busy()
                continue
            for _ in range(PULL_DRAIN_LIMIT):
                try:
                    frames = recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                heap.busy()
                tag = frames[0] if frames else b""
                if tag == EVENTS and len(frames) == 2:
                    apply_payload(frames[1])
                    continue
                if tag == STOP and len(frames) == 1:
                    return False
                if tag == ASSIGN_WORKER and len(frames) == 2 and len(frames[1]) == _WORKER.size:
                    writer.register(_WORKER.unpack(frames[1]))
                    continue
                if tag == TOUCH and len(frames) == 2 and len(frames[1]) % 8 == 0:
                    writer.touch(np.frombuffer(frames[1], dtype="<u8").astype(np.uint64, copy=False))
                    continue
                if tag == WORKER and len(frames) == 3:
                    try:
                        ingest.add(WorkerSpec.from_wire(frames[1]), _ranks(frames[2]))
                        continue
                    except (ConfigError, ValueError):
                        pass  # counted below
                elif tag in (FLUSH, REMOVE_WORKER, CLEAR_WORKER) and len(frames) == 2 and len(frames[1]) == _U64.size:
                    (value,) = _U64.unpack(frames[1])
                    if tag == FLUSH:
                        if value > control.flushed(shard):
                            control.set_flushed(shard, value)
                    elif tag == REMOVE_WORKER:
                        ingest.remove(value)
                        writer.remove_worker(value)
                    else:
                        writer.clear_all_blocks(value)
                    continue
                control.count_error(shard, "bad_event")
                what = f"tag {tag[:8]!r} with {len(frames)} frames"
                if what not in logged:
                    logged.add(what)
                    log.warning("malformed applier message shard=%d message=%s: counted as bad_event", shard, what)
            else:  # the bound, not the end: more may wait, and no new wake will tell of them
                wakes.again(socket)


def _payload_applier(writer: ShardWriter, shard: int) -> Callable[[bytes], None]:
    """Decode kvrouter batches for ``writer``: decoding lives here, the writer takes arrays. A batch that does
    not decode counts one ``bad_event``; the first is logged, later ones only counted."""
    decode = Decoder().decode_raw
    bad = 0
    strangers: set[WorkerKey] = set()

    def apply_payload(payload: bytes) -> None:
        nonlocal bad
        try:
            batch = decode(payload)
        except BadEvent as exc:
            bad += 1
            log.log(
                logging.WARNING if bad == 1 else logging.DEBUG, "bad batch shard=%d count=%d error=%s", shard, bad, exc
            )
            writer.count_bad_batch()
            return
        worker = (batch.worker_id, batch.dp_rank)
        if not writer.owns(worker):  # another shard's, or removed: applying it would make a second copy
            if worker not in strangers:
                strangers.add(worker)
                log.warning("batch for a worker this shard does not own shard=%d worker=%s: bad_event", shard, worker)
            writer.count_bad_batch()
            return
        writer.apply_batch(worker, batch.events, batch.timestamp or 0.0)

    return apply_payload


def _take_fence(path: str, parent: int) -> int | None:
    """Hold an exclusive ``flock`` on ``path`` and write our pid in it; None if the supervisor died first.

    The wait is a poll with a short, bounded sleep rather than a blocking ``flock``, so that an applier
    whose supervisor died does not wait for ever; the lock itself is the same kernel lock either way.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    delay = 0.001
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if not waited:
                waited = True
                log.info("applier waiting for fence path=%s holder=%s", path, _holder(fd))
            if os.getppid() != parent:
                os.close(fd)
                return None
            time.sleep(delay)
            delay = min(delay * 2, FENCE_POLL_MAX_S)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    if waited:
        log.info("applier took fence path=%s", path)
    return fd


def _holder(fd: int) -> str:
    """The pid the current holder wrote, for the log line only."""
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
