"""``Partition``: one (model_name, routing_group) of the service: its block size, workers and router.

Dynamo's standalone services keep state per (model, routing group) and so does kvrouter: the first
``/register`` fixes the partition's block size (a mismatch later is a 409), the router and its slot
manager are the partition's own, and the candidates of a decision are its routable (worker, dp_rank)
keys. Those keys are kept as one tuple, rebuilt only when a worker joins, leaves or changes health:
``Router.select`` converts a candidate tuple to dense slots once and recognises the same tuple object
after that, which is what keeps a decision in the microseconds.

Approximate mode (``RouterConfig.use_kv_events=False``) gives each partition an
:class:`~kvrouter.index.ApproxIndex` that the front owns, rather than writing decisions into the shared
engine through the owning applier. The appliers hold only what engines reported, so the engine stays the
truth for every partition that has events; the front makes the decisions, so writing them into an index
in its own memory costs no message per decision and no round trip before the next decision can see it
(a decision written through an applier is visible only after the applier has applied it). The cost:
a restarted service forgets its approximate index, which expires after ``router_ttl_secs`` anyway.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal, NamedTuple
from urllib.parse import urlsplit

from ...events.model import WorkerKey
from ...index import ApproxIndex
from ...plane.registry import Format, WorkerSpec
from ...routing.config import RouterConfig
from ...routing.roles import DEFAULT_ROLE, Role, decodes, prefills
from ...routing.router import Router
from ...routing.slots import DEFAULT_EXPIRY_SECS, SlotManager

__all__ = ["Candidates", "Instance", "InstanceStatus", "Partition", "address", "keys_of"]

DEFAULT_GROUP: Final = "default"
ADDRESSES_CACHED: Final = 4096
"""Endpoints whose address is kept: more than a fleet registers in one partition."""
InstanceStatus = Literal["pending", "active", "failed"]
"""``pending``: registered, its events not followed yet (the index is starting); ``active``: followed (or
approximate mode, where nothing is followed); ``failed``: the engine could not follow it (``failure``)."""


class Candidates(NamedTuple):
    """The keys one request may go to: whole (or for its decode hop), and for a split request's prefill hop."""

    whole: tuple[WorkerKey, ...]
    prefill: tuple[WorkerKey, ...]


@functools.lru_cache(maxsize=ADDRESSES_CACHED)
def address(http_endpoint: str | None) -> str | None:
    """``ip:port`` of an ``http://ip:port/...`` endpoint: GIE's ``x-gateway-destination-endpoint`` form.

    Cached: every ``/select`` answer carries its worker's address, and ``urlsplit`` took 3.7 µs of each
    (about a twentieth of a front's own work per request); a fleet has few endpoints and each maps to one
    address for ever."""
    if not http_endpoint:
        return None
    parts = urlsplit(http_endpoint)
    if parts.hostname is None:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}"


@dataclass(slots=True)
class Instance:
    """One registered worker (``instance_id``) of a partition with every dp rank registered so far."""

    instance_id: int
    format: Format
    ranks: dict[int, str] = field(default_factory=dict)
    """dp rank -> its KV-event endpoint."""
    replay_endpoint: str | None = None
    query_endpoint: str | None = None
    rank_queries: dict[int, str] = field(default_factory=dict)
    """dp rank -> its own query endpoint, when the rank has one (a durable relay's ROUTER per rank)."""
    topic: str = ""
    http_endpoint: str | None = None
    """Where the worker serves requests: what ``/select`` returns as ``endpoint``."""
    total_kv_blocks: int | None = None
    """KV blocks per dp rank, when registered: the capacity ``active_decode_blocks_threshold`` needs."""
    role: Role = DEFAULT_ROLE
    """The hops of a request it takes (``routing/roles.py``): the same for every rank."""
    topology_domain: str | None = None
    """Its KV-transfer domain; None: the default domain."""
    lora_adapters: tuple[str, ...] = ()
    """The LoRA adapters it serves, sorted: the same for every rank."""
    http_ok: bool = True
    """Whether ``http_endpoint`` answered its last health probe."""
    status: InstanceStatus = "active"
    failure: str | None = None
    """Why the engine could not follow it (``status`` ``failed``)."""

    @property
    def address(self) -> str | None:
        """``ip:port`` of ``http_endpoint`` (:func:`address`)."""
        return address(self.http_endpoint)

    def spec(self, block_size: int) -> WorkerSpec:
        """The engine's view: every rank known so far, each with its own endpoint."""
        ranks = tuple(sorted(self.ranks))
        return WorkerSpec(
            worker_id=self.instance_id,
            endpoint=self.ranks[ranks[0]],
            format=self.format,
            replay_endpoint=self.replay_endpoint,
            query_endpoint=self.query_endpoint,
            topic=self.topic.encode(),
            dp_ranks=ranks,
            block_size=block_size,
            rank_endpoints=dict(self.ranks),
            rank_query_endpoints=dict(self.rank_queries),
        )


def keys_of(instances: Iterable[Instance]) -> list[WorkerKey]:
    """The (worker_id, dp_rank) of ``instances``, rank by rank in order."""
    return [(inst.instance_id, rank) for inst in instances for rank in sorted(inst.ranks)]


class Partition:
    """The workers, router and (in approximate mode) index of one (model_name, routing_group).

    Not thread-safe: the service's event loop is its one user.
    """

    def __init__(
        self,
        model_name: str,
        routing_group: str,
        block_size: int,
        config: RouterConfig,
        *,
        expiry_secs: float = DEFAULT_EXPIRY_SECS,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model_name = model_name
        self.routing_group = routing_group
        self.block_size = block_size
        slots = SlotManager(
            block_size=block_size,
            track_active_blocks=config.router_track_active_blocks,
            track_prefill_tokens=config.router_track_prefill_tokens,
            assume_kv_reuse=config.router_assume_kv_reuse,
            expiry_secs=expiry_secs,
            clock=clock,
        )
        self.seed = seed
        """The routers' seed: None draws a fresh one; ``kvrouter up --record`` fixes it so a replay draws alike."""
        self.router = Router(config, block_size=block_size, slots=slots, seed=seed, clock=clock)
        self.approx: ApproxIndex | None = (
            None if config.use_kv_events else ApproxIndex(ttl=config.router_ttl_secs, clock=self.router.slots.clock)
        )
        """Approximate mode's index, written by every decision (see the module docstring)."""
        self.instances: dict[int, Instance] = {}
        self.unhealthy: dict[WorkerKey, str] = {}
        """Keys skipped by ``/select`` and why (``stale``, ``http_endpoint down``)."""
        self.schedulable: tuple[WorkerKey, ...] = ()
        """The healthy keys of active instances, whatever their role."""
        self.candidates: tuple[WorkerKey, ...] = ()
        """The keys a whole request may go to (``schedulable`` ones that decode), one tuple object until the
        next change (see the module docstring)."""
        self.prefill_candidates: tuple[WorkerKey, ...] = ()
        """The ``schedulable`` keys that may take a split request's prefill hop (role prefill or both)."""
        self.disaggregated = False
        """A worker of role prefill is active beside a decode-capable one: requests may be split."""
        self.adapters: dict[str, Candidates] = {}
        """LoRA adapter -> the candidates (whole or decode hop, then prefill hop) among the workers serving it;
        every adapter a registered worker serves has an entry, empty while none of those is schedulable."""
        self.capacities: dict[WorkerKey, int] | None = None
        self.trust: Mapping[WorkerKey, str] = {}
        """Each worker's trust state (the service's ``trust.py``, shared), for explanations."""

    @property
    def name(self) -> str:
        return f"{self.model_name}:{self.routing_group}"

    @property
    def slots(self) -> SlotManager:
        """The partition's slot manager (``router.slots``): its load per worker."""
        return self.router.slots

    def worker_keys(self) -> list[WorkerKey]:
        """Every registered (worker_id, dp_rank), healthy or not."""
        return keys_of(self.instances.values())

    def rebuild(self) -> None:
        """Recompute the candidate tuple and the capacities after a change: the active instances' ranks that
        are not skipped as unhealthy."""
        active = [instance for instance in self.instances.values() if instance.status == "active"]
        self.schedulable = tuple(key for key in keys_of(active) if key not in self.unhealthy)
        decoders = keys_of(instance for instance in active if decodes(instance.role))
        self.candidates = tuple(key for key in decoders if key not in self.unhealthy)
        prefillers = keys_of(instance for instance in active if prefills(instance.role))
        self.prefill_candidates = tuple(key for key in prefillers if key not in self.unhealthy)
        self.disaggregated = any(instance.role == "prefill" for instance in active) and bool(decoders)
        serving: dict[str, set[WorkerKey]] = {}
        for instance in self.instances.values():
            for adapter in instance.lora_adapters:
                serving.setdefault(adapter, set()).update((instance.instance_id, rank) for rank in instance.ranks)
        self.adapters = {
            adapter: Candidates(
                tuple(key for key in self.candidates if key in keys),
                tuple(key for key in self.prefill_candidates if key in keys),
            )
            for adapter, keys in serving.items()
        }
        capacities = {
            (iid, rank): inst.total_kv_blocks
            for iid, inst in self.instances.items()
            if inst.total_kv_blocks
            for rank in inst.ranks
        }
        self.capacities = capacities or None

    def set_thresholds(self, *, decode: float | None, prefill: int | None) -> None:
        """Replace the busy thresholds at run time (``/busy_threshold``): a new router over the same
        slot manager, so the booked load stays."""
        config = replace(
            self.router.config, active_decode_blocks_threshold=decode, active_prefill_tokens_threshold=prefill
        )
        slots = self.router.slots
        router = Router(config, block_size=self.block_size, slots=slots, seed=self.seed, clock=slots.clock)
        router.set_untrusted(self.router.untrusted)
        self.router = router

    def thresholds(self) -> dict[str, Any]:
        """The busy thresholds as ``/busy_threshold`` shows them."""
        config = self.router.config
        return {
            "model_name": self.model_name,
            "routing_group": self.routing_group,
            "active_decode_blocks_threshold": config.active_decode_blocks_threshold,
            "active_prefill_tokens_threshold": config.active_prefill_tokens_threshold,
        }
