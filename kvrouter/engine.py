"""``Engine``: the shared-memory index as one object: start, feed events, flush, query, stop.

The engine is the supervisor of ``index/supervisor.py`` plus an ``IndexReader``: events go to the
applier owning their worker's shard and are applied there, asynchronously; queries read the shards'
tables directly, lock-free (``docs/shm-engine.md``). So an event is not visible the moment
``apply_event`` returns, and its error, if any, is counted in the control segment rather than
raised: ``flush()`` is the barrier that makes everything sent before it visible, and ``stats()`` the
place errors show up, by kind. The rejected alternative, a synchronous round trip per event, would
cost the applier's throughput (``spec/shm-engine.md`` §5) for an answer the event plane only counts.
What is checked at once is what the caller got wrong: an event dict that does not decode, or an
event of another worker, raises ``BadEvent`` before anything is sent.

Any other process reads the same index through :func:`attach` with the picklable
:meth:`Engine.reader_handle`; it maps the segments read-only and never writes.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import zmq

from .errors import BadEvent, ConfigError, EngineError, FlushTimeout
from .events.codecs.dynamo import event_from_dict
from .events.codecs.kvrouter import Encoder
from .events.model import EventBatch, KvEvent, StorageTier, WorkerKey
from .index.applier import EVENTS, clear_frames, flush_frames, touch_frames
from .index.dense import WorkerSlots
from .index.layout import (
    EVICT_REASONS,
    MAX_INDEX_BLOCKS,
    NO_ID,
    STATUS_RECOVERING,
    STATUS_STARTING,
    STATUS_STOPPED,
    STATUS_UP,
    W_BAD_FRAMES,
    W_CACHED,
    W_CACHED_BY_TIER,
    W_DP_RANK,
    W_DROPPED_BLOCKS,
    W_EVENTS,
    W_EVICTED_BY_REASON,
    W_GAPS_DETECTED,
    W_GAPS_LOST,
    W_GAPS_RECOVERED,
    W_IN_USE,
    W_LAST_EVENT_NS,
    W_LAST_ID,
    W_RESTARTS,
    W_SEEN,
    W_SKIPPED_EVENTS,
    W_STALE,
    W_STATE,
    W_WORKER_ID,
    WORKER_STATES,
    Control,
    unpack_seen,
)
from .index.reader import DecisionWalk, IndexReader, ListMatch
from .index.supervisor import STOP_TIMEOUT, Supervisor
from .plane.config import PlaneConfig
from .plane.registry import FORMATS, WorkerSpec

__all__ = [
    "Engine",
    "EngineView",
    "ReaderHandle",
    "ShardStats",
    "WorkerStats",
    "attach",
    "default_shards",
    "read_shards",
    "read_worker_rows",
    "read_workers",
    "worker_key",
]

log = logging.getLogger(__name__)

FLUSH_TIMEOUT: Final = 10.0
"""Seconds ``flush`` waits by default for every applier to reach its token [s]."""
START_TIMEOUT: Final = 120.0
"""Seconds ``start`` waits for every applier to come up; the first start of a machine compiles the
numba kernels, which takes tens of seconds on a small VM [s]."""
SMALL_MACHINE_CORES: Final = 4
"""Up to this many cores one applier is right (``DESIGN.md`` component 4, ``spec/shm-engine.md`` §4.1)."""
LARGE_MACHINE_SHARDS: Final = 4
FIRST_POLL_S: Final = 20e-6
MAX_POLL_S: Final = 1e-3
"""Waits poll the control segment starting at ``FIRST_POLL_S``, doubling up to ``MAX_POLL_S`` [s]."""
START_POLL_MAX_S: Final = 0.05
"""The start waits longer between polls: it lasts up to a numba compile [s]."""

_TIER_WORDS: Final = tuple((tier.value, word) for tier, word in zip(StorageTier, W_CACHED_BY_TIER, strict=True))
_EVICTED_WORDS: Final = tuple(zip(EVICT_REASONS, W_EVICTED_BY_REASON, strict=True))
"""(key, row word) of ``WorkerStats``' two maps. Built once: iterating the tier enum and reading each
``.value`` was a third of ``WorkerStats.of_row`` (4.2 of 12 µs), which every health tick pays per worker."""

STATUS_NAMES: Final = {
    STATUS_STARTING: "starting",
    STATUS_UP: "up",
    STATUS_RECOVERING: "recovering",
    STATUS_STOPPED: "stopped",
}


def default_shards() -> int:
    """1 shard on machines with up to 4 cores, else 4."""
    return 1 if (os.cpu_count() or 1) <= SMALL_MACHINE_CORES else LARGE_MACHINE_SHARDS


@dataclass(frozen=True, slots=True)
class ReaderHandle:
    """What another process needs to read an engine's index: pickle it, send it, :func:`attach` it."""

    control_name: str
    """The engine's control segment in ``/dev/shm``."""


def attach(handle: ReaderHandle) -> IndexReader:
    """Map an engine's index read-only in this process; close the reader when done.

    The reader answers as :meth:`Engine.find_matches` does and never writes to the segments, so any
    number of processes may attach. It follows shard growth and applier restarts on its own.
    """
    return IndexReader(handle.control_name)


@dataclass(frozen=True, slots=True)
class ShardStats:
    """One shard as its control block shows it at the time of the call."""

    shard: int
    status: str
    """``starting``, ``up``, ``recovering`` (restarted, content being rebuilt) or ``stopped``."""
    pid: int
    """The applier process writing the shard (0 before the first one took it up)."""
    epoch: int
    """Bumped with every new segment: growth, compaction, restart."""
    restarts: int
    segment: str
    """The shard segment's name in ``/dev/shm``."""
    flushed: int
    """The last flush token the applier reached."""
    events_applied: int
    last_event_ns: int
    """When the last event was applied, ``time.time_ns()``; 0 if none was."""
    lag_us: int = 0
    """The index lag: engine stamp to applied, smoothed over batches (``layout.S_LAG``); 0 before any."""
    errors: Mapping[str, int] = field(default_factory=dict)
    """Events rejected, by kind (``bad_event``, ``parent_not_found``, ...)."""
    workers: Mapping[WorkerKey, int] = field(default_factory=dict)
    """The (worker_id, dp_rank) the shard holds, with their cached device blocks."""
    entries: int = 0
    """(worker, block) entries in the shard, every tier: what the index cap counts."""
    budget: int = 0
    """The shard's share of the index cap (``Engine(max_index_blocks=)`` // shards); 0: no cap."""
    evicted: Mapping[str, int] = field(default_factory=dict)
    """Entries the cap evicted, by reason (``untrusted``, ``lru``), since the engine started."""
    after_eviction: int = 0
    """Events naming a block the cap had evicted (not counted as errors)."""
    touched: int = 0
    """Blocks the front's decisions matched that the applier stamped for the cap's order."""


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One (worker, dp_rank) as the event plane follows it, from its row of the control segment."""

    shard: int
    state: str
    """``exact`` (every event accounted for), ``partial`` (history lost), ``restoring`` (a restore or gap
    recovery in flight) or ``unknown`` (nothing heard yet, no recovery endpoint to ask)."""
    stale: bool
    """Nothing heard for ``PlaneConfig.stale_after`` seconds."""
    cached_blocks: int
    """Device blocks the index holds for it (``cached_by_tier["device"]``)."""
    cached_by_tier: Mapping[str, int]
    """Blocks the index holds for it in each tier, by ``StorageTier`` value (``device``, ``host``, ``disk``,
    ``shared``; all four always present). A block held in two tiers counts in both."""
    last_id: int | None
    """The last sequence number (vLLM, SGLang) or event id (kvrouter format) applied."""
    last_event_ns: int
    """When its last message arrived (``time.time_ns()``), or when it was registered."""
    gaps_detected: int
    gaps_recovered: int
    gaps_lost: int
    dropped_blocks: int
    """Blocks not indexed: their block size differs from the registered one."""
    skipped_events: int
    """Events of another attention group (``group_idx`` != 0), skipped."""
    bad_frames: int
    restarts: int
    """Engine restarts seen (ids went back to 0)."""
    events: int
    """Events applied from its stream."""
    foreign_block_size: int = 0
    """The block size of stores dropped for not being the registered one (0: none seen)."""
    foreign_format: str | None = None
    """A format that decodes frames the registered one refused (None: none found)."""
    foreign_rank: int | None = None
    """A dp rank whose batches arrived on this rank's port (None: none did)."""
    evicted: Mapping[str, int] = field(default_factory=dict)
    """Its entries the index cap evicted, by reason (``untrusted``, ``lru``). Not a trust state: every event
    of the worker is still accounted; the index holds less than its cache on purpose."""

    @classmethod
    def of_row(cls, shard: int, row: Sequence[int]) -> WorkerStats:
        return cls(
            shard=shard,
            state=WORKER_STATES.get(row[W_STATE], "unknown"),
            stale=bool(row[W_STALE]),
            cached_blocks=row[W_CACHED],
            cached_by_tier={value: row[word] for value, word in _TIER_WORDS},
            last_id=None if row[W_LAST_ID] == NO_ID else row[W_LAST_ID],
            last_event_ns=row[W_LAST_EVENT_NS],
            gaps_detected=row[W_GAPS_DETECTED],
            gaps_recovered=row[W_GAPS_RECOVERED],
            gaps_lost=row[W_GAPS_LOST],
            dropped_blocks=row[W_DROPPED_BLOCKS],
            skipped_events=row[W_SKIPPED_EVENTS],
            bad_frames=row[W_BAD_FRAMES],
            restarts=row[W_RESTARTS],
            events=row[W_EVENTS],
            **_seen(row[W_SEEN]),
            evicted={reason: row[word] for reason, word in _EVICTED_WORDS},
        )


class Engine:
    """The shared-memory index: ``shards`` applier processes writing, lock-free readers.

    Use it as a context manager (or call :meth:`start` and :meth:`close`); leaving the ``with`` stops
    the appliers and removes every segment, also when the block raised. One engine per process: the
    segment names carry the owner's pid. Any thread may call any method; queries through the engine
    take turns on its one reader, so a thread that queries a lot should :func:`attach` its own.

    Args:
        shards: applier processes; 1 on machines with up to 4 cores, else 4, by default.
        flush_timeout: seconds :meth:`flush` waits by default.
        start_timeout: seconds :meth:`start` waits for every applier to come up.
        stop_timeout: seconds :meth:`close` gives the appliers before killing them.
        plane: the event plane's timeouts and bounds for workers given to :meth:`add_worker`.
        max_index_blocks: the index cap, in (worker, block) entries over every shard and tier; each
            shard's applier keeps its share (``max_index_blocks // shards``) by evicting (``evict`` in
            ``index/_kernels.py``). 0: no cap.

    Raises:
        ConfigError: ``shards`` below 1, ``max_index_blocks`` below 0.
    """

    def __init__(
        self,
        shards: int | None = None,
        *,
        flush_timeout: float = FLUSH_TIMEOUT,
        start_timeout: float = START_TIMEOUT,
        stop_timeout: float = STOP_TIMEOUT,
        plane: PlaneConfig | None = None,
        max_index_blocks: int = MAX_INDEX_BLOCKS,
    ) -> None:
        shards = default_shards() if shards is None else shards
        if shards < 1:
            raise ConfigError(f"Engine shards: expected at least 1, got {shards}")
        if max_index_blocks < 0:
            raise ConfigError(f"Engine max_index_blocks: expected 0 (no cap) or more, got {max_index_blocks}")
        self.shards = shards
        """Number of shards (applier processes)."""
        self.max_index_blocks = max_index_blocks
        """The index cap in (worker, block) entries, 0 for none."""
        self.flush_timeout = flush_timeout
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.plane = plane or PlaneConfig()
        """How appliers follow workers given to :meth:`add_worker`: timeouts, bounds."""
        self._supervisor: Supervisor | None = None
        self._creator_pid = 0
        """The process that started the engine: only it stops the appliers and removes the segments."""
        self._reader: IndexReader | None = None
        self._list_match: ListMatch
        """The reader's list path, set with ``_reader`` (read only while that is set)."""
        self._query_lock = threading.Lock()
        """The engine's reader remaps segments as they move: one query at a time through it."""
        self._encoder = Encoder()
        self._tokens = itertools.count(1)

    # -- lifetime -----------------------------------------------------------------------------

    def start(self, *, wait: bool = True) -> Engine:
        """Fork the appliers and wait until every shard is up.

        Args:
            wait: False forks only the fork server (the one fork this process makes, which must come
                before any thread) and returns at once; :meth:`finish_start` forks the appliers and waits,
                and may run on another thread (``kvrouter up`` answers ``/health`` meanwhile: on a cold
                numba cache the appliers' kernels take minutes to compile). Queries before it ends raise
                ``EngineError``.

        Raises:
            EngineError: already started, another engine runs in this process, or an applier did not come up.
        """
        if self._supervisor is not None:
            raise EngineError("the engine is already started")
        self._creator_pid = os.getpid()
        self._supervisor = Supervisor(
            self.shards,
            stop_timeout=self.stop_timeout,
            plane=self.plane,
            defer=True,
            max_index_blocks=self.max_index_blocks,
        )
        if wait:
            self.finish_start()
        return self

    def finish_start(self) -> None:
        """What :meth:`start` with ``wait=False`` left: fork the appliers, wait until every shard is up, map
        the shards for queries. On failure the engine is closed.

        Raises:
            EngineError: not started, or an applier did not come up.
        """
        supervisor = self._supervisor
        if supervisor is None:
            raise EngineError("the engine is not started: call start() first")
        try:
            supervisor.complete_start()
            self._wait_up(supervisor)
            reader = IndexReader(supervisor.control.name, self._query_lock)
            with self._query_lock:
                self._reader, self._list_match = reader, reader.list_match()
        except BaseException:
            self.close()
            raise

    def _wait_up(self, supervisor: Supervisor) -> None:
        control = supervisor.control
        deadline = time.monotonic() + self.start_timeout
        delay = FIRST_POLL_S
        while True:
            statuses = [control.status(shard) for shard in range(self.shards)]
            serving = [control.pid(shard) == pid for shard, pid in enumerate(supervisor.pids())]
            if all(serving) and all(status in (STATUS_UP, STATUS_RECOVERING) for status in statuses):
                return  # recovering: restarted during the start, and serving
            if STATUS_STOPPED in statuses or time.monotonic() > deadline:
                names = [STATUS_NAMES.get(s, str(s)) for s in statuses]
                raise EngineError(f"engine start: appliers did not come up within {self.start_timeout}s: {names}")
            time.sleep(delay)
            delay = min(delay * 2, START_POLL_MAX_S)

    def close(self) -> None:
        """Stop the appliers and remove every segment; safe to call again.

        Only in the process that started the engine: a forked child that leaves the ``with`` (or exits,
        through the supervisor's ``atexit`` hook) leaves the parent's engine running and its segments in
        place."""
        if self._supervisor is not None and os.getpid() != self._creator_pid:
            return
        with self._query_lock:
            reader, self._reader = self._reader, None
        supervisor = self._supervisor
        try:
            if reader is not None:
                reader.close()
        finally:
            if supervisor is not None:
                supervisor.close()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _running(self) -> Supervisor:
        supervisor = self._supervisor
        if supervisor is None or self._reader is None:
            raise EngineError("the engine is not running: use it inside `with Engine(...)`, or call start()")
        return supervisor

    # -- events -------------------------------------------------------------------------------

    def apply_event(self, worker_id: int, event: KvEvent | Mapping[str, Any]) -> None:
        """Send one event of ``worker_id`` to its shard: a kvrouter event or the reference's
        ``KvCacheEvent`` dict. It is applied asynchronously; :meth:`flush` waits for it, and an error it
        meets there is counted in :meth:`stats` by kind.

        Raises:
            BadEvent: the dict is not a valid event, or the event belongs to another worker.
            EngineError: the engine is not running.
        """
        supervisor = self._running()
        if isinstance(event, Mapping):
            event = event_from_dict(event, worker_id)
        elif event.worker_id != worker_id:
            raise BadEvent(f"event {event.event_id} of worker {event.worker_id} applied as worker {worker_id}")
        try:
            payload = self._encoder.encode(EventBatch((event,), dp_rank=event.dp_rank))
        except (OverflowError, TypeError, ValueError) as exc:  # numpy / msgpack on out-of-range values
            raise BadEvent(f"event {event.event_id} of worker {worker_id}: {exc}") from exc
        supervisor.send(supervisor.shard_for((worker_id, event.dp_rank)), [EVENTS, payload])

    def apply_payload(self, worker: WorkerKey, payload: bytes) -> None:
        """Send one pre-encoded kvrouter batch of ``worker`` to its shard, undecoded: the fast path.

        The batch must carry ``worker``'s events (it names its worker and dp rank itself); a payload
        that does not decode is counted as ``bad_event`` by the applier.

        Raises:
            EngineError: the engine is not running.
        """
        supervisor = self._running()
        supervisor.send(supervisor.shard_for(worker), [EVENTS, payload])

    def touch(self, worker: WorkerKey, seq_hashes: npt.NDArray[np.uint64]) -> None:
        """Tell the shard owning ``worker`` that a decision matched these blocks (sequence hashes): they
        become the most recently used in the index cap's order (``ShardWriter.touch``), asynchronously.
        Nothing without a cap, or for a worker no shard owns.

        Raises:
            EngineError: the engine is not running.
        """
        supervisor = self._running()
        shard = supervisor.owner(worker)
        if self.max_index_blocks and shard is not None and len(seq_hashes):
            supervisor.send(shard, touch_frames(seq_hashes))

    def add_worker(self, spec: WorkerSpec) -> None:
        """Follow a worker's KV events over ZMQ: each dp rank's applier subscribes to it, restores it from its
        replay socket or local indexer, and tracks its gaps (``plane/stream.py``). The worker is routable at
        once, with overlap 0 until its restore lands. Registering a worker again replaces it: its old
        streams and blocks go first.

        Raises:
            EngineError: the engine is not running.
        """
        self._running().follow(spec)

    def remove_worker(self, worker_id: int) -> None:
        """Forget every dp rank of ``worker_id``: its subscriptions, its blocks and its rows, in order with its
        events."""
        self._running().unfollow(worker_id)

    def followed(self) -> list[WorkerSpec]:
        """The workers registered with :meth:`add_worker` and not removed since."""
        return self._running().specs()

    def clear_all_blocks(self, worker_id: int) -> None:
        """Release every block of every dp rank of ``worker_id``; the worker stays known."""
        supervisor = self._running()
        for shard in supervisor.shards_of(worker_id):
            supervisor.send(shard, clear_frames(worker_id))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every shard has applied everything sent to it before this call.

        A shard whose applier restarts meanwhile is sent the flush again (what the dead one had not
        applied is gone; the replacement answers for what it received).

        Raises:
            FlushTimeout: some shard did not get there within ``timeout`` (default ``flush_timeout``).
            EngineError: the engine is not running.
        """
        supervisor = self._running()
        control = supervisor.control
        timeout = self.flush_timeout if timeout is None else timeout
        token = next(self._tokens)
        restarts = [control.restarts(shard) for shard in range(self.shards)]
        for shard in range(self.shards):
            supervisor.send(shard, flush_frames(token))
        pending = list(range(self.shards))
        deadline = time.monotonic() + timeout
        delay = FIRST_POLL_S
        while True:
            for shard in list(pending):
                if control.flushed(shard) >= token:
                    pending.remove(shard)
                elif control.restarts(shard) != restarts[shard]:
                    restarts[shard] = control.restarts(shard)
                    supervisor.send(shard, flush_frames(token))
            if not pending:
                return
            if time.monotonic() > deadline:
                states = {shard: STATUS_NAMES.get(control.status(shard), "?") for shard in pending}
                raise FlushTimeout(f"flush {token}: shards {states} did not apply their queue within {timeout}s")
            time.sleep(delay)
            delay = min(delay * 2, MAX_POLL_S)

    # -- queries ------------------------------------------------------------------------------

    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> dict[WorkerKey, int]:
        """Per worker, the leading query blocks it holds on device (``RadixIndex.find_matches``).

        Reads what the appliers have applied so far; :meth:`flush` first to see every event sent.

        Raises:
            EngineError: the engine is not running.
        """
        lock = self._query_lock
        lock.acquire()  # hot path: not `with`, and a list answered here (ListMatch): 1.5 µs of 9 once evicted
        try:
            reader = self._reader
            if reader is None:
                raise EngineError("the engine is not running: use it inside `with Engine(...)`, or call start()")
            if type(local_hashes) is not list or not local_hashes:
                return reader.find_matches(local_hashes, early_exit)
            found = self._list_match  # its fields by name: a tuple subclass unpacks by iterating
            count = found.match(found.ctx, id(local_hashes))
            return found.answer[0] if count >= 0 and not found.torn else found.finish(local_hashes, count)
        finally:
            lock.release()

    def find_matches_by_tier(self, local_hashes: Sequence[int]) -> dict[StorageTier, dict[WorkerKey, int]]:
        """Per tier, per worker, the leading query blocks held in that tier or a faster one."""
        with self._query_lock:
            return self._query_reader().find_matches_by_tier(local_hashes)

    def overlaps(self, local: npt.NDArray[np.uint64], slots: WorkerSlots, ntiers: int) -> npt.NDArray[np.int64]:
        """``(ntiers, len(slots))``: per tier, per slot, the leading blocks of ``local`` held in that tier or a
        faster one, 0 for slots no shard holds (:meth:`IndexReader.overlaps`): the router's array path.

        Raises:
            ConfigError: ``ntiers`` outside 1..4.
            EngineError: the engine is not running.
        """
        with self._query_lock:
            return self._query_reader().overlaps(local, slots, ntiers)

    def decision_walk(self) -> DecisionWalk:
        """The reader's :class:`DecisionWalk`: the router walks the index inside its compiled decision, under
        the query lock, or through :meth:`IndexReader.overlaps_and`, which raises ``EngineError`` once the
        engine closed. A method of the engine around the walk cost every decision a frame (about a
        microsecond, once the caller's other work evicted it).

        Raises:
            EngineError: the engine is not running.
        """
        with self._query_lock:
            return self._query_reader().decision_walk()

    def _query_reader(self) -> IndexReader:
        """The engine's reader, under ``_query_lock``: set from a successful start until close."""
        reader = self._reader
        if reader is None:
            raise EngineError("the engine is not running: use it inside `with Engine(...)`, or call start()")
        return reader

    def reader_handle(self) -> ReaderHandle:
        """A picklable handle for :func:`attach` in another process (or an :class:`EngineView` in this one).
        Valid from :meth:`start` on, before the appliers are up: their shards read as empty until then."""
        if self._supervisor is None:
            raise EngineError("the engine is not started: call start() first")
        return ReaderHandle(self._supervisor.control.name)

    def unanswered(self) -> frozenset[int]:
        """:meth:`IndexReader.unanswered`: the shards the last query could not read (``--record`` keeps them
        with each decision, so a replay sees what the decision saw)."""
        with self._query_lock:
            return self._query_reader().unanswered()

    def applier_endpoints(self) -> tuple[str, ...]:
        """Each shard's applier's ``ipc://`` address, in shard order: where an :class:`EngineView` in another
        process of this machine sends the blocks its decisions matched (:meth:`EngineView.touch`)."""
        supervisor = self._running()
        return tuple(supervisor.endpoint(shard) for shard in range(supervisor.shards))

    def workers(self) -> dict[WorkerKey, WorkerStats]:
        """Every (worker, dp_rank) of every shard as its row in the control segment shows it now."""
        return read_workers(self._running().control)

    def worker_rows(self) -> list[tuple[int, npt.NDArray[np.uint64]]]:
        """:meth:`workers` before the :class:`WorkerStats` are made (:func:`read_worker_rows`)."""
        return read_worker_rows(self._running().control)

    def stats(self, *, workers: bool = True) -> list[ShardStats]:
        """Every shard's status, applier, segment and counters, read from the control segment;
        ``workers=False`` leaves :attr:`ShardStats.workers` empty (:func:`read_shards`)."""
        return read_shards(self._running().control, workers=workers)


TOUCH_QUEUE: Final = 4096
"""Touch messages an :class:`EngineView` queues for one applier (one a worker a health tick) before it drops
them: an applier that is stopped or restarting is not waited for, and what waits for it stays bounded."""


class EngineView:
    """An engine that another process of this machine runs, seen through its segments: what a second
    front of ``kvrouter up --fronts N`` routes with. It answers every query :class:`Engine` answers and
    reads the same control segment for ``stats`` and ``workers``, but follows no worker: registration
    belongs to the process that owns the engine (``service/fronts.py``).

    Not thread-safe (one reader, no lock): one event loop uses it.

    Args:
        handle: the owner's :meth:`Engine.reader_handle`.
        applier_endpoints: the owner's :meth:`Engine.applier_endpoints`, for :meth:`touch`; none: the
            view's matches do not reach the index cap's order.
    """

    def __init__(self, handle: ReaderHandle, applier_endpoints: Sequence[str] = ()) -> None:
        self.handle = handle
        self._control = Control.attach(handle.control_name)
        try:
            self._reader = attach(handle)
        except BaseException:
            self._control.close()
            raise
        self._open = True
        self._endpoints = tuple(applier_endpoints)
        self._pushes: dict[int, zmq.Socket[bytes]] = {}
        """One PUSH per shard touched, connected on first use."""
        self._owners: dict[WorkerKey, int] = {}
        self.touches_dropped = 0
        """Touch messages not sent because the applier's queue was full (the order is a hint: never waited for)."""

    def touch(self, worker: WorkerKey, seq_hashes: npt.NDArray[np.uint64]) -> None:
        """:meth:`Engine.touch` from this process: the matched blocks go straight to the owning applier's
        ``ipc://`` socket, beside the owner's messages, so every front's decisions feed the index cap's
        least-recently-used order. Never blocks: with the applier's queue full the message is dropped and
        counted. Nothing without a cap, without endpoints, or for a worker no shard has a row for yet."""
        if not self._endpoints or not len(seq_hashes):
            return
        shard = self._owners.get(worker)
        if shard is None:  # shards never move a worker, so the map is read again only for a new one
            self._owners = {key: stats.shard for key, stats in read_workers(self._control).items()}
            shard = self._owners.get(worker)
            if shard is None:
                return
        if not self._control.cap(shard)[1]:
            return
        push = self._pushes.get(shard)
        if push is None:
            push = self._pushes[shard] = zmq.Context.instance().socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, TOUCH_QUEUE)
            push.connect(self._endpoints[shard])
        try:
            push.send_multipart(touch_frames(seq_hashes), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.touches_dropped += 1
            if self.touches_dropped == 1:
                log.warning(
                    "index cap: matched blocks for shard %d dropped, %d messages queued for its applier",
                    shard,
                    TOUCH_QUEUE,
                )

    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> dict[WorkerKey, int]:
        return self._reader.find_matches(local_hashes, early_exit)

    def find_matches_by_tier(self, local_hashes: Sequence[int]) -> dict[StorageTier, dict[WorkerKey, int]]:
        return self._reader.find_matches_by_tier(local_hashes)

    def overlaps(self, local: npt.NDArray[np.uint64], slots: WorkerSlots, ntiers: int) -> npt.NDArray[np.int64]:
        return self._reader.overlaps(local, slots, ntiers)

    def decision_walk(self) -> DecisionWalk:
        return self._reader.decision_walk()

    def reader_handle(self) -> ReaderHandle:
        return self.handle

    def unanswered(self) -> frozenset[int]:
        return self._reader.unanswered()

    def workers(self) -> dict[WorkerKey, WorkerStats]:
        return read_workers(self._control)

    def worker_rows(self) -> list[tuple[int, npt.NDArray[np.uint64]]]:
        return read_worker_rows(self._control)

    def stats(self, *, workers: bool = True) -> list[ShardStats]:
        return read_shards(self._control, workers=workers)

    def close(self) -> None:
        """Unmap (the owner unlinks) and close this view's sockets: idempotent."""
        if self._open:
            self._open = False
            for push in self._pushes.values():
                push.close()
            self._pushes.clear()
            self._reader.close()
            self._control.close()


def _seen(word: int) -> dict[str, Any]:
    size, code, rank = unpack_seen(word)
    return {
        "foreign_block_size": size,
        "foreign_format": FORMATS[code - 1] if 0 < code <= len(FORMATS) else None,
        "foreign_rank": rank,
    }


def read_worker_rows(control: Control) -> list[tuple[int, npt.NDArray[np.uint64]]]:
    """(shard, its rows in use) for every shard of ``control``, copied at once: about 0.1 ms for thousands
    of workers, where their :class:`WorkerStats` take about 8 µs each (``WorkerStats.of_row`` of a row's
    ``tolist()``), so a caller on an event loop can make those in slices."""
    taken: list[tuple[int, npt.NDArray[np.uint64]]] = []
    for shard in range(control.shards):
        rows = control.worker_rows(shard)
        taken.append((shard, rows[rows[:, W_IN_USE] != 0]))
    return taken


def worker_key(row: Sequence[int]) -> WorkerKey:
    """The (worker_id, dp_rank) a row of :func:`read_worker_rows` belongs to."""
    return row[W_WORKER_ID], row[W_DP_RANK]


def read_workers(control: Control) -> dict[WorkerKey, WorkerStats]:
    """Every (worker, dp_rank) of every shard of ``control`` as its row shows it now.

    A plain function of the control segment, so another process that attached it read-only
    (``Control.attach(name)``: ``kvrouter top``) reads what :meth:`Engine.workers` reads, without an engine.
    """
    return {
        worker_key(row): WorkerStats.of_row(shard, row)
        for shard, rows in read_worker_rows(control)
        for row in rows.tolist()
    }


def read_shards(control: Control, *, workers: bool = True) -> list[ShardStats]:
    """Every shard's status, applier, segment and counters in ``control`` (:meth:`Engine.stats`, from any process).

    ``workers=False`` reads no worker row (``ShardStats.workers`` is then empty): the health tick, ``/ready``
    and the stats publisher want the shards' words only, and the rows cost 4-7 ms at 4,096 workers."""
    shards = []
    for shard in range(control.shards):
        counters = control.stats(shard)
        events_applied = counters.pop("events_applied")
        last_event_ns = counters.pop("last_event_ns")
        lag_us = counters.pop("lag_us")
        entries, budget, evicted, after_eviction = control.cap(shard)
        held = {(wid, rank): cached for wid, rank, cached in control.workers(shard).values()} if workers else {}
        shards.append(
            ShardStats(
                shard=shard,
                status=STATUS_NAMES.get(control.status(shard), "unknown"),
                pid=control.pid(shard),
                epoch=control.epoch(shard),
                restarts=control.restarts(shard),
                segment=control.segment_name(shard),
                flushed=control.flushed(shard),
                events_applied=events_applied,
                last_event_ns=last_event_ns,
                lag_us=lag_us,
                errors=counters,
                workers=held,
                entries=entries,
                budget=budget,
                evicted=evicted,
                after_eviction=after_eviction,
                touched=control.touched(shard),
            )
        )
    return shards
