"""``EngineFollower``: front 0's engine (and its NATS relay) following the workers the registry holds.

The registry (``core/registry.py``) decides what is registered; this makes the engine follow it: an
instance's ranks go to their appliers as one :class:`~kvrouter.plane.registry.WorkerSpec`. A worker whose
events come over NATS (``"transport": "nats"``) first gets a local PUB per rank from the kv-events relay
(``bridge/events.py``, made and started on the loop at the first such worker), and in durable mode a query
endpoint per rank the relay answers from the stream (``bridge/durable.py``). Until the engine is up (and,
for NATS workers in durable mode, the stream's snapshot is loaded), :meth:`ready` says no and the registry
keeps the worker waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import replace

from ...bridge import Subjects
from ...bridge.durable import DurableEvents
from ...bridge.events import NatsEventRelay
from ...engine import Engine
from ...plane.registry import offset_endpoint
from ..core.config import ServiceConfig
from ..core.partition import Instance
from ..core.requests import Registration

__all__ = ["EngineFollower"]


class EngineFollower:
    """The registry's follower on front 0; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        config: ServiceConfig,
        *,
        relay: NatsEventRelay | None = None,
        durable: DurableEvents | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.up = False
        """The engine is running (set by the service once its appliers are up)."""
        self.relay = relay
        """The kv-events relay: made at once in durable mode, else at the first NATS worker."""
        self.durable = durable
        self.relay_task: asyncio.Task[None] | None = None

    def ready(self, registration: Registration) -> bool:
        if not self.up:
            return False
        return registration.transport != "nats" or self.durable is None or self.durable.loaded

    def follow(self, instance: Instance, registrations: Sequence[Registration], block_size: int) -> Instance:
        nats = [reg for reg in registrations if reg.transport == "nats"]
        if nats:
            relay = self._relay()
            ranks, queries = dict(instance.ranks), dict(instance.rank_queries)
            for reg in nats:
                if self.durable is not None:
                    own = None if reg.query_endpoint is None else offset_endpoint(reg.query_endpoint, reg.dp_rank)
                    queries[reg.dp_rank] = relay.add_query(reg.instance_id, reg.dp_rank, fallback=own)
                ranks[reg.dp_rank] = relay.add(reg.instance_id, reg.dp_rank)
            instance = replace(instance, ranks=ranks, rank_queries=queries)
        self.engine.add_worker(instance.spec(block_size))
        return instance

    def unfollow(self, instance_id: int, ranks: Sequence[int], rest: Instance | None, block_size: int) -> None:
        if self.relay is not None:
            self.relay.remove(instance_id, list(ranks))
        self.engine.remove_worker(instance_id)
        if rest is not None:
            self.engine.add_worker(rest.spec(block_size))

    def _relay(self) -> NatsEventRelay:
        """The kv-events relay, made and started (on this loop) at its first use."""
        if self.relay is None:
            subject = Subjects(self.config.namespace, self.config.component).kv_events
            self.relay = NatsEventRelay(self.config.nats_url, subject)
        if self.relay_task is None and self.durable is None:  # durable mode runs the relay itself
            self.relay_task = asyncio.get_running_loop().create_task(self.relay.run(), name="kvrouter-kv-events")
        return self.relay

    async def close(self) -> None:
        """Stop the relay's task (the relay's own close is the service's)."""
        task, self.relay_task = self.relay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
