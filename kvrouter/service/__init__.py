"""The router service behind ``kvrouter up``: partitions, the HTTP API (``docs/http-api.md``), lifecycle.

``Service`` (``app.py``) owns one shared-memory engine and one asyncio loop, its workers and its decisions;
``routes.py`` serves it over HTTP, ``health.py`` keeps its view of the index and workers fresh;
``Partition`` (``partition.py``) holds one (model, routing group); ``validation.py`` turns bodies into
typed requests.
"""

from __future__ import annotations

from ..errors import ServiceError
from .app import SelectResult, Service
from .core.config import ServiceConfig
from .counters import PHASES, ServiceCounters
from .partition import Instance, Partition
from .validation import QueryRequest, Registration, SelectRequest, Unregistration

__all__ = [
    "PHASES",
    "Instance",
    "Partition",
    "QueryRequest",
    "Registration",
    "SelectRequest",
    "SelectResult",
    "Service",
    "ServiceConfig",
    "ServiceCounters",
    "ServiceError",
    "Unregistration",
]
