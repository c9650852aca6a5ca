"""``Tap``: an applier's copy of what it applies, sent to the recorder of ``kvrouter up --record``.

Every payload a stream applies (live, replayed, or a local indexer's answer), every time it clears a
worker (an engine restart, a tree dump, a join) and what the index cap evicts goes, as one msgpack record
of the recording format (``kvrouter/recording/format.py``: kinds ``ev``, ``clr`` and ``evict``), over a
ZMQ PUSH socket to the front's recorder, which numbers and writes it. The raw payload is sent rather than
the decoded arrays so that the replay decodes it again: a decoder change is judged on the recording too.

The choice: the applier forwards, rather than writing a file of its own. One writer means one file, one
numbering and nothing to merge; an applier SIGKILLed mid-send loses the records still queued in its
process, where one killed mid-write would leave a torn frame inside its own file. The cost, per applied
batch while recording: stamping the time twice, one msgpack pack of a small map around the payload (a
copy of it) and a non-blocking send; nothing at all when not recording (``tap is None``).

Bounded: the socket's send queue holds :data:`TAP_HWM` records; past it a send fails at once and the
record is dropped, never blocking the applier. Every record carries this process's count ``i`` of records
it tried to send, so the recorder counts the drops from the gaps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any, Final

import msgpack
import numpy as np
import numpy.typing as npt
import zmq

from ..events.model import WorkerKey

__all__ = ["TAP_HWM", "Tap"]

log = logging.getLogger(__name__)

TAP_HWM: Final = 10_000
"""Records queued toward the recorder before sends are dropped: a few seconds of a busy fleet's batches."""
LINGER_MS: Final = 1_000
"""How long closing the tap waits to hand its queued records over (a clean applier stop)."""


class Tap:
    """The sending end, one per applier process.

    Args:
        context: the applier's ZMQ context.
        endpoint: the recorder's ``ipc://`` PULL address (``PlaneConfig.record_endpoint``).
        shard: the applier's shard, stamped on every record.
        hwm: records queued before sends are dropped.
    """

    def __init__(
        self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str, shard: int, *, hwm: int = TAP_HWM
    ) -> None:
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, LINGER_MS)
        self._socket.connect(endpoint)
        self._shard = shard
        self._pid = os.getpid()
        self.sent = 0
        """Records tried (the ``i`` of the next one)."""
        self.dropped = 0
        """Records refused by a full queue."""

    def _send(self, record: dict[str, Any]) -> None:
        record["i"] = self.sent
        record["src"] = self._pid
        record["shard"] = self._shard
        self.sent += 1
        try:
            self._socket.send(msgpack.packb(record, use_bin_type=True), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("recording tap dropped a record shard=%d: the recorder is behind", self._shard)

    def applied(
        self,
        key: WorkerKey,
        format: str,
        block_size: int,
        payload: bytes,
        skip: int,
        started_ns: int,
        *,
        recovered: bool = False,
        evicted: Sequence[tuple[WorkerKey, int, npt.NDArray[np.uint64]]] = (),
    ) -> None:
        """``payload`` of ``key`` was applied, but for its first ``skip`` events (already applied before);
        ``recovered``: fetched from the worker's replay socket or local indexer, not received live.
        ``evicted``: what the index cap evicted at the batch's end (``ShardWriter.take_evicted``), recorded
        after it as ``evict`` records, one per (worker, tier): the Removed events that would have done it."""
        done = time.monotonic_ns()
        self._send(
            {
                "k": "ev",
                "t": done,
                "t0": started_ns,
                "w": key[0],
                "r": key[1],
                "fmt": format,
                "bs": block_size,
                "skip": skip,
                "rec": recovered,
                "p": payload,
            }
        )
        for (worker, rank), tier, hashes in evicted:
            self._send(
                {  # the batch's own window: a decision that raced the batch raced its eviction too
                    "k": "evict",
                    "t": done,
                    "t0": started_ns,
                    "w": worker,
                    "r": rank,
                    "tier": tier,
                    "h": hashes.astype("<u8").tobytes(),
                }
            )

    def cleared(self, key: WorkerKey, why: str, *, at: tuple[int, int] | None = None) -> None:
        """Everything ``key`` held was dropped from the shard (``restart``, ``dump``, ``join``; ``segment``: a
        restarted applier's new, empty segment). ``at``: (began, done) in ``time.monotonic_ns()``, when it
        happened before this call; default now."""
        began, done = at if at is not None else (time.monotonic_ns(),) * 2
        self._send({"k": "clr", "t": done, "t0": began, "w": key[0], "r": key[1], "why": why})

    def close(self) -> None:
        self._socket.close()
