"""``Lifecycle``: where the service is in its life, and what each phase refuses.

A service is built (``new``), listens and brings its index up (``starting``: the appliers fork, a first
run compiles its kernels for about a minute), serves, stops (``stopping``: the requests in flight drain),
and is ``stopped``; or its index never comes up (``failed``). One object says which, so every edge refuses
alike and says the same sentence: while the index starts, the routes that need it raise :class:`Starting`
(503 with ``Retry-After``) and everything else answers with what it knows; while the service stops, every
route but ``/health``, ``/ready`` and ``/metrics`` raises :class:`Stopping`.

``new`` refuses nothing: a service that was built but never run (tests serving its routes in process, a
caller driving its core directly) is its caller's to manage. Only the process layer moves the phase.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final, Literal

from ...errors import Starting, Stopping, Unavailable

__all__ = ["RETRY_AFTER_S", "Lifecycle", "Phase"]

Phase = Literal["new", "starting", "serving", "stopping", "stopped", "failed"]
RETRY_AFTER_S: Final = 2
"""``Retry-After`` of a route refused while the index starts: a warm start takes about 2 s."""


class Lifecycle:
    """The service's phase; moved by the process layer, read by the core and the edges."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.phase: Phase = "new"
        self._since = clock()
        self.failure: str | None = None
        """Why the index did not come up (``failed``)."""
        self.inflight = 0
        """Requests the edges are answering now: a stop waits for them (at most ``drain_secs``)."""

    def move(self, phase: Phase, failure: str | None = None) -> None:
        self.phase = phase
        self._since = self._clock()
        if failure is not None:
            self.failure = failure

    @property
    def index_up(self) -> bool:
        """The routes that need the index may run (``new`` included: its caller manages it)."""
        return self.phase in ("new", "serving")

    @property
    def stopping(self) -> bool:
        return self.phase in ("stopping", "stopped")

    def seconds(self) -> float:
        """Time spent in the current phase."""
        return self._clock() - self._since

    def require_index(self) -> None:
        """Raise unless the routes that need the index may run now.

        Raises:
            Starting: the index is starting (the client retries after ``RETRY_AFTER_S``).
            Stopping: the service is stopping.
            Unavailable: the index failed to start.
        """
        phase = self.phase
        if phase in ("new", "serving"):
            return
        if phase == "starting":
            raise Starting(
                f"the index is starting ({self.seconds():.0f} s so far; a first run compiles its kernels for "
                "about a minute)",
                RETRY_AFTER_S,
            )
        if phase == "failed":
            raise Unavailable(f"the index did not start: {self.failure}")
        raise Stopping("the service is stopping")

    def require_open(self) -> None:
        """Raise :class:`Stopping` once the service stops (every route but the always-served ones)."""
        if self.phase in ("stopping", "stopped"):
            raise Stopping("the service is stopping")
