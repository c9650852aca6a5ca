"""The stats publisher: the service's figures for ``kvrouter top``, written into the stats segment at 4 Hz.

The segment's layout, its writer and its reader are ``kvrouter/stats/segment.py``; this module builds the
blob from the service's Python state (see that module's docstring for the keys) and writes it every
``PUBLISH_INTERVAL_S``, off the request path: the loads of a large fleet a slice at a time, the event loop
let go between slices.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final, NamedTuple, Protocol, cast

import msgpack
import numpy as np

from ...bridge import ReplicaSync
from ...engine import Engine, EngineView
from ...events.model import WorkerKey
from ...index.layout import stats_name
from ...routing.roles import DEFAULT_ROLE
from ...stats.segment import DECISIONS_SHOWN, EVENTS_SHOWN, PUBLISH_INTERVAL_S, STATS_VERSION, StatsWriter, percentiles
from ..core.counters import ServiceCounters
from ..core.partition import Partition, keys_of
from ..core.state import Core

__all__ = [
    "LOADS_SLICE",
    "PackedLoads",
    "StatsPublisher",
    "all_loads",
    "build_blob",
    "pack_blob",
    "pack_loads",
    "sliced_loads",
    "worker_loads",
]

log = logging.getLogger(__name__)


class StatsHost(Protocol):
    """What the blob reads of the process beside the core."""

    @property
    def url(self) -> str: ...
    @property
    def engine(self) -> Engine | EngineView: ...
    @property
    def started_at(self) -> float: ...
    @property
    def sync(self) -> ReplicaSync | None: ...
    def fleet_counters(self) -> ServiceCounters: ...
    def fastpath_requests(self) -> dict[str, int]: ...


LOADS_SLICE: Final = 128
"""Workers whose ``loads`` entries the 4 Hz publish makes and packs before it lets requests in again (about
0.3 ms)."""


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


def worker_loads(core: Core, partition: Partition, keys: Sequence[WorkerKey]) -> list[dict[str, Any]]:
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
            "accuracy": core.accuracy.rolling(key),
            "trust": core.trust.state(key),
            "problems": core.trust.problems(key),
            "drift": key in core.accuracy.drifting,
            "role": instance.role if (instance := partition.instances.get(key[0])) else DEFAULT_ROLE,
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


def _load_slices(core: Core) -> Iterator[PackedLoads]:
    """``loads`` for every worker of every partition, ``LOADS_SLICE`` workers a slice, each packed as it
    is made (their keys too: listing 4,096 workers' keys at once took 2 ms)."""
    for partition in list(core.registry.partitions.values()):
        instances = list(partition.instances.values())
        for start in range(0, len(instances), LOADS_SLICE):
            yield pack_loads(worker_loads(core, partition, keys_of(instances[start : start + LOADS_SLICE])))


def _joined(slices: list[PackedLoads]) -> PackedLoads:
    return PackedLoads(sum(made.entries for made in slices), b"".join(made.packed for made in slices))


def all_loads(core: Core) -> PackedLoads:
    """``loads`` for every worker of every partition, at once (the first blob's)."""
    return _joined(list(_load_slices(core)))


async def sliced_loads(core: Core) -> PackedLoads:
    """:func:`all_loads` with the loop let go after each slice: at once, the 4 Hz publish held every
    request of a 4,096-worker front for 10-13 ms."""
    slices = []
    for made in _load_slices(core):
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


def build_blob(
    core: Core, host: StatsHost, *, last_gap_at: float | None, decisions: int, events: int
) -> dict[str, Any]:
    """The blob's map now (``stats/segment.py``'s docstring), with the last ``decisions`` and ``events``
    ring entries and ``loads`` left None: :func:`pack_blob` puts the packed loads there. Reads only the
    service's Python state: call it on the service's loop."""
    config = core.config.router
    journal = core.journal
    counters = host.fleet_counters()
    fast = host.fastpath_requests()
    http = counters.http_requests
    queries = counters.decisions + sum(http.get((route, "POST"), 0) for route in ("/query", "/query_by_hash"))
    queries += fast.get("query", 0) + fast.get("query_by_hash", 0)
    p50, p99 = percentiles([d["decision_us"] for d in journal.decisions], 0.5, 0.99)
    return {
        "version": STATS_VERSION,
        "pid": os.getpid(),
        "url": host.url,
        "control": host.engine.reader_handle().control_name,
        "model_name": core.config.model_name,
        "started_at": host.started_at,
        "published_at": time.time(),
        "decisions_total": counters.decisions,
        "queries_total": queries,
        "route_p50_us": p50,
        "route_p99_us": p99,
        "weights": config.short_weights(),
        "policy": config.router_selection_policy,
        "approximate": not config.use_kv_events,
        "last_gap_at": last_gap_at,
        "loads": None,
        "decisions": _last(journal.decisions, decisions),
        "explained": journal.last_explained,
        "events": _last(journal.events, events),
        "trimmed": False,
        "shadows": counters.shadow,
        **_replicas(host.sync),
    }


def _replicas(sync: ReplicaSync | None) -> dict[str, Any]:
    """``replicas`` (peers heard) and ``sync_lag_ms`` with replica sync on; nil without it."""
    if sync is None:
        return {"replicas": None, "sync_lag_ms": None}
    presence = sync.presence()
    return {"replicas": presence["peers"], "sync_lag_ms": presence["sync_lag_ms"]}


class StatsPublisher:
    """Publishes the service's stats blob into ``kvrouter-<pid>-stats`` every ``interval`` seconds.

    :meth:`open` creates the segment (after the engine is up), :meth:`run` is the asyncio task,
    :meth:`close` unlinks. ``publish`` writes one blob now (the task's body; tests call it directly).
    """

    def __init__(self, core: Core, host: StatsHost, *, interval: float = PUBLISH_INTERVAL_S) -> None:
        self.core = core
        self.host = host
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
        self.publish(all_loads(self.core))

    def publish(self, loads: PackedLoads) -> None:
        """Write one blob now, with ``loads`` (:func:`all_loads` or :func:`sliced_loads`)."""
        writer = self._writer
        if writer is None:
            return
        ring = self.core.journal.events
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
            body = build_blob(self.core, self.host, last_gap_at=self._last_gap_at, decisions=decisions, events=events)
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
                self.publish(await sliced_loads(self.core))
            except asyncio.CancelledError:
                raise
            except Exception:  # the dashboard's feed must never take the service down
                log.exception("stats publish failed segment=%s", self.name)

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
