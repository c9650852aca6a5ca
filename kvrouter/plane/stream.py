"""``Stream``: one (worker, dp_rank) followed in order — its cursor, its gaps, its recoveries.

Every message a worker publishes is a *unit* with a first and a last id: the ZMQ sequence number for
vLLM and SGLang (one per batch; their events carry no ids), the event ids for kvrouter-format workers
(consecutive per worker and rank). The stream expects ``cursor + 1`` (0 before anything was applied) and
reads every arrival against it (``spec/dynamo-semantics.md`` §6.3):

| arrival | meaning | action |
|---|---|---|
| first == expected | in order | apply |
| first > expected | a gap: messages lost (HWM, slow joiner) | ``detected``; recover from expected, buffer live units |
| first < expected | ids went back: the engine restarted | a fresh worker state: clear its blocks, read the unit anew |

Recovery asks the worker for what is missing: the engine's replay socket (every buffered batch from a
sequence number on) or a kvrouter worker's local indexer (Events in a range, a TreeDump of its whole cache,
or TooNew when the worker is behind us, i.e. restarted). Live units arriving meanwhile are buffered, then
de-duplicated by id and applied after the recovered range. A gap ends ``recovered`` when every missing id
came back (or a dump replaced the worker's state), ``lost`` otherwise: history older than the peer's
buffer, no recovery endpoint, a peer silent for ``recovery_timeout`` seconds, a buffer past its bound.
Nothing is dropped silently: each unit is applied, counted as a duplicate, or accounted in a lost gap.

A worker joining (first registration, or its applier restarted) is restored before its live units count:
a full dump from a local indexer, or a replay from sequence 0. vLLM and SGLang keep only recent batches
and have no dump, so a join to a long-running engine loses the history before its replay buffer; that is
counted as a lost gap and the worker marked ``partial``, as is every gap that could not be recovered. A
kvrouter worker left partial by a timeout gets a fresh full restore after ``restore_retry`` seconds, so it
becomes ``exact`` again once its indexer answers; an engine becomes ``exact`` again when it restarts.

The stream is transport-agnostic above its two sockets: decoding is a function of the payload, the
writer is the shard's, and the applier's loop calls :meth:`on_drain`, :meth:`on_recovery` and
:meth:`tick`. Its counters live in the worker's row of the control segment (``index/layout.py``), where
``engine.workers()``, the service's metrics and ``kvrouter top`` read them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt
import zmq

from ..errors import BadEvent, ConfigError, InvalidHashInput
from ..events.codecs import sglang, vllm
from ..events.codecs.frames import ReplayEnd, ReplayFrame
from ..events.codecs.kvrouter import Decoder, RawBatch, RawEvent
from ..events.codecs.query import QueryReply
from ..events.codecs.runs import C_EVENTS, C_MIXED, C_NEXT, C_SKIPPED, NEED_ROOM, RunBuffers, RunDecoder
from ..events.model import WorkerKey
from ..index.layout import (
    NO_ID,
    W_BAD_FRAMES,
    W_DROPPED_BLOCKS,
    W_EVENTS,
    W_GAPS_DETECTED,
    W_GAPS_LOST,
    W_GAPS_RECOVERED,
    W_LAST_EVENT_NS,
    W_LAST_ID,
    W_RESTARTS,
    W_SEEN,
    W_SKIPPED_EVENTS,
    W_STALE,
    W_STATE,
    WORKER_EXACT,
    WORKER_PARTIAL,
    WORKER_RESTORING,
    WORKER_UNKNOWN,
    seen_word,
)
from ..index.writer import ShardWriter
from .config import PlaneConfig
from .receive import Drain
from .recovery import QueryClient, RecoveryClient, ReplayClient
from .registry import FORMATS, WorkerSpec
from .tap import Tap

__all__ = ["Stream", "Unit"]

log = logging.getLogger(__name__)

MEMORY_GUARD: Final = 4
"""libzmq drops the connection of a peer whose message passes this many times ``max_message_bytes``,
before it is in memory; smaller oversized messages reach the stream, which counts and names them."""

Watch = Callable[[zmq.Socket[bytes], "Stream | None"], None]
"""Tells the applier's wakes to watch a socket for a stream (or, with None, to stop watching it)."""


class Unit(NamedTuple):
    """One message of a worker, decoded: the ids it covers and its events as arrays. A named tuple, as
    ``RawEvent``: one is built per message, and a frozen dataclass's ``__init__`` costs a microsecond more."""

    first: int
    last: int
    events: tuple[RawEvent, ...]
    dropped_blocks: int = 0
    skipped_events: int = 0
    sent_at: float = 0.0
    """The batch's engine stamp [s] (0: none), for the index lag."""
    foreign_block_size: int = 0
    """The block size of dropped stores that were not the registered one (0: none)."""
    payload: bytes = b""
    """The message as received, for the recording tap (``tap.py``)."""


GUESS_FRAMES: Final = 8
"""Bad frames of a stream tried against the other formats, to name the one its worker sends."""
TAIL_CHECK_S: Final = 2.0
"""A stream quiet this long after a batch asks its recovery endpoint (the replay socket, or a kvrouter
worker's local indexer) for anything past its cursor. A gap shows only when a later batch arrives: the
last batches before a silence (dropped at a full high-water mark, published while a joining SUB was still
connecting after the join's replay had answered, or published while the NATS relay was reconnecting)
would otherwise stay missing for as long as the engine stays silent. A local indexer answers from its
ring of recent events (an empty ``events`` reply when nothing is missing). While the stream stays quiet
the question is asked again, the wait doubling up to ``TAIL_CHECK_MAX_S``: a loss after an answered
check is found within that bound. The worker's trust state does not change while one is asked, one that
goes unanswered marks nothing lost, and one still unanswered when the next batch arrives in order is
dropped: that batch is applied at once, not held behind the question."""
TAIL_CHECK_MAX_S: Final = 64.0
"""The longest quiet wait between two tail checks of one stream: a quiet fleet of 4,096 workers asks its
engines about 64 questions a second in all [s]."""


@dataclass(slots=True)
class _Recovery:
    """One recovery in flight."""

    client: RecoveryClient
    start: int | None
    """The first missing id, or None for a full restore."""
    gap: bool
    """A counted gap rides on it: it must end ``recovered`` or ``lost``."""
    deadline: float
    missing: str | None = None
    """Why some missing id did not come back (None: all did, so far)."""
    tail: bool = False
    """A quiet-tail check (``TAIL_CHECK_S``): anything it brings back was lost on the wire, a gap."""

    @property
    def routine(self) -> bool:
        """A tail check that has found nothing missing (yet)."""
        return self.tail and not self.gap


def _decoder(spec: WorkerSpec) -> tuple[Callable[[bytes, int], RawBatch], vllm.Decoder | sglang.Decoder | None]:
    """The payload → arrays function of the worker's format (decoding stays out of the writer), and the engine
    decoder behind it (None for kvrouter batches)."""
    if spec.format == "kvrouter":
        decode = Decoder().decode_raw
        return (lambda payload, _first: decode(payload)), None
    codec = vllm if spec.format == "vllm" else sglang
    engine = codec.Decoder(spec.worker_id, spec.block_size)
    return (lambda payload, first: engine.decode_raw(payload, first_event_id=first)), engine


class Stream:
    """One (worker, dp_rank): its SUB socket, its cursor, its recovery, its row of counters."""

    def __init__(
        self,
        spec: WorkerSpec,
        rank: int,
        writer: ShardWriter,
        context: zmq.Context[zmq.Socket[bytes]],
        watch: Watch,
        config: PlaneConfig,
        buffers: RunBuffers,
        tap: Tap | None = None,
    ) -> None:
        """``buffers``: the applier's, which every stream's batch path decodes into, one drain at a time."""
        self.spec = spec
        self._tap = tap
        """Where what is applied is copied when the router records (``tap.py``); None: not recording."""
        self.rank = rank
        self.key: WorkerKey = (spec.worker_id, rank)
        self._writer = writer
        self._context = context
        self._watch = watch
        self._config = config
        self._decode, self._engine = _decoder(spec)
        self.buffers = buffers
        """The applier's: its receive fills them with a drain (``receive.py``) and the batch path reads them."""
        self._runs: RunDecoder | None = RunDecoder(
            None if self._engine is None else self._engine.dialect, spec.worker_id, rank, spec.block_size, buffers
        )
        """The compiled batch path's decoder (``on_drain``); None: every message on its own."""
        self._recovery_endpoint = spec.recovery_endpoint(rank)
        self._where = f"worker={spec.worker_id} dp={rank}"
        self._logged: set[str] = set()
        self._guesses = 0
        """Bad frames tried against the other formats so far (``_guess_format``)."""
        self.cursor: int | None = None
        self.joining = True
        """The first restore has not finished: a restarted shard stays ``recovering`` while any stream joins."""
        self._exact = True
        self._recovery: _Recovery | None = None
        self._buffer: dict[int, Unit] = {}
        self._retry_at: float | None = None
        self._tail_at: float | None = None
        """When to ask the recovery endpoint for what came after the cursor (``TAIL_CHECK_S``); None: not due."""
        self._tail_wait = TAIL_CHECK_S
        """The quiet period before that question: doubled after each that found nothing, up to
        ``TAIL_CHECK_MAX_S``, and back to ``TAIL_CHECK_S`` when a batch arrives."""
        self._events_seen = 0
        if writer.register(self.key) < 0:
            raise BadEvent(f"{self._where}: no free worker row in shard {writer.shard}")
        row = writer.row(self.key)
        assert row is not None
        self.row: npt.NDArray[np.uint64] = row
        """The worker's row of the control segment: a view, fixed for the stream's life (rows do not move)."""
        self._words = row.data
        """The same row as plain words: every message reads and bumps a few, and a numpy scalar bump
        (``row[w] += np.uint64(n)``) costs near a microsecond where a memoryview's costs ~0.1."""
        self.socket: zmq.Socket[bytes] = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, config.subscriber_hwm)
        if config.subscriber_rcvbuf > 0:
            self.socket.setsockopt(zmq.RCVBUF, config.subscriber_rcvbuf)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MEMORY_GUARD * config.max_message_bytes)
        self.socket.setsockopt(zmq.SUBSCRIBE, spec.topic)
        try:
            self.socket.connect(spec.event_endpoint(rank))
        except zmq.ZMQError:  # nothing of a stream that never started stays behind
            self.socket.close(linger=0)
            writer.forget(self.key)
            raise
        watch(self.socket, self)
        if tap is not None:  # a joining worker's row starts empty (a new registration, or a new segment)
            tap.cleared(self.key, "join")
        self._set_state(WORKER_UNKNOWN)
        self._begin_join(time.monotonic())

    # -- the row ------------------------------------------------------------------------------

    def _bump(self, word: int, by: int = 1) -> None:
        self._words[word] += by

    def _set_state(self, state: int) -> None:
        self._words[W_STATE] = state

    def _settle(self) -> None:
        """The state once nothing is in flight."""
        if self.cursor is None and self._exact and not self._events_seen:
            self._set_state(WORKER_EXACT if self._recovery_endpoint else WORKER_UNKNOWN)
        else:
            self._set_state(WORKER_EXACT if self._exact else WORKER_PARTIAL)

    def _warn_once(self, what: str, message: str, *args: object) -> None:
        level = logging.DEBUG if what in self._logged else logging.WARNING
        self._logged.add(what)
        log.log(level, message, *args)

    # -- arrivals -----------------------------------------------------------------------------

    def on_drain(self, drain: Drain, now: float) -> None:
        """A drain of the SUB socket (``receive.py``), its messages in order. Where the stream is steady (no
        recovery in flight, nothing recorded, no salted block remembered), each stretch of messages in
        sequence order goes through the compiled batch path: decoded, hashed and applied in one call each
        (``events/codecs/runs.py``, ``ShardWriter.apply_packed``). The message that ends a stretch (out of
        order, odd, or one that path does not decode) is checked, decoded and read against the cursor on its
        own (``_live``), then the next stretch starts after it."""
        self._heard()
        runs = self._runs
        if runs is None or self._tap is not None or drain.count < runs.least:
            for m in range(drain.count):
                self._live(drain.frames(m), now)
            return
        m = 0
        while m < drain.count:
            if self._steady():
                m = self._run(runs, m, now)
                if m == drain.count:
                    break
            self._live(drain.frames(m), now)
            m += 1

    def _steady(self) -> bool:
        """Whether the next message in order may take the batch path: it is read against a cursor, with no
        recovery to wait for, and no salted chain whose salt only the Python decoder remembers."""
        engine = self._engine
        return (
            self.cursor is not None
            and self._recovery is None
            and not self._buffer
            and (engine is None or not engine.salted)
        )

    def _run(self, runs: RunDecoder, first: int, now: float) -> int:
        """Apply messages ``first``... through the batch path; returns the first it did not take."""
        m = first
        while True:
            status = runs.decode(m, self._expected())
            b = runs.buffers
            end = int(b.counts[C_NEXT])
            if end == m:
                return m
            events = int(b.counts[C_EVENTS])
            self._writer.apply_packed(
                self.key,
                b.kinds[:events],
                b.tiers[:events],
                b.parents[:events],
                b.offsets[: events + 1],
                b.engine,
                b.local,
                float(b.stamps[m]),
                mixed=bool(b.counts[C_MIXED]),
            )
            self._events_seen += events
            self._advance(events, int(b.counts[C_SKIPPED]), runs.last())
            self._quiet_check(now)
            if status != NEED_ROOM:
                return end
            m = end

    def _heard(self) -> None:
        self._words[W_LAST_EVENT_NS] = time.time_ns()
        if self._words[W_STALE]:
            self._words[W_STALE] = 0
            log.info("worker heard again %s", self._where)

    def _live(self, frames: list[bytes], now: float) -> None:
        """One message: checked, decoded, then read against the cursor."""
        unit = self._unit_of_live(frames)
        if unit is None:
            return
        recovery = self._recovery
        if recovery is not None and recovery.routine and not self._buffer and unit.first == self._expected():
            self._close_client(recovery)  # the stream is not quiet any more and nothing before this batch
            recovery = None  # went missing: the check is moot, and the batch need not wait behind it
        if recovery is not None:
            self._hold(unit, now)
        else:
            self._arrive(unit, now)

    def _unit_of_live(self, frames: list[bytes]) -> Unit | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._bad(f"expected [topic, seq(8 bytes), payload], got {len(frames)} frames", "frames")
            return None
        topic, seq_frame, payload = frames
        if topic != self.spec.topic:  # SUB filters by prefix only
            self._bad(f"topic {topic[:64]!r}, registered {self.spec.topic!r}", "topic")
            return None
        return self._unit(int.from_bytes(seq_frame, "big"), payload)

    def _unit(self, seq: int, payload: bytes) -> Unit | None:
        """Decode a payload into a unit; None (counted, logged once) when it cannot be used."""
        if len(payload) > self._config.max_message_bytes:
            self._bad(f"message of {len(payload)} bytes > limit {self._config.max_message_bytes}", "oversized")
            return None
        try:
            batch = self._decode(payload, self._events_seen)
        except BadEvent as exc:
            self._guess_format(payload)  # first: whoever sees the frame counted sees what it decodes as
            self._bad(str(exc), "decode")
            return None
        if (batch.worker_id, batch.dp_rank) != self.key:
            self._bad(f"a batch of worker {batch.worker_id} dp {batch.dp_rank} on this stream", "wrong-worker")
            if batch.worker_id == self.spec.worker_id:  # another rank's events on this rank's port
                self._words[W_SEEN] = seen_word(int(self._words[W_SEEN]), rank=batch.dp_rank)
            return None
        self._events_seen += len(batch.events)
        if self.spec.format != "kvrouter":
            return Unit(
                seq,
                seq,
                batch.events,
                batch.dropped_blocks,
                batch.skipped_events,
                batch.timestamp or 0.0,
                batch.foreign_block_size,
                payload,
            )
        events = batch.events
        if not events:
            return None
        first, last = events[0].event_id, events[-1].event_id
        if len(events) > 1 and [event.event_id for event in events] != list(range(first, first + len(events))):
            self._bad(f"event ids {first}..{last} are not consecutive", "ids")
            return None
        return Unit(first, last, events, sent_at=batch.timestamp or 0.0, payload=payload)

    def _guess_format(self, payload: bytes) -> None:
        """A frame the registered format refused: which format does decode it? Asked for the first bad frames
        only (:data:`GUESS_FRAMES`), so a worker sending garbage costs a few decodes, not one per frame."""
        if self._guesses >= GUESS_FRAMES:
            return
        self._guesses += 1
        for code, name in enumerate(FORMATS, start=1):
            if name == self.spec.format:
                continue
            try:
                batch = _decoder(replace(self.spec, format=name))[0](payload, 0)
            except (BadEvent, ConfigError, InvalidHashInput):
                continue
            if batch.events:
                self._words[W_SEEN] = seen_word(int(self._words[W_SEEN]), format_code=code)
                return

    def _bad(self, what: str, kind: str) -> None:
        self._bump(W_BAD_FRAMES)
        self._writer.count_bad_batch()
        self._warn_once(kind, "bad message %s endpoint=%s: %s", self._where, self.spec.event_endpoint(self.rank), what)
        return None

    def _expected(self) -> int:
        return 0 if self.cursor is None else self.cursor + 1

    def _arrive(self, unit: Unit, now: float, *, draining: bool = False, can_recover: bool = True) -> None:
        expected = self._expected()
        if unit.first < expected:
            if draining and unit.first > 0:
                if unit.last >= expected:
                    self._apply(unit)  # overlaps the recovered range: its tail is new
                return  # came back in the recovery too
            if unit.first > 0 and can_recover and self.spec.format == "kvrouter" and self._recovery_endpoint:
                # not a fresh incarnation's first batch: a copy the NATS relay delivered late (its local indexer
                # answered a dump from events its PUB had not sent yet), or a restart whose first batches we
                # missed; the worker's local indexer tells which: a restart answers TooNew (_on_query)
                log.info("ids went back %s from %d to %d: asking the worker", self._where, expected - 1, unit.first)
                self._start(expected, now, gap=False)
                return
            self._restarted(f"ids went back from {expected - 1} to {unit.first}")
            expected = 0
        if unit.first == expected:
            if self.cursor is None and expected == 0:
                self._exact = True  # the whole history, from the first message on
            self._apply(unit)
            self._quiet_check(now)
            return
        self._gap(expected, unit, now, can_recover=can_recover)

    def _quiet_check(self, now: float) -> None:
        """Ask again for what follows the cursor once the stream has been quiet (``TAIL_CHECK_S``)."""
        if self._recovery_endpoint is not None:
            self._tail_wait = TAIL_CHECK_S
            self._tail_at = now + TAIL_CHECK_S

    def _restarted(self, why: str) -> None:
        """The engine restarted: what it held is gone; its next ids start a fresh history."""
        self._bump(W_RESTARTS)
        log.warning("engine restart %s: %s; its blocks are cleared", self._where, why)
        self._writer.clear_worker(self.key)
        if self._tap is not None:
            self._tap.cleared(self.key, "restart")
        self._decode, self._engine = _decoder(self.spec)  # the salted blocks the old one knew were the last life's
        self.cursor = None
        self._exact = True
        self._words[W_LAST_ID] = NO_ID

    def _apply(self, unit: Unit, *, recovered: bool = False) -> None:
        """Apply what of ``unit`` is new; ``recovered``: it came from a replay socket or a local indexer (the
        recording tap says so: a live replay re-publishes history only where the router had to fetch it)."""
        events = unit.events
        if self.cursor is not None and unit.first <= self.cursor:  # overlaps what is applied: keep the rest
            events = tuple(e for e in events if e.event_id > self.cursor)
        if events:
            tap = self._tap
            started = time.monotonic_ns() if tap is not None else 0
            self._writer.apply_batch(self.key, events, unit.sent_at)
            if tap is not None:
                tap.applied(
                    self.key,
                    self.spec.format,
                    self.spec.block_size,
                    unit.payload,
                    len(unit.events) - len(events),
                    started,
                    recovered=recovered,
                    evicted=self._writer.take_evicted(),
                )
        if unit.foreign_block_size:
            self._words[W_SEEN] = seen_word(int(self._words[W_SEEN]), block_size=unit.foreign_block_size)
        if unit.dropped_blocks:
            self._bump(W_DROPPED_BLOCKS, unit.dropped_blocks)
            self._warn_once(
                "block-size",
                "blocks dropped %s: their block size differs from the registered %d",
                self._where,
                self.spec.block_size,
            )
        self._advance(len(events), unit.skipped_events, unit.last)

    def _advance(self, applied: int, skipped: int, last: int) -> None:
        """What applying through id ``last`` leaves, by either path (``_apply``, the batch path's ``_run``): the
        events applied and skipped counted, the cursor moved, and, with no recovery in flight, the worker
        settled."""
        self._bump(W_EVENTS, applied)
        if skipped:
            self._bump(W_SKIPPED_EVENTS, skipped)
        self.cursor = last
        self._words[W_LAST_ID] = last
        if self._recovery is None:
            self._settle()

    # -- gaps and recovery --------------------------------------------------------------------

    def _gap(self, expected: int, unit: Unit, now: float, *, can_recover: bool = True) -> None:
        self._bump(W_GAPS_DETECTED)
        log.warning("gap detected %s expected=%d got=%d", self._where, expected, unit.first)
        if self._recovery_endpoint is None or not can_recover:
            self._lose(f"ids {expected}..{unit.first - 1} cannot be recovered")
            self._apply(unit)
            return
        self._buffer[unit.first] = unit
        self._start(expected, now, gap=True)

    def _lose(self, why: str) -> None:
        self._bump(W_GAPS_LOST)
        self._exact = False
        log.warning("gap lost %s: %s; the worker is partial", self._where, why)

    def _begin_join(self, now: float) -> None:
        if self._recovery_endpoint is None:
            self.joining = False
            return
        self._start(None if self.spec.format == "kvrouter" else 0, now, gap=False)

    def _start(self, start: int | None, now: float, *, gap: bool, tail: bool = False) -> None:
        """Open a client and ask for everything from ``start`` (None: a full dump)."""
        assert self._recovery_endpoint is not None
        self._retry_at = None
        self._tail_at = None
        client: RecoveryClient
        if self.spec.format == "kvrouter":
            client = QueryClient(self._context, self._recovery_endpoint, self._config.max_message_bytes)
            client.request(start)
        else:
            client = ReplayClient(self._context, self._recovery_endpoint, self._config.max_message_bytes)
            client.request(start or 0)
        self._recovery = _Recovery(client, start, gap, now + self._config.recovery_timeout, tail=tail)
        self._watch(client.socket, self)
        if not tail:  # a routine question, not a restore: routing keeps the worker's trust meanwhile
            self._set_state(WORKER_RESTORING)
        log.info("recovery started %s from=%s endpoint=%s", self._where, start, self._recovery_endpoint)

    def _hold(self, unit: Unit, now: float) -> None:
        if unit.first in self._buffer:
            return
        self._buffer[unit.first] = unit
        if len(self._buffer) > self._config.max_buffered:
            self._finish(now, why=f"{len(self._buffer)} live messages buffered, past the bound")

    def on_recovery(self, now: float) -> None:
        """The recovery socket is readable."""
        recovery = self._recovery
        if recovery is None:
            return
        recovery.deadline = now + self._config.recovery_timeout  # a peer that answers is alive
        if isinstance(recovery.client, ReplayClient):
            for reply in recovery.client.read():
                if self._recovery is not recovery:
                    return
                self._on_replay(recovery, reply, now)
        elif isinstance(recovery.client, QueryClient):
            for answer in recovery.client.read():
                if self._recovery is not recovery:
                    return
                self._on_query(recovery, answer, now)

    def _on_replay(self, recovery: _Recovery, reply: ReplayFrame | ReplayEnd | BadEvent, now: float) -> None:
        if isinstance(reply, ReplayEnd):
            self._finish(now)
            return
        if isinstance(reply, BadEvent):
            self._bad(str(reply), "replay")
            recovery.missing = "a replay reply did not parse"
            return
        if reply.topic is not None and reply.topic != self.spec.topic:
            self._bad(f"replayed topic {reply.topic[:64]!r}, registered {self.spec.topic!r}", "topic")
            recovery.missing = "a replayed batch had another topic"
            return
        unit = self._unit(reply.seq, reply.payload)
        if unit is None:
            recovery.missing = f"replayed batch {reply.seq} was unusable"
            return
        expected = self._expected()
        if unit.last < expected:
            return  # applied already: a live unit got here first
        if recovery.routine:
            self._tail_found(recovery)
        if unit.first > expected:
            if not recovery.gap:  # a join after the engine's buffer forgot its beginning
                self._bump(W_GAPS_DETECTED)
                recovery.gap = True
            recovery.missing = f"the replay buffer starts at {unit.first}, after the missing {expected}"
        self._apply(unit, recovered=True)

    def _on_query(self, recovery: _Recovery, answer: QueryReply | BadEvent, now: float) -> None:
        if isinstance(answer, BadEvent):
            self._bad(str(answer), "query")
            self._finish(now, why="the local indexer's reply did not parse")
            return
        if answer.reply == "too_new":
            self._restarted(f"its last event id {answer.last_event_id} is behind ours")
            self._close_client(recovery)
            self._start(None, now, gap=recovery.gap)
            return
        units: list[Unit] = []
        for i, payload in enumerate(answer.batches):
            unit = self._unit(i, payload)
            if unit is None:
                recovery.missing = "a batch of the reply was unusable"
            else:
                units.append(unit)
        if recovery.routine and self._tail_lost(answer, units):
            self._tail_found(recovery)
        if answer.reply == "tree_dump":
            if self.cursor is not None and answer.last_event_id is not None and answer.last_event_id < self.cursor:
                self._bump(W_RESTARTS)  # a dump behind our cursor: the worker restarted
            self._writer.clear_worker(self.key)
            tap = self._tap
            if tap is not None:
                tap.cleared(self.key, "dump")
            for unit in units:
                started = time.monotonic_ns() if tap is not None else 0
                self._writer.apply_batch(self.key, unit.events)
                if tap is not None:
                    tap.applied(
                        self.key,
                        self.spec.format,
                        self.spec.block_size,
                        unit.payload,
                        0,
                        started,
                        recovered=True,
                        evicted=self._writer.take_evicted(),
                    )
            self._exact = recovery.missing is None  # the dump replaces every earlier loss
            self.cursor = answer.last_event_id
            self._words[W_LAST_ID] = NO_ID if self.cursor is None else self.cursor
        else:
            for unit in units:
                if unit.last < self._expected():
                    continue
                if unit.first > self._expected():
                    recovery.missing = f"the reply starts at {unit.first}, after the missing {self._expected()}"
                self._apply(unit, recovered=True)
        if answer.last_event_id is not None:
            self._drop_unreachable(answer.last_event_id)
        self._finish(now)

    def _drop_unreachable(self, last: int) -> None:
        """Drop the buffered live units that do not follow on from the worker's own last event id ``last``
        without a hole. The worker's answer is the truth about its history. A unit past a hole it cannot
        fill is an earlier life's: the engine restarted while a gap's query was in flight. Kept, each drain
        would take it for a new gap and ask again, for ever. A live unit that was only lost behind the
        answer comes back through the next gap or the quiet-tail check."""
        reach = last + 1
        kept: dict[int, Unit] = {}
        for first in sorted(self._buffer):
            unit = self._buffer[first]
            if first <= reach:
                kept[first] = unit
                reach = max(reach, unit.last + 1)
        if len(kept) < len(self._buffer):
            log.info(
                "dropped %d buffered batches %s: past the worker's last event id %d and a hole it cannot fill",
                len(self._buffer) - len(kept),
                self._where,
                last,
            )
            self._buffer = kept

    def _tail_found(self, recovery: _Recovery) -> None:
        """A tail check brought back events the SUB never saw, and nothing after them told us: a gap."""
        self._bump(W_GAPS_DETECTED)
        recovery.gap = True

    def _tail_lost(self, answer: QueryReply, units: list[Unit]) -> bool:
        """Whether a tail check's answer holds events past the cursor: a dump of a later history, or events
        at or after the expected id."""
        if answer.reply == "tree_dump":
            return answer.last_event_id != self.cursor
        expected = self._expected()
        return any(unit.last >= expected for unit in units)

    def _finish(self, now: float, why: str | None = None) -> None:
        """End the recovery: account its gap, then apply the buffered live units in order."""
        recovery = self._recovery
        assert recovery is not None
        self._close_client(recovery)
        missing = why or recovery.missing
        routine = recovery.routine  # nothing found missing, or no answer
        if recovery.gap:
            if missing is None:
                self._bump(W_GAPS_RECOVERED)
                log.info("gap recovered %s cursor=%s", self._where, self.cursor)
            else:
                self._lose(missing)
        elif why is not None and not routine:
            self._exact = False  # a restore that failed: the worker may hold blocks we never heard of
            log.warning("restore failed %s: %s; the worker is partial", self._where, why)
        elif why is not None:
            log.info("quiet-tail check unanswered %s: %s", self._where, why)  # nothing known lost
        self.joining = False
        if why is not None and self.spec.format == "kvrouter" and not routine:
            self._retry_at = now + self._config.restore_retry
        if routine:  # ask again while the stream stays quiet, less and less often
            self._tail_wait = min(2 * self._tail_wait, TAIL_CHECK_MAX_S)
            self._tail_at = now + self._tail_wait
        elif why is None:
            self._quiet_check(now)  # a join's SUB may still have been connecting; a tail check found losses
        self._drain(now, can_recover=why is None, accounted=recovery.gap and missing is not None)

    def _close_client(self, recovery: _Recovery) -> None:
        self._watch(recovery.client.socket, None)
        recovery.client.close()
        self._recovery = None

    def _drain(self, now: float, *, can_recover: bool, accounted: bool = False) -> None:
        """Apply the live units buffered during a recovery, in id order; a hole among them is a new gap.
        With ``accounted``, the hole before the first unit is the gap just counted lost: no second count."""
        buffered, self._buffer = sorted(self._buffer.values(), key=lambda u: u.first), {}
        for unit in buffered:
            if self._recovery is not None:  # a hole opened another recovery: keep the rest for after it
                self._buffer[unit.first] = unit
            elif accounted and unit.first > self._expected():
                self._apply(unit)
            else:
                self._arrive(unit, now, draining=True, can_recover=can_recover)
            accounted = False
        if self._recovery is None:
            self._settle()

    # -- time ---------------------------------------------------------------------------------

    def tick(self, now: float, wall_ns: int) -> None:
        """Timers: a recovery peer silent too long, a retry due, a publisher gone quiet."""
        recovery = self._recovery
        if recovery is not None and now >= recovery.deadline:
            self._finish(now, why=f"{recovery.client.endpoint} did not answer within {self._config.recovery_timeout}s")
        elif recovery is None and self._retry_at is not None and now >= self._retry_at:
            self._start(None, now, gap=False)
        elif recovery is None and self._tail_at is not None and now >= self._tail_at:
            self._start(self._expected(), now, gap=False, tail=True)
        quiet = (wall_ns - self._words[W_LAST_EVENT_NS]) / 1e9
        if not self._words[W_STALE] and quiet > self._config.stale_after:
            self._words[W_STALE] = 1
            log.warning("worker stale %s: nothing heard for %.0f s", self._where, quiet)

    def close(self, *, forget: bool = True) -> None:
        """Close the stream's sockets and (unless the whole shard is going) forget the worker's blocks and row."""
        if self._recovery is not None:
            self._close_client(self._recovery)
        self._watch(self.socket, None)
        self.socket.close(linger=0)
        if forget:
            self._writer.forget(self.key)
