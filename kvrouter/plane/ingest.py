"""``Ingest``: the streams of one applier, and the sockets that wake them.

The applier is a process around one :class:`~kvrouter.plane.wakes.Wakes`: its PULL socket from the
supervisor, one SUB socket per (worker, dp_rank) it owns, and the DEALER of each recovery in flight. Ingest
keeps the socket → stream map the wakes need, adds and removes workers as the supervisor says, runs the
streams' timers, and tells the applier when every stream has finished joining, so a restarted shard can
leave ``recovering``.

Every socket is the applier's own, made from its own context after the fork, and closed here: a stream that
is removed closes its sockets at once, and :meth:`close` closes what is left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Final

import zmq

from ..errors import BadEvent, ConfigError
from ..events.codecs.runs import RunBuffers
from ..index.writer import ShardWriter
from .config import PlaneConfig
from .receive import Receiver
from .registry import WorkerSpec
from .stream import Stream
from .tap import Tap
from .wakes import Wakes

__all__ = ["Ingest"]

log = logging.getLogger(__name__)

DRAIN_LIMIT: Final = 256
"""Messages taken from one SUB socket per wake-up, so a flooding worker cannot starve the others or the
supervisor's messages; what is left stays queued in the socket for the next round. They are one batch for
the stream (``Stream.on_drain``)."""


class Ingest:
    """Every stream of one shard."""

    def __init__(
        self, context: zmq.Context[zmq.Socket[bytes]], wakes: Wakes, writer: ShardWriter, config: PlaneConfig
    ) -> None:
        self._context = context
        self._wakes = wakes
        self._writer = writer
        self._config = config
        self._streams: dict[tuple[int, int], Stream] = {}
        self._buffers = RunBuffers()
        """What every stream's drain is received into and its batch path decodes (``Stream.on_drain``)."""
        self._receiver = Receiver(self._buffers)
        self._owners: dict[zmq.Socket[bytes], Stream] = {}
        self.tap: Tap | None = (
            None if config.record_endpoint is None else Tap(context, config.record_endpoint, writer.shard)
        )
        """The copy of what is applied for ``kvrouter up --record`` (``tap.py``); None when not recording."""
        writer.keep_evicted = self.tap is not None  # the cap's evictions are recorded too

    def _watch(self, socket: zmq.Socket[bytes], stream: Stream | None) -> None:
        if stream is None:
            if self._owners.pop(socket, None) is not None:
                self._wakes.unwatch(socket)
        else:
            self._owners[socket] = stream
            self._wakes.watch(socket)

    def add(self, spec: WorkerSpec, ranks: Iterable[int]) -> None:
        """Follow ``ranks`` of ``spec`` (a spec registered again replaces its streams: a new endpoint or format)."""
        for rank in ranks:
            key = (spec.worker_id, rank)
            old = self._streams.pop(key, None)
            if old is not None:
                old.close()
            try:
                self._streams[key] = Stream(
                    spec, rank, self._writer, self._context, self._watch, self._config, self._buffers, self.tap
                )
            except (BadEvent, ConfigError, zmq.ZMQError) as exc:
                log.error("worker not followed worker=%d dp=%d: %s", spec.worker_id, rank, exc)
                continue
            log.info("worker followed worker=%d dp=%d endpoint=%s", spec.worker_id, rank, spec.event_endpoint(rank))

    def remove(self, worker_id: int) -> None:
        """Stop following every rank of ``worker_id`` and drop its blocks and rows."""
        for key in [k for k in self._streams if k[0] == worker_id]:
            self._streams.pop(key).close()

    def on_ready(self, socket: zmq.Socket[bytes], now: float) -> bool:
        """A watched socket may hold something: hand it to its stream. Whether it held anything (a notice
        alone, such as a reconnection, brings nothing)."""
        stream = self._owners.get(socket)
        if stream is None:
            return False
        if socket is stream.socket:
            drain = self._receiver.drain(socket, DRAIN_LIMIT, stream.spec.topic, self._config.max_message_bytes)
            if drain.count:
                stream.on_drain(drain, now)
            if drain.count == DRAIN_LIMIT:  # more may wait, and no new wake will tell of them
                self._wakes.again(socket)
            return bool(drain.count)
        stream.on_recovery(now)
        return True  # a recovery's replies, or its peer's notices: rare either way

    def tick(self, now: float) -> None:
        wall = time.time_ns()
        for stream in list(self._streams.values()):
            stream.tick(now, wall)

    @property
    def joining(self) -> bool:
        """Some stream has not finished its first restore."""
        return any(stream.joining for stream in self._streams.values())

    def close(self) -> None:
        """Close every socket; the shard's table goes with the applier, so no block is released one by one."""
        for stream in self._streams.values():
            stream.close(forget=False)
        self._streams.clear()
        if self.tap is not None:
            self.tap.close()
            self.tap = None
