"""Routing: configuration, the cost of each worker, selection, and the load of active requests.

``config`` (the knobs) → ``cost`` (per-worker terms) → ``selection`` (argmin or softmax), with ``slots``
holding active load apart, and ``router`` tying them to an index.
"""

from __future__ import annotations

from .config import RouterConfig
from .cost import Cost, Load, Overlap, worker_cost
from .router import OverlapSource, Router, Selection, WorkerExplanation
from .selection import choose, probabilities
from .slots import SlotManager

__all__ = [
    "Cost",
    "Load",
    "Overlap",
    "OverlapSource",
    "Router",
    "RouterConfig",
    "Selection",
    "SlotManager",
    "WorkerExplanation",
    "choose",
    "probabilities",
    "worker_cost",
]
