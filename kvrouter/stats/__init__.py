"""How a running ``kvrouter up`` is found and read without a request to it: ``kvrouter top``'s way in.

``discovery.py``: the file each service writes in the runtime directory (its URL, its segments);
``segment.py``: the stats segment's layout, its writer (the service's) and its reader (any process).
Nothing here knows the service: the service writes through these, the dashboard reads through them.
"""

from __future__ import annotations

from .discovery import Discovered, entries, pid_alive, runtime_dir
from .segment import StatsReader, StatsWriter

__all__ = ["Discovered", "StatsReader", "StatsWriter", "entries", "pid_alive", "runtime_dir"]
