"""``IndexFacts``: the index summary every answer carries, refreshed by the health loop, never per request.

``{"epoch", "events_applied", "last_event_age_ms", "recovering"}`` goes into every JSON object answer (the
``index`` member) and into the ``X-Kvrouter-Index-*`` headers (``docs/http-api.md``, "Index facts"). A
decision reads the cached dict and headers: reading the control segment per request would cost a few
microseconds per shard for figures a client only needs to within ``health_interval_secs``. The dict and the
headers are replaced, never mutated, so an edge may cache what it encoded from them while they are the
same objects.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from ...engine import ShardStats

__all__ = ["IndexFacts"]


class IndexFacts:
    """The last index summary and its headers (the service's event loop writes, the edges read)."""

    def __init__(self) -> None:
        self.summary: dict[str, Any] = {"epoch": 0, "events_applied": 0, "last_event_age_ms": None, "recovering": 0}
        self.headers: dict[str, str] = {}
        self.shard_status: dict[int, str] = {}
        """The status each shard had at the last refresh."""

    def refresh(self, stats: Iterable[ShardStats]) -> list[ShardStats]:
        """Summarise ``stats`` (``Engine.stats(workers=False)``); returns the shards whose status changed
        since the last refresh (not counting the first sight of a shard)."""
        shards = list(stats)
        changed = []
        for shard in shards:
            before = self.shard_status.get(shard.shard)
            if before != shard.status:
                if before is not None:
                    changed.append(shard)
                self.shard_status[shard.shard] = shard.status
        last = max((s.last_event_ns for s in shards), default=0)
        summary = {
            "epoch": sum(s.epoch for s in shards),
            "events_applied": sum(s.events_applied for s in shards),
            "last_event_age_ms": round((time.time_ns() - last) / 1e6, 1) if last else None,
            "recovering": sum(s.status == "recovering" for s in shards),
        }
        self.summary = summary
        self.headers = {
            "X-Kvrouter-Index-Epoch": str(summary["epoch"]),
            "X-Kvrouter-Index-Events": str(summary["events_applied"]),
            "X-Kvrouter-Index-Age-Ms": str(summary["last_event_age_ms"]),
        }
        return changed
