"""The stats segment: what ``kvrouter top`` needs from a router that the control segment does not hold.

The control segment (``index/layout.py``) already carries the appliers' side: shard status, events
applied, every worker row (cached blocks, gaps, trust state, last event). The front's side (the load it
booked per worker, its decision and query counters, route latency, the recent decisions with their
candidates, the event log, the weights in effect, when it started) lives in Python objects of the
service's event loop. The service's publisher (``service/process/stats.py``) serialises that into one
msgpack blob every ``PUBLISH_INTERVAL_S`` (4 Hz, an asyncio task, off the request path) and writes it
into ``/dev/shm/kvrouter-<pid>-stats`` under a seqlock (:class:`StatsWriter`); :class:`StatsReader`, in
any other process, copies the blob out and retries a torn copy. So a local dashboard reads the router with
zero requests to it, and a router serving a thousand requests a second pays a few hundred microseconds
four times a second, not a cost per request.

Rejected: a reply socket the dashboard asks (a request per refresh on the router's loop, and a dead
dashboard can wedge it); one fixed-layout word per figure, as the control segment does (the decision
and event rings are variable-length records of strings, which a blob holds naturally, and the blob
changes only 4 times a second, so the seqlock's cost is nothing).

Layout (little-endian u64 words, then bytes)::

    word 0  MAGIC      0x6B767273_74617473 ("kvrstats")
    word 1  VERSION    STATS_VERSION (1); a reader of another version refuses the segment
    word 2  CAPACITY   bytes available for the blob, from byte DATA_OFFSET
    word 3  SEQ        seqlock: odd while the writer rewrites the blob, bumped to even when done
    word 4  LENGTH     bytes of the current blob
    word 5  CRC        zlib.crc32 of the current blob
    word 6  PUBLISHED  time.time_ns() of the current blob
    word 7  (reserved, 0)
    byte 64 ...        the blob: msgpack, a map (see ``service/process/stats.py``'s ``build_blob``)

The writer bumps SEQ to odd, writes the blob, LENGTH, CRC and PUBLISHED, then bumps SEQ to even. A reader
reads SEQ (retrying while odd), copies LENGTH bytes, re-reads SEQ and retries if it moved; the CRC is
checked on top, so a copy torn under a weaker memory order than x86's, or a blob a crashed writer left
half written, is caught rather than decoded. A writer that leaves one write open past ``READ_TIMEOUT_S``
(it died mid-write) makes the reader raise :class:`~kvrouter.errors.StatsError`; one that keeps writing is
waited for, up to ``MOVING_TIMEOUTS`` times that.

The blob (msgpack map, ``version`` 1; times are ``time.time()`` seconds):

========================= ======================================================================
key                       value
========================= ======================================================================
``version``               1
``pid``, ``url``          the service's process and HTTP address
``control``               its engine's control segment (read it with ``Control.attach``)
``model_name``            the model of the workers given on the command line
``started_at``            when the service started
``published_at``          when this blob was built
``decisions_total``       decisions made (``/select``, reservations, the fast path's); probes excluded
``queries_total``         index walks answered: the decisions' own plus ``/query``, ``/query_by_hash``
                          and the fast path's queries
``route_p50_us``          decision latency over the decisions ring (µs), or nil before the first
``route_p99_us``
``weights``               ``{"credit", "scale", "decode", "work", "T"}``: the routing weights in effect
``policy``                the selection policy name
``approximate``           true in approximate mode (no KV events: no worker rows in the control segment)
``last_gap_at``           when the health loop last saw a gap detected, or nil
``loads``                 per (partition, worker, dp rank): ``model_name``, ``routing_group``,
                          ``worker_id``, ``dp_rank``, ``potential_prefill_tokens``,
                          ``potential_decode_blocks``, ``active_requests``, ``unhealthy`` (the reason it is
                          skipped, or nil), ``accuracy`` (the rolling share of reuse reports as predicted,
                          or nil: ``accuracy.py``), ``drift``, ``role`` (``prefill``, ``decode`` or
                          ``both``)
``decisions``             the last ``DECISIONS_SHOWN`` entries of the decisions ring, oldest first, in
                          ``GET /decisions``'s shape (``explain`` holds the candidates when explained)
``explained``             the most recent explained decision (same shape), or nil: with one decision
                          explained every ``EXPLAIN_INTERVAL_S``, it may be older than ``decisions``
``events``                the last ``EVENTS_SHOWN`` entries of the event log, ``GET /events``'s shape
``shadows``               ``--shadow-policy``: per policy, ``counters.SHADOW_FIELDS`` sums (``shadow.py``)
``replicas``              with replica sync on, the peers heard lately (``bridge/sync.py``), else nil
``sync_lag_ms``           with replica sync on, the median one-way delay of their presence messages, else nil
========================= ======================================================================

When the blob would not fit ``CAPACITY`` (thousands of workers), the rings are halved until it does
and ``trimmed`` is set; the publisher logs it once.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
import zlib
from typing import Any, Final

import msgpack
import numpy as np

from ..errors import StatsError
from ..index.layout import SHM_DIR, Segment, unlink_segment

__all__ = [
    "DATA_OFFSET",
    "DECISIONS_SHOWN",
    "EVENTS_SHOWN",
    "EXPLAIN_INTERVAL_S",
    "PUBLISH_INTERVAL_S",
    "STATS_BYTES",
    "STATS_MAGIC",
    "STATS_VERSION",
    "StatsReader",
    "StatsWriter",
    "percentiles",
]

log = logging.getLogger(__name__)

STATS_MAGIC: Final = 0x6B76_7273_7461_7473  # "kvrstats"
STATS_VERSION: Final = 1
M_MAGIC, M_VERSION, M_CAPACITY, M_SEQ, M_LENGTH, M_CRC, M_PUBLISHED = range(7)
HEADER_WORDS: Final = 8
DATA_OFFSET: Final = HEADER_WORDS * 8
"""The blob starts here [bytes]."""
STATS_BYTES: Final = 1 << 20
"""Blob capacity: 1 MiB holds 32 explained decisions over ~200 workers with room to spare; larger
fleets trim the rings (``trimmed``)."""
PUBLISH_INTERVAL_S: Final = 0.25
"""The publisher's period: ``kvrouter top`` refreshes at 4 Hz by default (``spec/interfaces.md`` §4.1) [s]."""
EXPLAIN_INTERVAL_S: Final = PUBLISH_INTERVAL_S
"""At most one decision this often is explained for the decisions ring (the service's decider), so the dashboard
always has a recent decision's candidates without every request paying for an explanation: at the rate
the dashboard reads them, as each costs about 60 µs of a front's loop at 16 workers and 4 ms at 1,024
(``routing.router.explanation``; ten a second before) [s]."""
DECISIONS_SHOWN: Final = 32
EVENTS_SHOWN: Final = 64
READ_TIMEOUT_S: Final = 0.5
"""How long a reader waits for one write to finish before it calls the writer dead [s]. Only the same
write left open counts: a writer that keeps moving is alive (a reader on a busy machine can miss many
short writes in a row, which is no reason to say the router is gone)."""
MOVING_TIMEOUTS: Final = 10
"""A reader gives up after this many ``READ_TIMEOUT_S`` without one whole copy, however the writer moves."""
SPIN_READS: Final = 64
"""Retries before a reader starts sleeping between them: a rewrite takes tens of microseconds."""
READ_PAUSE_S: Final = 0.0005


class StatsWriter:
    """The stats segment, created and owned by the service: :meth:`write` a blob, :meth:`close` unlinks.

    Raises:
        FileExistsError: the name exists (a live service of this pid, or a leftover the engine's sweep
            did not remove).
    """

    def __init__(self, name: str, capacity: int = STATS_BYTES) -> None:
        self.name = name
        self.capacity = capacity
        self._segment = Segment.create(name, HEADER_WORDS + (capacity + 7) // 8)
        words = self._segment.words
        words[M_CAPACITY] = capacity
        words[M_VERSION] = STATS_VERSION
        words[M_MAGIC] = STATS_MAGIC  # last: a reader that sees the magic sees the rest
        self._closed = False

    def write(self, blob: bytes) -> None:
        """Replace the blob under the seqlock.

        Raises:
            StatsError: the blob is larger than the capacity.
        """
        if len(blob) > self.capacity:
            raise StatsError(f"stats segment {self.name}: blob of {len(blob)} bytes exceeds {self.capacity}")
        words = self._segment.words
        seq = int(words[M_SEQ])
        words[M_SEQ] = seq + 1  # odd: readers retry
        self._segment.mapping[DATA_OFFSET : DATA_OFFSET + len(blob)] = blob
        words[M_LENGTH] = len(blob)
        words[M_CRC] = zlib.crc32(blob)
        words[M_PUBLISHED] = time.time_ns()
        words[M_SEQ] = seq + 2

    def close(self) -> None:
        """Unmap and unlink; safe to call again."""
        if self._closed:
            return
        self._closed = True
        try:
            self._segment.close()
        finally:
            unlink_segment(self.name)


class StatsReader:
    """A read-only mapping of a stats segment, in any process. :meth:`read` returns the current blob.

    Raises:
        FileNotFoundError: no such segment (the service is gone, or never was).
        StatsError: the segment is not a stats segment of this layout (another kvrouter segment, a
            stranger's file, a truncated one).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        path = f"{SHM_DIR}/{name}"
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < DATA_OFFSET:
                raise StatsError(f"stats segment {name}: {size} bytes, shorter than its {DATA_OFFSET}-byte header")
            self._mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._words = np.frombuffer(self._mapping, dtype=np.uint64, count=HEADER_WORDS)
        magic, version = int(self._words[M_MAGIC]), int(self._words[M_VERSION])
        if magic != STATS_MAGIC or version != STATS_VERSION:
            self.close()
            raise StatsError(
                f"stats segment {name}: not a kvrouter stats segment of version {STATS_VERSION} "
                f"(magic {magic:#x}, version {version})"
            )
        self.capacity = int(self._words[M_CAPACITY])
        if DATA_OFFSET + self.capacity > size:
            self.close()
            raise StatsError(f"stats segment {name}: capacity {self.capacity} overruns its {size} bytes")
        self.retries = 0
        """Copies thrown away because the writer was mid-write or moved during the copy (for tests)."""

    def read_bytes(self, timeout: float = READ_TIMEOUT_S) -> bytes:
        """The current blob, copied out whole (never a torn mix of two blobs).

        Raises:
            StatsError: the writer stayed mid-write past ``timeout``, or the blob's length or checksum is
                wrong while the writer is not writing (a corrupt segment).
        """
        words, mapping = self._words, self._mapping
        stuck_at, stuck_since, give_up = -1, 0.0, 0.0
        attempts = 0
        while True:
            before = int(words[M_SEQ])
            if before % 2 == 0:
                length = int(words[M_LENGTH])
                crc = int(words[M_CRC])
                blob = mapping[DATA_OFFSET : DATA_OFFSET + min(length, self.capacity)]
                if int(words[M_SEQ]) == before:
                    if length > self.capacity:
                        raise StatsError(f"stats segment {self.name}: length {length} exceeds capacity {self.capacity}")
                    if zlib.crc32(blob) == crc:
                        return blob
                    if attempts >= SPIN_READS:  # stable and wrong: not a race
                        raise StatsError(f"stats segment {self.name}: blob of {length} bytes fails its checksum")
            self.retries += 1
            attempts += 1
            if attempts > SPIN_READS:
                now = time.monotonic()
                if not give_up:
                    give_up = now + MOVING_TIMEOUTS * timeout
                if before % 2 and before == stuck_at:  # the same write still open: a live writer finishes it
                    if now - stuck_since > timeout:
                        raise StatsError(f"stats segment {self.name}: writer mid-write for over {timeout}s (died?)")
                else:
                    stuck_at, stuck_since = before, now
                if now > give_up:  # alive, but never still for one copy
                    raise StatsError(f"stats segment {self.name}: no whole blob copied in {MOVING_TIMEOUTS * timeout}s")
                time.sleep(READ_PAUSE_S)

    def read(self, timeout: float = READ_TIMEOUT_S) -> dict[str, Any]:
        """The current blob, decoded (see the module docstring for its keys).

        Raises:
            StatsError: as :meth:`read_bytes`, or the blob is not a msgpack map of this version.
        """
        blob = self.read_bytes(timeout)
        if not blob:
            raise StatsError(f"stats segment {self.name}: nothing published yet")
        try:
            value = msgpack.unpackb(blob, raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise StatsError(f"stats segment {self.name}: blob does not decode: {exc}") from exc
        if not isinstance(value, dict) or value.get("version") != STATS_VERSION:
            raise StatsError(f"stats segment {self.name}: blob is not a version {STATS_VERSION} stats map")
        return value

    def published_ns(self) -> int:
        """When the current blob was written (``time.time_ns()``), 0 before the first."""
        return int(self._words[M_PUBLISHED])

    def close(self) -> None:
        del self._words
        with contextlib.suppress(BufferError):  # a caller still holds a view; it closes when collected
            self._mapping.close()


def percentiles(values: list[float], *qs: float) -> list[float | None]:
    """Nearest-rank percentiles (``q`` in 0..1) of ``values``; None for each when there are none."""
    if not values:
        return [None for _ in qs]
    ordered = sorted(values)
    last = len(ordered) - 1
    return [ordered[min(last, max(0, round(q * last)))] for q in qs]
