"""Routing: configuration, the cost of each worker, selection, and the load of active requests.

``config`` (the knobs) → ``cost`` (per-worker terms) → ``selection`` (argmin or softmax), with ``slots``
holding active load apart, and ``router`` tying them to an index. ``reference`` keeps the first router and
slot manager as the oracle the fast ones are tested against; ``_kernels`` is the compiled cost-and-choose.
"""

from __future__ import annotations

from .config import RouterConfig
from .cost import Cost, Load, Overlap, worker_cost
from .reference import ReferenceRouter, ReferenceSlotManager
from .router import ArrayOverlapSource, OverlapSource, Router, Selection, WorkerExplanation
from .selection import choose, probabilities
from .slots import SlotManager

__all__ = [
    "ArrayOverlapSource",
    "Cost",
    "Load",
    "Overlap",
    "OverlapSource",
    "ReferenceRouter",
    "ReferenceSlotManager",
    "Router",
    "RouterConfig",
    "Selection",
    "SlotManager",
    "WorkerExplanation",
    "choose",
    "probabilities",
    "worker_cost",
]
