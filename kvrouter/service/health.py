"""``Health``: the service's view of its index and workers, refreshed off the request path.

Every ``health_interval_secs`` the health loop reads shard status and each worker's stream (stale,
gaps, restarts) from the control segment, and every ``PROBE_EVERY`` ticks it GETs each worker's
``http_endpoint``. A change rebuilds the partition's candidate tuple, lands in the events ring
(``GET /events``) and in the cached index summary (``Service._index``, ``_index_headers``) that every
JSON answer carries, so ``/select`` never reads the control segment itself. The same tick expires
reservations older than the slot expiry (own ones, and the peers' the replica sync applied: a replica that
died never frees its own) and retries the router queue's waiters: one periodic task
for all the service's housekeeping, not one per concern.

A worker whose events went stale is skipped only while it has requests booked: engines publish only
when their cache changes, so an idle worker is quiet, and skipping every quiet worker would starve it
for ever (it could never receive the request that would make it speak again). Booked requests and
silence together mean its stream is broken. A worker whose ``http_endpoint`` stops answering is skipped
until it answers again.

The summary and the streams stay on the service (the HTTP and ZMQ fronts read them there); this
module holds what only health needs: the last shard status, the tick count and the probe session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt
from aiohttp import ClientSession, ClientTimeout

from ..engine import WorkerStats, worker_key
from ..errors import EngineError
from ..events.model import WorkerKey

if TYPE_CHECKING:
    from .app import Service
    from .partition import Instance, Partition

__all__ = ["PROBE_EVERY", "PROBE_TIMEOUT_S", "Health"]

log = logging.getLogger(__name__)

PROBE_EVERY: Final = 4
"""``http_endpoint`` probes run every this many health ticks."""
PROBE_TIMEOUT_S: Final = 1.0
HEALTH_SLICE: Final = 128
"""Workers a tick's stream step reads, checks for trust or for health before it lets the event loop serve
requests again (about 1 ms: ``WorkerStats`` take about 8 µs each)."""


class _ShardRows(NamedTuple):
    rows: npt.NDArray[np.uint64]
    keys: list[WorkerKey]
    stats: list[WorkerStats]


class Health:
    """The health loop of one :class:`~kvrouter.service.app.Service`, and ``/ready``'s answer."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.session: ClientSession | None = None
        """The probes' HTTP session: opened by :meth:`open` when the service listens, closed by :meth:`close`."""
        self._shard_status: dict[int, str] = {}
        self._ticks = 0
        self._rows: dict[int, _ShardRows] = {}
        """Per shard, the rows in use the last tick read, with their keys and stats in row order."""

    def open(self) -> None:
        self.session = ClientSession(timeout=ClientTimeout(total=PROBE_TIMEOUT_S))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.service.config.health_interval_secs)
            try:
                await self.tick()
                self._ticks += 1
                if self._ticks % PROBE_EVERY == 0:
                    await self.probe()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must survive anything; log with the traceback
                log.exception("health tick failed")

    async def tick(self) -> None:
        """Shard status, stream health and gaps, candidate tuples, index summary, reservation expiry, the
        matched blocks for the index cap. In steps of at most about a millisecond, the event loop let go
        between them: requests that arrive meanwhile wait for one step, not the whole tick."""
        if not self.service._started or self.service._stopping:
            return
        self.refresh_index()
        await asyncio.sleep(0)
        await self._streams()
        await asyncio.sleep(0)
        self._housekeep()
        await self.service.feed_matches()

    async def _streams(self) -> None:
        """Gaps and restarts into the events ring, trust, and the candidates without unhealthy workers.

        ``HEALTH_SLICE`` workers at a time, the loop let go between slices (the rows are copied first, so a
        slice never reads the control segment): done at once, at 4,096 workers this held every request
        for 40-65 ms twice a second. Only rows whose words changed since the last tick are read again (a
        row's :class:`WorkerStats` is a function of its words): making them was two thirds of the step,
        about 10 µs a row, and most rows of a large fleet do not change in half a second."""
        service = self.service
        kv_events = service.config.router.use_kv_events
        streams: dict[WorkerKey, WorkerStats] = {}
        for shard, rows in service.engine.worker_rows() if kv_events else ():
            last = self._rows.get(shard)
            if last is not None and last.rows.shape == rows.shape:
                changed = np.flatnonzero((rows != last.rows).any(axis=1)).tolist()
                keys, made = list(last.keys), list(last.stats)
            else:  # every row, in order: each is appended
                changed, keys, made = list(range(len(rows))), [], []
            for start in range(0, len(changed), HEALTH_SLICE):
                chunk = changed[start : start + HEALTH_SLICE]
                for index, words in zip(chunk, rows[chunk].tolist(), strict=True):
                    key, stats = worker_key(words), WorkerStats.of_row(shard, words)
                    if index < len(keys):
                        keys[index], made[index] = key, stats
                    else:
                        keys.append(key)
                        made.append(stats)
                    before = service._streams.get(key)
                    if before is not None:
                        for name in ("gaps_detected", "gaps_recovered", "gaps_lost", "restarts"):
                            grown = getattr(stats, name) - getattr(before, name)
                            if grown > 0:
                                service._event(name, worker_id=key[0], dp_rank=key[1], count=grown, state=stats.state)
                await asyncio.sleep(0)
            self._rows[shard] = _ShardRows(rows, keys, made)
            streams.update(zip(keys, made, strict=True))
        service._streams.update(streams)
        instances = [(p, i) for p in list(service.partitions.values()) for i in list(p.instances.values())]
        if kv_events:
            trust = service.trust
            for start in range(0, len(instances), HEALTH_SLICE):
                trust.update(streams, self._endpoints(instances[start : start + HEALTH_SLICE]))
                await asyncio.sleep(0)
            if service.config.router.untrusted_overlap_weight != 1.0:  # their overlap credit weighs less
                for partition in list(service.partitions.values()):
                    keys = partition.worker_keys()
                    partition.router.set_untrusted(k for k in keys if trust.state(k) not in (None, "exact"))
        for partition in list(service.partitions.values()):
            unhealthy: dict[WorkerKey, str] = {}
            for n, instance in enumerate(list(partition.instances.values()), 1):
                for rank in instance.ranks:
                    key = (instance.instance_id, rank)
                    row = streams.get(key)
                    if not instance.http_ok:
                        unhealthy[key] = "http_endpoint down"
                    elif row is not None and row.stale and partition.slots.active_requests(key) > 0:
                        unhealthy[key] = "events stale"
                if n % HEALTH_SLICE == 0:
                    await asyncio.sleep(0)
            if unhealthy != partition.unhealthy:
                for key in unhealthy.keys() - partition.unhealthy.keys():
                    self.service._event("skipped", worker_id=key[0], dp_rank=key[1], reason=unhealthy[key])
                for key in partition.unhealthy.keys() - unhealthy.keys():
                    self.service._event("recovered", worker_id=key[0], dp_rank=key[1])
                partition.unhealthy = unhealthy
                partition.rebuild()

    def _housekeep(self) -> None:
        """Reservations past the expiry, the replicas' sweep, the router queue's waiters."""
        service = self.service
        expiry = time.monotonic() - service.config.active_request_expiry_secs
        sync = service.sync
        for selection_id, reservation in list(service._reservations.items()):
            if reservation.at > expiry:
                break
            del service._reservations[selection_id]
            service.free_booked(reservation.partition, selection_id)
            service.counters.expired_reservations += 1
            if sync is not None:  # the peers expire it too, about now; the Free makes sure
                sync.freed(selection_id, reservation.worker)
        for partition in service.partitions.values():
            # the router sweeps only when it decides, once a minute; requests learnt from a replica
            # that died must go at the expiry even when this replica decides nothing (O(expired))
            if service.sweep(partition):
                service.queue.changed(partition)
        if sync is not None:
            sync.sweep()
        self.service.queue.tick()  # queue.py: retry the waiters, drop those whose client left

    @staticmethod
    def _endpoints(instances: list[tuple[Partition, Instance]]) -> dict[WorkerKey, tuple[str, str, int, str]]:
        """Per rank of ``instances``: (event endpoint, topic, block size, format), for the trust checks'
        messages."""
        return {
            (instance.instance_id, rank): (endpoint, instance.topic or "", partition.block_size, instance.format)
            for partition, instance in instances
            for rank, endpoint in instance.ranks.items()
        }

    def refresh_index(self) -> None:
        stats = self.service.engine.stats(workers=False)
        for shard in stats:
            if self._shard_status.get(shard.shard) != shard.status:
                if shard.shard in self._shard_status:
                    self.service._event("shard", shard=shard.shard, status=shard.status, restarts=shard.restarts)
                self._shard_status[shard.shard] = shard.status
        last = max((s.last_event_ns for s in stats), default=0)
        self.service._index = {
            "epoch": sum(s.epoch for s in stats),
            "events_applied": sum(s.events_applied for s in stats),
            "last_event_age_ms": round((time.time_ns() - last) / 1e6, 1) if last else None,
            "recovering": sum(s.status == "recovering" for s in stats),
        }
        self.service._index_headers = {
            "X-Kvrouter-Index-Epoch": str(self.service._index["epoch"]),
            "X-Kvrouter-Index-Events": str(self.service._index["events_applied"]),
            "X-Kvrouter-Index-Age-Ms": str(self.service._index["last_event_age_ms"]),
        }

    async def probe(self) -> None:
        """GET ``{http_endpoint}/health`` of every instance that has one; a failure marks it down."""
        session = self.session
        if session is None:
            return
        instances = [i for p in self.service.partitions.values() for i in p.instances.values() if i.http_endpoint]

        async def probe(instance: Instance) -> None:
            ok = False
            with contextlib.suppress(Exception):
                async with session.get(f"{instance.http_endpoint}/health") as response:
                    ok = response.status < 500
            instance.http_ok = ok

        await asyncio.gather(*(probe(i) for i in instances))

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """``GET /ready``'s answer: ready only with every shard up, nothing recovering, a schedulable
        worker, and not stopping."""
        reasons: list[str] = []
        shards: dict[str, str] = {}
        index: dict[str, Any] = {"blocks": 0, "blocks_cap": 0, "evicted": {}}
        if self.service._stopping:
            reasons.append("stopping")
        if not self.service._started:
            reasons.append("engine starting")
        else:
            try:
                for shard in self.service.engine.stats(workers=False):
                    shards[str(shard.shard)] = shard.status
                    index["blocks"] += shard.entries  # the cap (--max-index-blocks), its use and evictions
                    index["blocks_cap"] += shard.budget
                    for reason, count in shard.evicted.items():
                        index["evicted"][reason] = index["evicted"].get(reason, 0) + count
                    if shard.status != "up":
                        reasons.append(f"shard {shard.shard} {shard.status}")
            except EngineError as exc:
                reasons.append(f"engine: {exc}")
        workers = [
            {"model_name": p.model_name, "routing_group": p.routing_group, "worker_id": k[0], "dp_rank": k[1]}
            for p in self.service.partitions.values()
            for k in p.candidates
        ]
        if not workers:
            reasons.append("no schedulable worker")
        answer: dict[str, Any] = {}
        sync = self.service.sync
        if sync is not None:
            answer["replica_sync"] = sync.status()
            if not sync.connected:
                reasons.append("replica sync not connected to NATS")
            elif not sync.joined:
                reasons.append("replica sync joining (snapshot from a peer)")
            elif sync.resyncing is not None:
                reasons.append(f"replica sync re-syncing ({sync.resyncing})")
        if self.service.fronts is not None:
            answer["fronts"] = self.service.fronts.status()
        relay = self.service.relay
        if relay is not None:
            answer["nats_events"] = relay.status()
            if not relay.connected:
                reasons.append("kv-events relay not connected to NATS")
        durable = self.service.durable
        if durable is not None:
            answer["durable_events"] = durable.status()
            if not durable.loaded:
                reasons.append("durable kv-events starting (stream, snapshot)")
            elif not durable.caught_up:
                reasons.append(f"durable kv-events catching up (seq {durable.processed_seq} of {durable.target_seq})")
        ok = not reasons
        return ok, {
            "ready": ok,
            "schedulable_workers": len(workers),
            "workers": workers,
            "reasons": reasons,
            "shards": shards,
            "index": index,
            **answer,
        }
