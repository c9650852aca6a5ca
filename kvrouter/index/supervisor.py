"""The supervisor: forks one applier per shard, routes each worker to its shard, restarts the dead.

It runs inside the process that owns the engine and owns everything shared: the control segment,
one PUSH socket per shard, the fence lock files and the temporary directory of the ``ipc://``
sockets. Appliers bind, the supervisor connects: a connecting PUSH queues messages while its peer is
away, so events sent during an applier's start or restart wait in the queue instead of failing, and
the socket reconnects to the replacement by itself. What the dead applier had received but not
applied is lost; rebuilding the shard from its workers is the event plane's job, so a restarted
shard reports ``recovering`` with its worker set known (``docs/shm-engine.md``).

Sharding is by worker and sticky: a (worker_id, dp_rank) is given a shard round-robin the first
time it is seen and keeps it for the life of the engine, so one process sees all of a worker's
events in order (``DESIGN.md`` component 4). The map lives here and nowhere else.

Appliers are forked by a fork server (``index/forkserver.py``) that the supervisor forks first, before
it starts its monitor thread or its ZMQ context: no applier is ever forked from a threaded process.
A monitor thread reads the server's exit reports. On an unexpected death it counts a restart, marks
the shard recovering, removes the dead applier's segment (its owner can no longer do it) and has the
server fork a replacement, which writes only once it holds the shard's fence, i.e. once the dead
process is gone. An applier that dies before it ever took up its shard is restarted at most
``MAX_START_FAILURES`` times in a row, then the shard is left stopped: a crash loop helps nobody.

Fork safety: nothing here lives at module level; every child builds its own ZMQ context, and the
parent's sockets are never touched in a child. Only the creating process closes (a fork of it that
exits leaves everything alone).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Final

import zmq

from ..errors import EngineError
from ..events.model import WorkerKey
from ..plane.config import PlaneConfig
from ..plane.registry import WorkerSpec
from .applier import QUEUE_LIMIT, assign_frames, remove_frames, run_applier, stop_frames, worker_frames
from .forkserver import ForkServer
from .layout import (
    STATUS_RECOVERING,
    STATUS_STOPPED,
    STATUS_UP,
    Control,
    control_name,
    lock_path,
    shard_name,
    unlink_segment,
)
from .sweep import owner_lock_path, sweep_leftovers, take_owner_lock

__all__ = ["MAX_START_FAILURES", "STOP_TIMEOUT", "Supervisor"]

log = logging.getLogger(__name__)

STOP_TIMEOUT: Final = 5.0
"""Seconds ``close`` waits for the appliers to stop before it kills them [s]."""
MAX_START_FAILURES: Final = 3
"""Consecutive deaths before an applier took up its shard after which the shard is left stopped."""
RECONNECT_MS: Final = 10
"""How soon a PUSH socket reconnects to a restarted applier (ZMQ's default is 100 ms)."""


class Supervisor:
    """The appliers of one engine, their sockets, their segments and the worker → shard map.

    Constructing it starts everything; :meth:`close` stops and removes everything, also after a failed
    start, and may be called any number of times (it is also registered to run at interpreter exit).

    Args:
        shards: how many appliers (and shard tables) to run.
        owner_pid: the pid every segment, lock and socket name carries; this process's by default.
        stop_timeout: seconds ``close`` gives the appliers to stop before killing them.
        max_index_blocks: the index cap over every shard (0: none); each applier keeps ``cap // shards``.

    Raises:
        EngineError: another engine of this process owns the segment names, or an applier cannot be forked.
    """

    def __init__(
        self,
        shards: int,
        owner_pid: int | None = None,
        *,
        stop_timeout: float = STOP_TIMEOUT,
        plane: PlaneConfig | None = None,
        defer: bool = False,
        max_index_blocks: int = 0,
    ) -> None:
        """``defer``: fork the fork server, create the control segment and the sockets, and stop there:
        :meth:`complete_start` forks the appliers (through the fork server, which compiles their kernels
        first: minutes on a cold numba cache) and may run on another thread, since nothing is forked from
        this process any more."""
        self.shards = shards
        """Number of shards, fixed for the supervisor's life."""
        self.owner_pid = os.getpid() if owner_pid is None else owner_pid
        """The pid in every name this supervisor creates."""
        self.stop_timeout = stop_timeout
        self.plane = plane or PlaneConfig()
        """The event plane's bounds and timers, handed to every applier."""
        self.budget = max(1, max_index_blocks // shards) if max_index_blocks > 0 else 0
        """Each shard's share of the index cap, in (worker, block) entries (0: no cap): the cap is split
        evenly rather than shared, so no applier ever waits on another to decide what to evict."""
        self._specs: dict[int, WorkerSpec] = {}
        """The registry: every followed worker, by id. A restarted applier is handed its part of it."""
        self.creator_pid = os.getpid()
        """The process that built this supervisor: the only one whose :meth:`close` stops and removes anything."""
        self._lock = threading.Lock()
        """Guards the processes, the worker map and the closing flag against the monitor thread."""
        self._send_lock = threading.Lock()
        """ZMQ sockets are not thread-safe; every send holds this."""
        self._closing = False
        self._assignment: dict[WorkerKey, int] = {}
        self._known: list[set[WorkerKey]] = [set() for _ in range(shards)]
        self._next_shard = 0
        self._pids: list[int | None] = [None] * shards
        """Each shard's applier as forked, until its exit is reported (``None``: none, or left stopped)."""
        self._start_failures = [0] * shards
        self._forkserver: ForkServer | None = None
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sockets: list[zmq.Socket[bytes]] = []
        self._dir: str | None = None
        self._wake: tuple[int, int] | None = None
        self._monitor: threading.Thread | None = None
        self._control: Control | None = None
        self._owner_lock: int | None = None
        atexit.register(self.close)
        try:
            self._start()
            if not defer:
                self.complete_start()
        except BaseException:
            self.close()
            raise

    def complete_start(self) -> None:
        """Fork every shard's applier and start the monitor thread (what a deferred start left to do).

        Raises:
            EngineError: the fork server is gone, or the supervisor was closed meanwhile.
        """
        if self._monitor is not None:
            return
        if self._closing:
            raise EngineError("the engine is closed")
        for shard in range(self.shards):
            self._spawn(shard, STATUS_UP)
        self._wake = os.pipe()
        self._monitor = threading.Thread(target=self._watch, name=f"kvrouter-supervisor-{self.owner_pid}", daemon=True)
        self._monitor.start()
        log.info("supervisor up shards=%d control=%s", self.shards, self.control.name)

    def _start(self) -> None:
        sweep_leftovers()  # a dead engine's files, maybe with our own pid (docs/shm-engine.md)
        self._owner_lock = take_owner_lock(self.owner_pid)
        # before any thread or ZMQ context of ours: every applier is forked from this clean process
        self._forkserver = ForkServer(run_applier, close_fds=[self._owner_lock])
        name = control_name(self.owner_pid)
        try:
            self._control = Control.create(name, self.shards)
        except FileExistsError:
            raise EngineError(
                f"control segment /dev/shm/{name} exists: another engine runs in process {self.owner_pid}, "
                "or a previous one left it behind (remove it if that process is gone)"
            ) from None
        self._dir = tempfile.mkdtemp(prefix=f"kvrouter-{self.owner_pid}-")
        self._context = zmq.Context()
        for shard in range(self.shards):
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, QUEUE_LIMIT)
            socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
            socket.connect(self.endpoint(shard))
            self._sockets.append(socket)

    # -- what the engine uses -----------------------------------------------------------------

    @property
    def control(self) -> Control:
        """The control segment, mapped read-write (this process created it)."""
        if self._control is None or self._closing:
            raise EngineError("the engine is closed")
        return self._control

    def endpoint(self, shard: int) -> str:
        """The ``ipc://`` address of a shard's applier."""
        assert self._dir is not None
        return f"ipc://{self._dir}/shard-{shard}.sock"

    def shard_for(self, worker: WorkerKey) -> int:
        """The shard owning ``worker``, assigned round-robin the first time it is seen, never moved; the
        shard's applier is told (an assign message) before the caller can send the worker's first event."""
        shard = self._assignment.get(worker)
        if shard is None or worker not in self._known[shard]:
            with self._lock:
                shard = self._assignment.get(worker)
                if shard is None:
                    shard = self._assignment[worker] = self._next_shard % self.shards
                    self._next_shard += 1
                if worker not in self._known[shard]:
                    self.send(shard, assign_frames(worker))  # before it is known: no event can pass it
                    self._known[shard].add(worker)
        return shard

    def owner(self, worker: WorkerKey) -> int | None:
        """The shard ``worker`` was assigned to, None if none was (nothing is assigned here)."""
        return self._assignment.get(worker)

    def shards_of(self, worker_id: int) -> list[int]:
        """The shards holding some dp rank of ``worker_id``, in order."""
        with self._lock:
            return sorted({shard for shard, known in enumerate(self._known) for key in known if key[0] == worker_id})

    def forget(self, worker_id: int) -> list[int]:
        """Drop every dp rank of ``worker_id`` from the known sets (its shard stays assigned); returns
        the shards that knew it, which must be told to remove it."""
        with self._lock:
            shards = []
            for shard, known in enumerate(self._known):
                keys = {key for key in known if key[0] == worker_id}
                if keys:
                    known -= keys
                    shards.append(shard)
            return shards

    def follow(self, spec: WorkerSpec) -> list[int]:
        """Register ``spec`` (replacing an earlier spec of the same worker, whose ranks are dropped first) and
        tell each shard owning one of its ranks to follow them; returns those shards.

        Raises:
            EngineError: the supervisor is closed.
        """
        if spec.worker_id in self._specs:
            self.unfollow(spec.worker_id)
        by_shard: dict[int, list[int]] = {}
        for rank in spec.dp_ranks:
            by_shard.setdefault(self.shard_for((spec.worker_id, rank)), []).append(rank)
        with self._lock:
            self._specs[spec.worker_id] = spec
        for shard, ranks in sorted(by_shard.items()):
            self.send(shard, worker_frames(spec, ranks))
        return sorted(by_shard)

    def unfollow(self, worker_id: int) -> None:
        """Drop ``worker_id`` from the registry and from every shard that knew it: its blocks leave the index."""
        with self._lock:
            self._specs.pop(worker_id, None)
        for shard in self.forget(worker_id):
            self.send(shard, remove_frames(worker_id))

    def specs(self) -> list[WorkerSpec]:
        """The registry, by worker id."""
        with self._lock:
            return [self._specs[w] for w in sorted(self._specs)]

    def _followed(self, shard: int) -> list[tuple[bytes, list[int]]]:
        """The part of the registry a (re)started applier of ``shard`` follows (called with the lock held)."""
        followed = []
        for worker_id, spec in sorted(self._specs.items()):
            ranks = [rank for rank in spec.dp_ranks if (worker_id, rank) in self._known[shard]]
            if ranks:
                followed.append((spec.to_wire(), ranks))
        return followed

    def known_workers(self, shard: int) -> set[WorkerKey]:
        """Every (worker_id, dp_rank) routed to ``shard`` and not removed since."""
        with self._lock:
            return set(self._known[shard])

    def send(self, shard: int, frames: Sequence[bytes]) -> None:
        """Queue one message for a shard's applier; blocks only when its queue is full.

        Raises:
            EngineError: the supervisor is closed.
        """
        with self._send_lock:
            if self._closing:
                raise EngineError("the engine is closed")
            self._sockets[shard].send_multipart(frames)

    def pids(self) -> list[int | None]:
        """The applier processes' pids as forked (``None`` for a shard left stopped)."""
        with self._lock:
            return list(self._pids)

    # -- appliers -----------------------------------------------------------------------------

    def _spawn(self, shard: int, status: int) -> None:
        control = self._control
        assert control is not None
        assert self._forkserver is not None
        workers = sorted(self._known[shard])
        args = (
            control.name,
            shard,
            self.owner_pid,
            self.endpoint(shard),
            workers,
            status,
            self._followed(shard),
            self.plane,
            self.budget,
        )
        self._pids[shard] = self._forkserver.spawn(args)

    def _watch(self) -> None:
        """The monitor thread: read the fork server's exit reports (or wait for ``close``), handle each."""
        assert self._wake is not None
        assert self._forkserver is not None
        wake, reports = self._wake[0], self._forkserver.reports
        while True:
            with self._lock:
                if self._closing:
                    return
            ready = wait([reports, wake])
            if wake in ready:
                return
            try:
                pid, exitcode = reports.recv()
            except EOFError:
                log.error("fork server died pid=%d: appliers can no longer be restarted", self._forkserver.pid)
                return
            self._on_exit(pid, exitcode)

    def _on_exit(self, pid: int, exitcode: int) -> None:
        with self._lock:
            if self._closing or pid not in self._pids:
                return
            shard = self._pids.index(pid)
            control = self.control
            took_up = control.pid(shard) == pid
            self._start_failures[shard] = 0 if took_up else self._start_failures[shard] + 1
            log.warning(
                "applier died shard=%d pid=%s exitcode=%s took_up_shard=%s",
                shard,
                pid,
                exitcode,
                took_up,
            )
            self._remove_segments(shard)
            if self._start_failures[shard] >= MAX_START_FAILURES:
                self._pids[shard] = None
                control.set_status(shard, STATUS_STOPPED)
                log.error(
                    "shard left stopped shard=%d: its applier failed to start %d times", shard, MAX_START_FAILURES
                )
                return
            control.add_restart(shard)
            control.set_status(shard, STATUS_RECOVERING)
            self._spawn(shard, STATUS_RECOVERING)
            log.warning(
                "shard restarted shard=%d pid=%s restarts=%d workers=%d",
                shard,
                self._pids[shard],
                control.restarts(shard),
                len(self._known[shard]),
            )

    def _remove_segments(self, shard: int) -> None:
        """Unlink a shard's current segment and its neighbours: a writer killed in the middle of a growth
        may have created the next epoch's segment without publishing it (its replacement needs that
        name), or published it without unlinking the previous one."""
        control = self._control
        assert control is not None
        current = control.segment_name(shard)
        if current:
            unlink_segment(current)
        epoch = control.epoch(shard)
        for neighbour in (epoch - 1, epoch + 1):
            if neighbour > 0:
                unlink_segment(shard_name(self.owner_pid, shard, neighbour))

    # -- shutdown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every applier (kill those that do not stop within ``stop_timeout``) and remove every
        segment, lock file and socket of this supervisor. Safe to call again, and after a failed start.

        In any other process (a fork of the creator, which inherits this object and its ``atexit``
        registration) it does nothing: the appliers and segments are the creator's, and the child's
        copies of the locks may have been taken by a thread that does not exist in the child."""
        if os.getpid() != self.creator_pid:
            return
        with self._lock:
            if self._closing:
                return
            self._closing = True
        atexit.unregister(self.close)
        steps: list[Callable[[], None]] = [
            self._stop_monitor,
            self._stop_appliers,
            self._close_sockets,
            self._remove_files,
        ]
        errors: list[BaseException] = []
        for step in steps:
            try:
                step()
            except Exception as exc:  # every step runs, whatever failed before it
                log.exception("supervisor cleanup step failed step=%s", step.__name__)
                errors.append(exc)
        log.info("supervisor stopped shards=%d", self.shards)
        if errors:
            raise errors[0]

    def _stop_monitor(self) -> None:
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        if self._monitor is not None:
            self._monitor.join()
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None

    def _stop_appliers(self) -> None:
        """Ask every applier to stop, wait for the fork server's reports, kill those that do not stop
        within ``stop_timeout``, then end the fork server. The monitor thread is stopped by now."""
        server = self._forkserver
        if server is None:
            return
        for shard, socket in enumerate(self._sockets):
            if self._pids[shard] is not None:
                with contextlib.suppress(zmq.ZMQError):
                    socket.send_multipart(stop_frames(), flags=zmq.NOBLOCK)
        live = {pid for pid in self._pids if pid is not None}
        deadline = time.monotonic() + self.stop_timeout
        killed = False
        while live:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not killed:
                for pid in live:
                    log.warning("applier did not stop, killing pid=%s", pid)
                    server.kill(pid)
                killed = True
            if not server.reports.poll(max(remaining, 0.0) if not killed else None):
                continue
            try:
                pid, _ = server.reports.recv()
            except EOFError:
                log.error("fork server died while appliers stopped pid=%d", server.pid)
                break
            live.discard(pid)
        self._pids = [None] * self.shards
        self._forkserver = None
        server.close()

    def _close_sockets(self) -> None:
        for socket in self._sockets:
            socket.close(linger=0)
        self._sockets = []
        if self._context is not None:
            self._context.term()
            self._context = None

    def _remove_files(self) -> None:
        control = self._control
        if control is not None:
            for shard in range(self.shards):
                self._remove_segments(shard)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock_path(self.owner_pid, shard))
            self._control = None
            control.close()
            control.unlink()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if self._owner_lock is not None:  # last: until here a sweeper must see our files as owned
            with contextlib.suppress(FileNotFoundError):
                os.unlink(owner_lock_path(self.owner_pid))
            os.close(self._owner_lock)
            self._owner_lock = None
