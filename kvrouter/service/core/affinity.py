"""Session affinity: a session's requests go to the worker its first request went to.

The reference's ``--router-session-affinity-ttl-secs`` with the ``X-Dynamo-Session-ID`` header (the
proxy) or ``session_id`` (``/select`` bodies): a multi-turn conversation whose next turn lands on the
worker that holds its earlier turns reuses that worker's cache even when another worker's momentary load
would have won the decision. The binding lives ``ttl`` seconds since the session's last request and
holds only while its worker is schedulable (a candidate of the partition: registered, healthy); a
worker that is merely busy keeps its sessions, which then get the overload answer (or wait in the
queue) like any request whose only candidate is busy — moving a session off a busy worker would throw
its cache away, which is the opposite of what affinity is for.

Implemented as a candidate restriction in front of the decision, not a bypass of it: the decision still
runs (on one candidate), so the reservation, the load bookkeeping, the busy check, the decisions ring
and the counters stay exactly those of any other request. The restricted candidate tuple is cached per
worker so ``Router.select`` sees the same tuple object again (its slot lookup is cached per tuple).

Bindings are an insertion-ordered dict refreshed by moving the key to the end, so expiry pops from the
front until the first live entry: O(1) amortised per request, no timer and no sweep task. A session id
is kept per partition (the same id under two models is two sessions).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from ...errors import ConfigError
from ...events.model import WorkerKey

__all__ = ["SESSION_HEADER", "Affinity"]

SESSION_HEADER: Final = "X-Dynamo-Session-ID"

_Key = tuple[str, str]
"""(partition name, session id)."""


class Affinity:
    """Session -> worker bindings with an idle TTL. ``ttl=None`` turns affinity off (every call is a no-op).

    Not thread-safe: the service's event loop is its one user.
    """

    def __init__(self, ttl: float | None, *, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl is not None and not ttl > 0:
            raise ConfigError(f"session affinity ttl must be > 0 seconds, got {ttl}")
        self.ttl = ttl
        self._clock = clock
        self._bound: dict[_Key, tuple[WorkerKey, float]] = {}
        """(partition, session) -> (worker, last use), oldest use first."""
        self._singles: dict[WorkerKey, tuple[WorkerKey]] = {}

    def __len__(self) -> int:
        return len(self._bound)

    def worker(self, partition: str, session_id: str) -> WorkerKey | None:
        """The worker ``session_id`` is bound to in ``partition``, if the binding is alive."""
        if self.ttl is None:
            return None
        self._expire()
        entry = self._bound.get((partition, session_id))
        return None if entry is None else entry[0]

    def candidates(
        self, partition: str, session_id: str | None, candidates: tuple[WorkerKey, ...]
    ) -> tuple[WorkerKey, ...]:
        """The candidates a request of ``session_id`` may go to: its bound worker alone while that worker
        is among ``candidates``, else all of them."""
        if self.ttl is None or session_id is None:
            return candidates
        worker = self.worker(partition, session_id)
        if worker is None or worker not in candidates:
            return candidates
        single = self._singles.get(worker)
        if single is None:
            single = self._singles[worker] = (worker,)
        return single

    def bind(self, partition: str, session_id: str | None, worker: WorkerKey) -> None:
        """``session_id``'s request went to ``worker``: (re)bind it and restart its TTL."""
        if self.ttl is None or session_id is None:
            return
        key = (partition, session_id)
        self._bound.pop(key, None)
        self._bound[key] = (worker, self._clock())

    def _expire(self) -> None:
        assert self.ttl is not None
        horizon = self._clock() - self.ttl
        bound = self._bound
        while bound:
            key = next(iter(bound))
            if bound[key][1] > horizon:
                return
            del bound[key]
