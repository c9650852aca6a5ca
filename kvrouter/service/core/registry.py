"""``Registry``: the registered workers, their partitions, and the writes that wait for the index.

Dynamo's standalone services keep state per (model, routing group) and so does kvrouter
(``partition.py``): the first registration fixes the partition's block size, and an instance id belongs to
one partition and one format. Every write is checked against that here, before anything changes, and a
refusal names what it contradicts (:class:`Conflict`, :class:`UnknownPartition`, :class:`NotFound`).

**Following a worker** (subscribing to its KV events, restoring its blocks) is the engine's, and only the
front that owns the engine can do it: the registry asks its :class:`Follower`. Until the follower is ready
(the index is starting: a first run compiles its kernels for about a minute; in durable mode, the snapshot
is loading), a registration is taken at once, checked and answered, and its instance waits ``pending``
(listed by ``/workers``, not yet routable); :meth:`Registry.follow_waiting` follows the waiting instances
in the order they came once the follower is ready, and a failure then marks the instance ``failed``, with
its reason, in ``/workers`` and the log. An unregistration of a waiting instance simply forgets it: it was
never followed. At most :data:`MAX_WAITING` writes wait; the next is refused (:class:`Backlogged`) rather
than queued without bound. Why accept rather than refuse with 503 until the index is up: the reference's
indexer takes registrations as soon as ``/health`` answers, and the supervisors and scripts written for it
register once, at once.

The other fronts of ``kvrouter up --fronts N`` hold a copy of front 0's registry (``mirror``): their
registry has no follower and applies what front 0 decided.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final, Protocol

from ...errors import (
    Backlogged,
    BadRequest,
    ConfigError,
    Conflict,
    EngineError,
    KvRouterError,
    NotFound,
    Unavailable,
    UnknownPartition,
)
from ...events.model import WorkerKey
from ...routing.slots import SlotManager
from .config import ServiceConfig
from .journal import Journal
from .partition import Instance, Partition
from .requests import Registration, Thresholds, Unregistration

if TYPE_CHECKING:
    from ...engine import WorkerStats
    from .accuracy import Accuracy
    from .recording import ServiceRecording
    from .trust import Trust

__all__ = ["MAX_WAITING", "Follower", "Peers", "Registry"]

log = logging.getLogger(__name__)

MAX_WAITING: Final = 1024
"""Registry writes (registrations, unregistrations, busy thresholds) that may wait for the index to start:
a fleet's supervisor registers each rank once, so this is more ranks than a start ever sees, and a bound
keeps a client looping on ``/register`` from growing the queue without end."""


class Follower(Protocol):
    """What makes the engine follow registered workers: front 0's engine (``process/follower.py``)."""

    def ready(self, registration: Registration) -> bool:
        """Whether ``registration``'s worker can be followed now (the index is up; in durable mode, for a
        worker whose events come over NATS, the stream's snapshot is loaded)."""
        ...

    def follow(self, instance: Instance, registrations: Sequence[Registration], block_size: int) -> Instance:
        """Follow every rank of ``instance`` (replacing what was followed of it); returns the instance as
        followed (a NATS worker's ranks get their relay's endpoints).

        Raises:
            EngineError: the engine refused. ConfigError: the worker's endpoints cannot be followed.
        """
        ...

    def unfollow(self, instance_id: int, ranks: Sequence[int], rest: Instance | None, block_size: int) -> None:
        """Stop following ``ranks`` of ``instance_id``; ``rest`` is what remains of it (followed again)."""
        ...


class Peers(Protocol):
    """The replica sync as the core uses it (``bridge/sync.py``'s ``ReplicaSync``)."""

    @property
    def connected(self) -> bool: ...

    def worker_registered(self, worker: WorkerKey) -> None: ...

    def added(self, request_id: str, slots: SlotManager, lora_name: str | None = None) -> None: ...

    def prefill_completed(self, request_id: str, worker: WorkerKey) -> None: ...

    def freed(self, request_id: str, worker: WorkerKey) -> None: ...

    def sweep(self) -> object: ...


class Registry:
    """The workers of one service, by partition; see the module docstring. The event loop is its one user."""

    def __init__(
        self,
        config: ServiceConfig,
        journal: Journal,
        trust: Trust,
        accuracy: Accuracy,
        *,
        recording: ServiceRecording | None = None,
    ) -> None:
        self.config = config
        self.journal = journal
        self.trust = trust
        self.accuracy = accuracy
        self.recording = recording
        self.partitions: dict[tuple[str, str], Partition] = {}
        self.registrations: dict[WorkerKey, Registration] = {}
        """Every registered rank as registered (a NATS worker's endpoint is its relay's once followed): what
        front 0 hands the other fronts."""
        self.streams: dict[WorkerKey, WorkerStats] = {}
        """Each followed rank's stream as the health loop last read it from the control segment."""
        self.follower: Follower | None = None
        """Front 0's engine with KV events on; None on the other fronts and in approximate mode."""
        self.peers: Peers | None = None
        self.changed: Callable[[Partition], None] = lambda _partition: None
        """Called after a partition's workers or thresholds change (the router queue retries its waiters)."""
        self.dropped: Callable[[list[str]], None] = lambda _request_ids: None
        """Called with the requests a worker's restart or removal dropped from its slot manager."""
        self.adapter_bases: dict[str, str] = {}
        """LoRA adapter -> the model whose workers serve it (one base model per adapter name)."""
        self._owner: dict[int, tuple[str, str]] = {}
        """instance_id -> its partition: ids are unique across partitions."""
        self._waiting: dict[int, None] = {}
        """Instances registered while the follower was not ready, in the order they came."""
        self._queued = 0
        """Writes taken since the follower was last ready: at most ``MAX_WAITING``."""

    # -- reading ------------------------------------------------------------------------------------

    def partition(self, model: str, group: str = "default") -> Partition:
        """The partition of (model, group).

        Raises:
            UnknownPartition: no worker was ever registered under that model (or group).
        """
        partition = self.partitions.get((model, group))
        if partition is None:
            if any(m == model for m, _ in self.partitions):
                raise UnknownPartition(f"routing_group {group!r} of model {model!r} has no workers")
            raise UnknownPartition(f"model {model!r} has no workers")
        return partition

    def served_as(self, model: str) -> tuple[str, str | None]:
        """What a request naming ``model`` is routed as: (its base model, the LoRA adapter) when ``model`` is an
        adapter some worker registered, else (``model``, None)."""
        base = self.adapter_bases.get(model)
        return (model, None) if base is None else (base, model)

    def owner(self, worker: WorkerKey) -> Partition | None:
        """The partition of a registered rank; None when not registered."""
        key = self._owner.get(worker[0])
        if key is None:
            return None
        partition = self.partitions[key]
        instance = partition.instances.get(worker[0])
        return partition if instance is not None and worker[1] in instance.ranks else None

    def instances(self) -> Iterator[tuple[Partition, Instance]]:
        for partition in list(self.partitions.values()):
            for instance in list(partition.instances.values()):
                yield partition, instance

    @property
    def waiting(self) -> int:
        """Instances registered and not followed yet."""
        return len(self._waiting)

    # -- writes -------------------------------------------------------------------------------------

    def register(self, registration: Registration, *, mirror: bool = False) -> None:
        """``POST /register``: add one (instance, dp_rank). With a follower, its worker is followed now, or
        once the follower is ready (the instance waits ``pending``); ``mirror``: another front copying front
        0's registry, which follows nothing.

        Raises:
            Conflict: a duplicate rank, a block-size mismatch in the partition, an id known in another
                partition or with another format.
            BadRequest: endpoints the engine cannot use.
            Backlogged: ``MAX_WAITING`` writes already wait for the index.
            Unavailable: the engine refused the worker.
        """
        recording = self.recording
        if recording is None:
            self._register(registration, mirror=mirror)
            return
        t = recording.clock.hold()  # a new partition's router reads the clock
        try:
            self._register(registration, mirror=mirror)
        finally:
            recording.clock.release()
        recording.registered(t, registration)

    def _register(self, reg: Registration, *, mirror: bool) -> None:
        key = (reg.model_name, reg.routing_group)
        follower = None if mirror else self.follower
        if follower is None and not mirror and self.config.router.use_kv_events:
            raise Unavailable("this front follows no engine: registrations go to front 0")
        if self.config.router.use_kv_events and reg.endpoint is None and reg.transport != "nats":
            raise BadRequest("endpoint: required (KV events are on)")
        owner = self._owner.get(reg.instance_id)
        if owner is not None and owner != key:
            raise Conflict(f"instance {reg.instance_id} is registered in {owner[0]}:{owner[1]}")
        partition = self.partitions.get(key)
        if partition is not None and partition.block_size != reg.block_size:
            raise Conflict(
                f"block_size {reg.block_size} differs from {partition.name}'s block_size {partition.block_size}"
            )
        instance = partition.instances.get(reg.instance_id) if partition else None
        if instance is not None:
            if reg.dp_rank in instance.ranks:
                raise Conflict(f"instance {reg.instance_id} dp_rank {reg.dp_rank} is already registered")
            if instance.format != reg.format:
                raise Conflict(f"instance {reg.instance_id} is registered with format {instance.format}")
            if instance.role != reg.role:
                raise Conflict(
                    f"instance {reg.instance_id} is registered with role {instance.role} (one role per instance)"
                )
            if instance.topology_domain != reg.topology_domain:
                raise Conflict(
                    f"instance {reg.instance_id} is registered in topology_domain {instance.topology_domain!r} "
                    "(one domain per instance)"
                )
            if instance.lora_adapters != reg.lora_adapters:
                raise Conflict(
                    f"instance {reg.instance_id} is registered with lora_adapters {list(instance.lora_adapters)} "
                    "(one set per instance: unregister it to change them)"
                )
        self._check_adapters(reg)
        fresh = instance is None
        if instance is None:
            instance = Instance(
                reg.instance_id,
                reg.format,
                role=reg.role,
                topology_domain=reg.topology_domain,
                lora_adapters=reg.lora_adapters,
            )
        updated = Instance(
            reg.instance_id,
            reg.format,
            {**instance.ranks, reg.dp_rank: reg.endpoint or ""},
            replay_endpoint=instance.replay_endpoint if instance.ranks else reg.replay_endpoint,
            query_endpoint=instance.query_endpoint if instance.ranks else reg.query_endpoint,
            rank_queries=dict(instance.rank_queries),
            topic=instance.topic if instance.ranks else reg.topic,
            http_endpoint=reg.http_endpoint or instance.http_endpoint,
            total_kv_blocks=reg.total_kv_blocks or instance.total_kv_blocks,
            role=instance.role,
            topology_domain=instance.topology_domain,
            lora_adapters=instance.lora_adapters,
            status=instance.status,
        )
        registrations = [*self._registrations_of(instance), reg]
        if follower is not None:
            if reg.transport != "nats":
                try:  # every check the engine would make, made now
                    updated.spec(reg.block_size)
                except ConfigError as exc:
                    raise BadRequest(str(exc)) from exc
            if reg.instance_id in self._waiting or not all(follower.ready(r) for r in registrations):
                self._take_write()
                updated.status = "pending"
            else:
                try:
                    updated = follower.follow(updated, registrations, reg.block_size)
                except ConfigError as exc:
                    raise BadRequest(str(exc)) from exc
                except EngineError as exc:
                    raise Unavailable(f"the engine did not take the worker: {exc}") from exc
                updated.status = "active"
                reg = self._as_followed(reg, updated)
        if partition is None:
            recording = self.recording
            partition = Partition(
                reg.model_name,
                reg.routing_group,
                reg.block_size,
                self.config.router,
                expiry_secs=self.config.active_request_expiry_secs,
                seed=self.config.router_seed if recording is None else recording.seed,
                clock=time.monotonic if recording is None else recording.clock,
            )
            partition.trust = self.trust.states
            self.partitions[key] = partition
        partition.instances[reg.instance_id] = updated
        if updated.status == "pending":
            self._waiting[reg.instance_id] = None
        self._owner[reg.instance_id] = key
        self.registrations[reg.instance_id, reg.dp_rank] = reg
        self.trust.registered((reg.instance_id, reg.dp_rank))
        partition.rebuild()
        self._index_adapters()
        if self.peers is not None:
            self.peers.worker_registered((reg.instance_id, reg.dp_rank))  # peers' requests kept for it
        self.changed(partition)
        self.journal.event(
            "registered",
            model_name=reg.model_name,
            routing_group=reg.routing_group,
            worker_id=reg.instance_id,
            dp_rank=reg.dp_rank,
            endpoint=reg.endpoint,
            new_instance=fresh,
            status=updated.status,
        )

    def unregister(self, request: Unregistration, *, mirror: bool = False) -> int:
        """``POST /unregister``: remove a rank, or the whole instance; returns the ranks removed. A waiting
        instance is forgotten; a followed one is no longer followed (unless ``mirror``).

        Raises:
            NotFound: the instance (or rank) is not registered there.
            Backlogged: ``MAX_WAITING`` writes already wait for the index.
        """
        removed = 0
        for (model, group), partition in list(self.partitions.items()):
            if model != request.model_name or (request.routing_group not in (None, group)):
                continue
            instance = partition.instances.get(request.instance_id)
            if instance is None:
                continue
            if request.dp_rank is not None and request.dp_rank not in instance.ranks:
                raise NotFound(f"instance {request.instance_id} has no dp_rank {request.dp_rank}")
            ranks = [request.dp_rank] if request.dp_rank is not None else list(instance.ranks)
            waiting = request.instance_id in self._waiting
            if waiting and not mirror:
                self._take_write()
            for rank in ranks:
                self.registrations.pop((request.instance_id, rank), None)
                self.accuracy.forget((request.instance_id, rank))
                self.trust.forget((request.instance_id, rank))
                del instance.ranks[rank]
                instance.rank_queries.pop(rank, None)
                partition.unhealthy.pop((request.instance_id, rank), None)
                self.streams.pop((request.instance_id, rank), None)
                self.dropped(partition.slots.drop_worker((request.instance_id, rank)))  # predictions and all
            removed += len(ranks)
            if not instance.ranks:
                del partition.instances[request.instance_id]
                self._owner.pop(request.instance_id, None)
                self._waiting.pop(request.instance_id, None)
            follower = None if mirror else self.follower
            if follower is not None and not waiting and instance.status == "active":
                rest = instance if instance.ranks else None
                try:
                    follower.unfollow(request.instance_id, ranks, rest, partition.block_size)
                except (EngineError, ConfigError) as exc:
                    log.error("unfollow failed worker=%d error=%s", request.instance_id, exc)
            if partition.approx is not None:
                partition.approx.remove_worker(request.instance_id)  # a removed rank's blocks go with it
            partition.rebuild()
            self._index_adapters()
            self.changed(partition)
            self.journal.event(
                "unregistered", model_name=model, routing_group=group, worker_id=request.instance_id, dp_ranks=ranks
            )
        if not removed:
            raise NotFound(f"instance {request.instance_id} is not registered under {request.model_name!r}")
        if self.recording is not None:
            self.recording.unregistered(time.monotonic_ns(), request)
        return removed

    def restarted(self, worker: WorkerKey) -> int:
        """The engine behind ``worker`` restarted (its event ids went back to 0): the requests booked on it died
        with it, so they leave its load, and the blocks they held stop counting as predicted there. Returns
        how many were dropped."""
        dropped = 0
        for partition in self.partitions.values():
            ids = partition.slots.drop_worker(worker)
            self.dropped(ids)
            dropped += len(ids)
        if dropped:
            log.info("worker restarted worker=%d dp=%d dropped_requests=%d", worker[0], worker[1], dropped)
        return dropped

    def set_thresholds(self, thresholds: Thresholds, *, mirror: bool = False) -> dict[str, Any]:
        """``POST /busy_threshold``: a partition's busy thresholds; returns them as ``GET`` shows them.

        Raises:
            UnknownPartition: no such partition. BadRequest: a threshold the router refuses.
            Backlogged: ``MAX_WAITING`` writes already wait for the index.
        """
        partition = self.partition(thresholds.model_name, thresholds.routing_group)
        if self._waiting and not mirror:
            self._take_write()
        config = partition.router.config
        decode = config.active_decode_blocks_threshold
        prefill = config.active_prefill_tokens_threshold
        if "active_decode_blocks_threshold" in thresholds.given:
            decode = thresholds.decode
        if "active_prefill_tokens_threshold" in thresholds.given:
            prefill = thresholds.prefill
        recording = self.recording
        t = 0 if recording is None else recording.clock.hold()  # the new router reads the clock
        try:
            partition.set_thresholds(decode=decode, prefill=prefill)
        except ConfigError as exc:
            raise BadRequest(str(exc)) from exc
        finally:
            if recording is not None:
                recording.clock.release()
        if recording is not None:
            recording.thresholds(t, partition)
        answer = partition.thresholds()
        self.journal.event("busy_threshold", **answer)
        self.changed(partition)
        return answer

    def mark_down(self, partition: Partition, instance_id: int, reason: str) -> None:
        """Skip every rank of an instance whose ``http_endpoint`` refused a connection, now rather than at its
        next health probe (which also brings it back once it answers)."""
        instance = partition.instances.get(instance_id)
        if instance is None:
            return
        instance.http_ok = False
        for rank in instance.ranks:
            key = (instance_id, rank)
            if key not in partition.unhealthy:
                partition.unhealthy[key] = "http_endpoint down"
                self.journal.event("skipped", worker_id=key[0], dp_rank=key[1], reason=reason)
        partition.rebuild()

    # -- the start ----------------------------------------------------------------------------------

    def follow_waiting(self) -> int:
        """Follow the instances that waited and whose follower is ready now, in the order they came; returns
        how many still wait. An instance the engine refuses is marked ``failed``, logged and journalled."""
        follower = self.follower
        if follower is None:
            return 0
        for instance_id in list(self._waiting):
            key = self._owner.get(instance_id)
            partition = None if key is None else self.partitions.get(key)
            instance = None if partition is None else partition.instances.get(instance_id)
            if partition is None or instance is None:
                del self._waiting[instance_id]
                continue
            registrations = self._registrations_of(instance)
            if not all(follower.ready(r) for r in registrations):
                continue
            del self._waiting[instance_id]
            try:
                followed = follower.follow(instance, registrations, partition.block_size)
            except KvRouterError as exc:
                self._fail(partition, instance, str(exc))
                continue
            followed.status = "active"
            partition.instances[instance_id] = followed
            for reg in registrations:
                self.registrations[reg.instance_id, reg.dp_rank] = self._as_followed(reg, followed)
            partition.rebuild()
            self.changed(partition)
            self.journal.event("followed", worker_id=instance_id, dp_ranks=sorted(followed.ranks))
        if not self._waiting:
            self._queued = 0
        return len(self._waiting)

    def fail_waiting(self, reason: str) -> None:
        """The index did not come up: every waiting instance is ``failed`` with ``reason``."""
        for instance_id in list(self._waiting):
            del self._waiting[instance_id]
            key = self._owner.get(instance_id)
            partition = None if key is None else self.partitions.get(key)
            instance = None if partition is None else partition.instances.get(instance_id)
            if partition is not None and instance is not None:
                self._fail(partition, instance, reason)

    def _fail(self, partition: Partition, instance: Instance, reason: str) -> None:
        instance.status = "failed"
        instance.failure = reason
        log.error("registration failed worker=%d partition=%s error=%s", instance.instance_id, partition.name, reason)
        self.journal.event("failed", worker_id=instance.instance_id, dp_ranks=sorted(instance.ranks), error=reason)
        partition.rebuild()

    def _check_adapters(self, reg: Registration) -> None:
        """A model name and an adapter name mean one thing each: a request's ``model`` names either.

        Raises:
            Conflict: ``reg``'s model is another model's adapter, or one of its adapters is a model or
                another model's adapter.
        """
        base = self.adapter_bases.get(reg.model_name)
        if base is not None:
            raise Conflict(f"model_name {reg.model_name!r} is registered as a LoRA adapter of {base!r}")
        models = {model for model, _group in self.partitions} | {reg.model_name}
        for adapter in reg.lora_adapters:
            if adapter in models:
                raise Conflict(f"lora_adapters: {adapter!r} is a model's name; an adapter needs a name of its own")
            base = self.adapter_bases.get(adapter, reg.model_name)
            if base != reg.model_name:
                raise Conflict(f"lora_adapters: {adapter!r} is registered as an adapter of {base!r}")

    def _index_adapters(self) -> None:
        """``adapter_bases`` from the partitions' adapters, after a worker joined or left."""
        self.adapter_bases = {
            adapter: partition.model_name for partition in self.partitions.values() for adapter in partition.adapters
        }

    def _take_write(self) -> None:
        if self._queued >= MAX_WAITING:
            raise Backlogged(
                f"{MAX_WAITING} registry writes already wait for the index to start; retry once /ready answers 200"
            )
        self._queued += 1

    def _registrations_of(self, instance: Instance) -> list[Registration]:
        found = (self.registrations.get((instance.instance_id, rank)) for rank in sorted(instance.ranks))
        return [reg for reg in found if reg is not None]

    @staticmethod
    def _as_followed(reg: Registration, instance: Instance) -> Registration:
        """``reg`` with the endpoint its rank is followed at (a NATS worker's relay endpoint)."""
        endpoint = instance.ranks.get(reg.dp_rank) or None
        return reg if endpoint == reg.endpoint else replace(reg, endpoint=endpoint)
