"""``Health``: the service's view of its index and workers, refreshed off the request path.

Every ``health_interval_secs`` the health loop reads shard status and each worker's stream (stale,
gaps, restarts) from the control segment, and every ``PROBE_EVERY`` ticks it GETs each worker's
``http_endpoint``. A change rebuilds the partition's candidate tuple, lands in the events ring
(``GET /events``) and in the cached index summary (``core/facts.py``) that every JSON answer carries, so
``/select`` never reads the control segment itself. The same tick expires
reservations older than the slot expiry (own ones, and the peers' the replica sync applied: a replica that
died never frees its own) and retries the router queue's waiters: one periodic task
for all the service's housekeeping, not one per concern.

A worker whose events went stale is skipped only while it has requests booked: engines publish only
when their cache changes, so an idle worker is quiet, and skipping every quiet worker would starve it
for ever (it could never receive the request that would make it speak again). Booked requests and
silence together mean its stream is broken. A worker whose ``http_endpoint`` stops answering is skipped
until it answers again.

The summary and the streams live in the core (the edges read them there); this module holds what only
health needs: the last rows read, the tick count and the probe session. ``/ready``'s answer is made here
too: it needs the process's parts (the replica sync, the relays, the fronts) beside the core's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt
from aiohttp import ClientSession, ClientTimeout

from ...bridge import ReplicaSync
from ...bridge.durable import DurableEvents
from ...bridge.events import NatsEventRelay
from ...engine import Engine, EngineView, WorkerStats, worker_key
from ...errors import EngineError
from ...events.model import WorkerKey
from ..core.partition import Instance, Partition
from ..core.state import Core

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
    """The health loop of one service, and ``/ready``'s answer.

    ``parts`` tells what else ``/ready`` reports on (the replica sync, the kv-events relay, durable events,
    the fronts' status), read at each call: the process layer makes some of them late.
    """

    def __init__(
        self,
        core: Core,
        engine: Engine | EngineView,
        *,
        sync: Callable[[], ReplicaSync | None] = lambda: None,
        relay: Callable[[], NatsEventRelay | None] = lambda: None,
        durable: Callable[[], DurableEvents | None] = lambda: None,
        fronts: Callable[[], dict[str, Any] | None] = lambda: None,
    ) -> None:
        self.core = core
        self.engine = engine
        self._sync, self._relay, self._durable, self._fronts = sync, relay, durable, fronts
        self.session: ClientSession | None = None
        """The probes' HTTP session: opened by :meth:`open` when the service listens, closed by :meth:`close`."""
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
            await asyncio.sleep(self.core.config.health_interval_secs)
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
        if self.core.lifecycle.phase != "serving":
            return
        if self.core.registry.waiting:  # durable mode: workers that waited for the stream's snapshot
            self.core.registry.follow_waiting()
        self.refresh_index()
        await asyncio.sleep(0)
        await self._streams()
        await asyncio.sleep(0)
        self._housekeep()
        await self.core.matches.feed(self.engine)

    async def _streams(self) -> None:
        """Gaps and restarts into the events ring, trust, and the candidates without unhealthy workers.

        ``HEALTH_SLICE`` workers at a time, the loop let go between slices (the rows are copied first, so a
        slice never reads the control segment): done at once, at 4,096 workers this held every request
        for 40-65 ms twice a second. Only rows whose words changed since the last tick are read again (a
        row's :class:`WorkerStats` is a function of its words): making them was two thirds of the step,
        about 10 µs a row, and most rows of a large fleet do not change in half a second."""
        core = self.core
        registry, journal = core.registry, core.journal
        kv_events = core.config.router.use_kv_events
        streams: dict[WorkerKey, WorkerStats] = {}
        for shard, rows in self.engine.worker_rows() if kv_events else ():
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
                    before = registry.streams.get(key)
                    if before is not None:
                        for name in ("gaps_detected", "gaps_recovered", "gaps_lost", "restarts"):
                            grown = getattr(stats, name) - getattr(before, name)
                            if grown > 0:
                                journal.event(name, worker_id=key[0], dp_rank=key[1], count=grown, state=stats.state)
                                if name == "restarts":
                                    registry.restarted(key)
                await asyncio.sleep(0)
            self._rows[shard] = _ShardRows(rows, keys, made)
            streams.update(zip(keys, made, strict=True))
        registry.streams.update(streams)
        instances = list(registry.instances())
        if kv_events:
            trust = core.trust
            for start in range(0, len(instances), HEALTH_SLICE):
                trust.update(streams, self._endpoints(instances[start : start + HEALTH_SLICE]))
                await asyncio.sleep(0)
            if core.config.router.untrusted_overlap_weight != 1.0:  # their overlap credit weighs less
                for partition in list(registry.partitions.values()):
                    keys = partition.worker_keys()
                    partition.router.set_untrusted(k for k in keys if trust.state(k) not in (None, "exact"))
        for partition in list(registry.partitions.values()):
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
                    journal.event("skipped", worker_id=key[0], dp_rank=key[1], reason=unhealthy[key])
                for key in partition.unhealthy.keys() - unhealthy.keys():
                    journal.event("recovered", worker_id=key[0], dp_rank=key[1])
                partition.unhealthy = unhealthy
                partition.rebuild()

    def _housekeep(self) -> None:
        """Reservations past the expiry, the replicas' sweep, the router queue's waiters."""
        core = self.core
        reservations, queue = core.reservations, core.queue
        peers = core.registry.peers
        for selection_id, reservation in reservations.expire(core.config.active_request_expiry_secs):
            core.counters.expired_reservations += 1
            if peers is not None:  # the peers expire it too, about now; the Free makes sure
                peers.freed(selection_id, reservation.worker)
        for partition in core.registry.partitions.values():
            # the router sweeps only when it decides, once a minute; requests learnt from a replica
            # that died must go at the expiry even when this replica decides nothing (O(expired))
            if reservations.sweep(partition):
                queue.changed(partition)
        if peers is not None:
            peers.sweep()
        queue.tick()  # retry the waiters, drop those whose client left

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
        """The index summary every answer carries, and the shards whose status changed into the events ring."""
        for shard in self.core.facts.refresh(self.engine.stats(workers=False)):
            self.core.journal.event("shard", shard=shard.shard, status=shard.status, restarts=shard.restarts)

    async def probe(self) -> None:
        """GET ``{http_endpoint}/health`` of every instance that has one; a failure marks it down."""
        session = self.session
        if session is None:
            return
        instances = [i for _, i in self.core.registry.instances() if i.http_endpoint]

        async def probe(instance: Instance) -> None:
            ok = False
            with contextlib.suppress(Exception):
                async with session.get(f"{instance.http_endpoint}/health") as response:
                    ok = response.status < 500
            instance.http_ok = ok

        await asyncio.gather(*(probe(i) for i in instances))

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """``GET /ready``'s answer: ready only with every shard up, nothing recovering, a schedulable
        worker, nothing waiting to be followed, and not stopping."""
        core = self.core
        lifecycle = core.lifecycle
        reasons: list[str] = []
        shards: dict[str, str] = {}
        index: dict[str, Any] = {"blocks": 0, "blocks_cap": 0, "evicted": {}}
        if lifecycle.stopping:
            reasons.append("stopping")
        if lifecycle.phase in ("new", "starting"):
            reasons.append("engine starting")
        elif lifecycle.phase == "failed":
            reasons.append(f"engine failed: {lifecycle.failure}")
        else:
            try:
                for shard in self.engine.stats(workers=False):
                    shards[str(shard.shard)] = shard.status
                    index["blocks"] += shard.entries  # the cap (--max-index-blocks), its use and evictions
                    index["blocks_cap"] += shard.budget
                    for reason, count in shard.evicted.items():
                        index["evicted"][reason] = index["evicted"].get(reason, 0) + count
                    if shard.status != "up":
                        reasons.append(f"shard {shard.shard} {shard.status}")
            except EngineError as exc:
                reasons.append(f"engine: {exc}")
        if waiting := core.registry.waiting:
            reasons.append(f"{waiting} registered workers not followed yet")
        workers = [
            {
                "model_name": p.model_name,
                "routing_group": p.routing_group,
                "worker_id": k[0],
                "dp_rank": k[1],
                "role": p.instances[k[0]].role,
            }
            for p in core.registry.partitions.values()
            for k in p.schedulable
        ]
        if not workers:
            reasons.append("no schedulable worker")
        elif not any(p.candidates for p in core.registry.partitions.values()):
            reasons.append("no decode-capable worker (every schedulable worker has role prefill)")
        answer: dict[str, Any] = {}
        sync = self._sync()
        if sync is not None:
            answer["replica_sync"] = sync.status()
            if not sync.connected:
                reasons.append("replica sync not connected to NATS")
            elif not sync.joined:
                reasons.append("replica sync joining (snapshot from a peer)")
            elif sync.resyncing is not None:
                reasons.append(f"replica sync re-syncing ({sync.resyncing})")
        fronts = self._fronts()
        if fronts is not None:
            answer["fronts"] = fronts
        relay = self._relay()
        if relay is not None:
            answer["nats_events"] = relay.status()
            if not relay.connected:
                reasons.append("kv-events relay not connected to NATS")
        durable = self._durable()
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
