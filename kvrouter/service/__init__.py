"""The router service behind ``kvrouter up``, in three layers that import one way (``docs/ARCHITECTURE.md``).

- ``core/``: the state and the decisions, with no socket and no HTTP: workers and partitions, bookings,
  decisions and their sinks, the router queue, the rings; typed refusals (``kvrouter/errors.py``).
- ``edges/``: what translates requests into core calls and refusals into statuses: the aiohttp routes,
  the hot lane, the ZMQ fast path, the ``/v1/completions`` proxy, ``/metrics``; the gate and the answers'
  JSON shapes they share.
- ``process/``: what a running process adds: :class:`Service` (the composition root: start, run,
  stop), the fronts of ``--fronts N``, the health loop, the stats publisher, the engine follower.
"""

from __future__ import annotations

from .core.config import ServiceConfig
from .core.counters import PHASES, ServiceCounters
from .core.decision import Decision
from .core.partition import Instance, Partition
from .core.requests import QueryRequest, Registration, SelectRequest, Unregistration
from .core.state import Core
from .process.app import Service

__all__ = [
    "PHASES",
    "Core",
    "Decision",
    "Instance",
    "Partition",
    "QueryRequest",
    "Registration",
    "SelectRequest",
    "Service",
    "ServiceConfig",
    "ServiceCounters",
    "Unregistration",
]
