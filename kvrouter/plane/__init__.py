"""The event plane: engines' KV events over ZMQ into the appliers, in order, with gaps recovered or counted.

``registry`` (what a worker is: endpoints, format, dp ranks) → ``stream`` (one (worker, dp_rank): cursor,
gap detection, recovery, trust state) over ``recovery`` (replay and local-indexer clients) → ``ingest``
(the streams of one applier) and ``wakes`` (which of its sockets to read next). ``docs/ARCHITECTURE.md``
draws the flow.
"""

from __future__ import annotations

from .config import PlaneConfig
from .registry import FORMATS, WorkerSpec, offset_endpoint, parse_workers

__all__ = ["FORMATS", "PlaneConfig", "WorkerSpec", "offset_endpoint", "parse_workers"]
