"""The stats segment: what ``kvrouter top`` needs from the front that the control segment does not hold.

The control segment (``index/layout.py``) already carries the appliers' side: shard status, events
applied, every worker row (cached blocks, gaps, trust state, last event). The front's side (the load it
booked per worker, its decision and query counters, route latency, the recent decisions with their
candidates, the event log, the weights in effect, when it started) lives in Python objects of the
service's event loop. :class:`StatsPublisher` serialises that into one msgpack blob every
``PUBLISH_INTERVAL_S`` (4 Hz, an asyncio task, off the request path) and writes it into
``/dev/shm/kvrouter-<pid>-stats`` under a seqlock; :class:`StatsReader`, in any other process, copies the
blob out and retries a torn copy. So a local dashboard reads the router with zero requests to it, and a
router serving a thousand requests a second pays a few hundred microseconds four times a second, not a
cost per request.

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
    byte 64 ...        the blob: msgpack, a map (see ``build_blob``)

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
                          or nil: ``accuracy.py``), ``drift``
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

import asyncio
import contextlib
import logging
import mmap
import os
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, NamedTuple, cast

import msgpack
import numpy as np

from ..errors import StatsError
from ..events.model import WorkerKey
from ..index.layout import SHM_DIR, Segment, stats_name, unlink_segment
from .partition import keys_of

if TYPE_CHECKING:
    from .app import Service
    from .partition import Partition

__all__ = [
    "DATA_OFFSET",
    "DECISIONS_SHOWN",
    "EVENTS_SHOWN",
    "EXPLAIN_INTERVAL_S",
    "LOADS_SLICE",
    "PUBLISH_INTERVAL_S",
    "STATS_BYTES",
    "STATS_MAGIC",
    "STATS_VERSION",
    "PackedLoads",
    "StatsPublisher",
    "StatsReader",
    "StatsWriter",
    "all_loads",
    "build_blob",
    "pack_blob",
    "pack_loads",
    "percentiles",
    "sliced_loads",
    "worker_loads",
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
"""At most one decision this often is explained for the ring (``Service.select``), so the dashboard
always has a recent decision's candidates without every request paying for an explanation: at the rate
the dashboard reads them, as each costs about 60 µs of a front's loop at 16 workers and 4 ms at 1,024
(``routing.router.explanation``; ten a second before) [s]."""
DECISIONS_SHOWN: Final = 32
EVENTS_SHOWN: Final = 64
LOADS_SLICE: Final = 128
"""Workers whose ``loads`` entries the 4 Hz publish makes and packs before it lets requests in again (about
0.3 ms)."""
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


def _plain(value: Any) -> Any:
    """msgpack's fallback: numpy scalars (a cost or a count that stayed one) as Python numbers."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    raise TypeError(f"cannot publish {type(value).__name__} in the stats blob")


def _last(ring: Any, n: int) -> list[dict[str, Any]]:
    count = len(ring)
    return [ring[i] for i in range(max(0, count - n), count)]


def worker_loads(service: Service, partition: Partition, keys: Sequence[WorkerKey]) -> list[dict[str, Any]]:
    """The blob's ``loads`` entries of ``keys``, workers of ``partition``."""
    slots = partition.slots
    return [
        {
            "model_name": partition.model_name,
            "routing_group": partition.routing_group,
            "worker_id": key[0],
            "dp_rank": key[1],
            "potential_prefill_tokens": slots.active_prefill_tokens(key),
            "potential_decode_blocks": slots.active_blocks(key),
            "active_requests": slots.active_requests(key),
            "unhealthy": partition.unhealthy.get(key),
            "accuracy": service.accuracy.rolling(key),
            "trust": service.trust.state(key),
            "problems": service.trust.problems(key),
            "drift": key in service.accuracy.drifting,
        }
        for key in keys
    ]


class PackedLoads(NamedTuple):
    """The blob's ``loads``, packed ahead of the rest of the blob: its entries are the bulk of a large
    fleet's blob (about 230 bytes a worker), so they are packed a slice at a time with the loop let go
    between slices, and the blob splices them in (:func:`pack_blob`)."""

    entries: int
    packed: bytes
    """The entries packed one after another: the msgpack array's items, without its header."""


NO_LOADS: Final = PackedLoads(0, b"")


def pack_loads(loads: list[dict[str, Any]]) -> PackedLoads:
    return PackedLoads(len(loads), b"".join(_pack(load) for load in loads))


def _load_slices(service: Service) -> Iterator[PackedLoads]:
    """``loads`` for every worker of every partition, ``LOADS_SLICE`` workers a slice, each packed as it
    is made (their keys too: listing 4,096 workers' keys at once took 2 ms)."""
    for partition in list(service.partitions.values()):
        instances = list(partition.instances.values())
        for start in range(0, len(instances), LOADS_SLICE):
            yield pack_loads(worker_loads(service, partition, keys_of(instances[start : start + LOADS_SLICE])))


def _joined(slices: list[PackedLoads]) -> PackedLoads:
    return PackedLoads(sum(made.entries for made in slices), b"".join(made.packed for made in slices))


def all_loads(service: Service) -> PackedLoads:
    """``loads`` for every worker of every partition, at once (the first blob's)."""
    return _joined(list(_load_slices(service)))


async def sliced_loads(service: Service) -> PackedLoads:
    """:func:`all_loads` with the loop let go after each slice: at once, the 4 Hz publish held every
    request of a 4,096-worker front for 10-13 ms."""
    slices = []
    for made in _load_slices(service):
        slices.append(made)
        await asyncio.sleep(0)
    return _joined(slices)


def pack_blob(body: dict[str, Any], loads: PackedLoads) -> bytes:
    """``body`` (:func:`build_blob`) as one msgpack map, with ``loads`` as its ``loads`` member: the same
    bytes ``msgpack.packb`` gives for the body with the entries in it."""
    parts = [_PACKER.pack_map_header(len(body))]
    for key, value in body.items():
        parts.append(_pack(key))
        parts.append(_PACKER.pack_array_header(loads.entries) + loads.packed if key == "loads" else _pack(value))
    return b"".join(parts)


_PACKER: Final = msgpack.Packer(default=_plain, use_bin_type=True)
"""The blob's packer, kept: ``msgpack.packb`` makes one a call, which cost a 256-worker slice of ``loads``
packed entry by entry 2-3 ms more. ``autoreset``: each call returns its bytes."""


def _pack(value: Any) -> bytes:
    return cast(bytes, _PACKER.pack(value))


def build_blob(service: Service, *, last_gap_at: float | None, decisions: int, events: int) -> dict[str, Any]:
    """The blob's map for ``service`` now (module docstring), with the last ``decisions`` and ``events``
    ring entries and ``loads`` left None: :func:`pack_blob` puts the packed loads there. Reads only the
    service's Python state: call it on the service's loop."""
    config = service.config.router
    counters = service.fleet_counters()
    fast = service.fastpath.counters.requests if service.fastpath is not None else {}
    http = counters.http_requests
    queries = counters.decisions + sum(http.get((route, "POST"), 0) for route in ("/query", "/query_by_hash"))
    queries += fast.get("query", 0) + fast.get("query_by_hash", 0)
    p50, p99 = percentiles([d["decision_us"] for d in service.decisions], 0.5, 0.99)
    return {
        "version": STATS_VERSION,
        "pid": os.getpid(),
        "url": service.url,
        "control": service.engine.reader_handle().control_name,
        "model_name": service.config.model_name,
        "started_at": service.started_at,
        "published_at": time.time(),
        "decisions_total": counters.decisions,
        "queries_total": queries,
        "route_p50_us": p50,
        "route_p99_us": p99,
        "weights": {
            "credit": config.overlap_score_credit,
            "scale": config.prefill_load_scale,
            "decode": config.decode_active_request_weight,
            "work": config.prefill_work_weight,
            "T": config.router_temperature,
        },
        "policy": config.router_selection_policy,
        "approximate": not config.use_kv_events,
        "last_gap_at": last_gap_at,
        "loads": None,
        "decisions": _last(service.decisions, decisions),
        "explained": service.last_explained,
        "events": _last(service.events, events),
        "trimmed": False,
        "shadows": counters.shadow,
        **_replicas(service),
    }


def _replicas(service: Service) -> dict[str, Any]:
    """``replicas`` (peers heard) and ``sync_lag_ms`` with replica sync on; nil without it."""
    if service.sync is None:
        return {"replicas": None, "sync_lag_ms": None}
    presence = service.sync.presence()
    return {"replicas": presence["peers"], "sync_lag_ms": presence["sync_lag_ms"]}


class StatsPublisher:
    """Publishes ``service``'s stats blob into ``kvrouter-<pid>-stats`` every ``interval`` seconds.

    :meth:`open` creates the segment (after the engine is up), :meth:`run` is the asyncio task,
    :meth:`close` unlinks. ``publish`` writes one blob now (the task's body; tests call it directly).
    """

    def __init__(self, service: Service, *, interval: float = PUBLISH_INTERVAL_S) -> None:
        self.service = service
        self.interval = interval
        self.name = stats_name(os.getpid())
        self._writer: StatsWriter | None = None
        self._last_gap_at: float | None = None
        self._events_seen = 0
        self._trim_logged = False

    def open(self) -> None:
        """Create the segment and publish the first blob.

        Raises:
            FileExistsError: the segment exists.
        """
        self._writer = StatsWriter(self.name)
        self.publish(all_loads(self.service))

    def publish(self, loads: PackedLoads) -> None:
        """Write one blob now, with ``loads`` (:func:`all_loads` or :func:`sliced_loads`)."""
        writer = self._writer
        if writer is None:
            return
        service = self.service
        ring = service.events
        for i in range(len(ring) - 1, -1, -1):  # newest first, back to the last one seen
            event = ring[i]
            if event["seq"] <= self._events_seen:
                break
            if event["kind"] == "gaps_detected":
                self._last_gap_at = event["at"]
                break
        if ring:
            self._events_seen = ring[-1]["seq"]
        decisions, events = DECISIONS_SHOWN, EVENTS_SHOWN
        trimmed = False
        while True:
            body = build_blob(service, last_gap_at=self._last_gap_at, decisions=decisions, events=events)
            body["trimmed"] = trimmed
            blob = pack_blob(body, loads)
            if len(blob) <= writer.capacity:
                break
            if decisions == 0 and events == 0:
                body.update(explained=None, trimmed=True)
                blob = pack_blob(body, NO_LOADS)
                break
            decisions, events, trimmed = decisions // 2, events // 2, True
        if trimmed and not self._trim_logged:
            self._trim_logged = True
            log.warning("stats blob trimmed segment=%s bytes=%d (logged once)", self.name, len(blob))
        writer.write(blob)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.publish(await sliced_loads(self.service))
            except asyncio.CancelledError:
                raise
            except Exception:  # the dashboard's feed must never take the service down
                log.exception("stats publish failed segment=%s", self.name)

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
