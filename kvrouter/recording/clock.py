"""``HeldClock``: the routers' clock while a router records, so a replay reads exactly the same times.

A decision's cost depends on the time (the slot manager's recent-prefill work decays with it, its sweep
and expiry compare against it), so a replay in logical time must hand the router the very values it read
live. While recording, the service holds the clock at one ``time.monotonic_ns()`` for the whole of each
operation it records (a decision, a prefill completion, a free, a registration) and writes that value in
the record; the replay holds the same value. Outside an operation the clock reads ``time.monotonic()`` as
usual. Rejected: logging every read of the clock (several per decision, and their order would tie the
format to the slot manager's internals).
"""

from __future__ import annotations

import time

__all__ = ["HeldClock"]


class HeldClock:
    """Seconds, monotonic; :attr:`held` (when not None) is returned instead of the time."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: float | None = None

    def __call__(self) -> float:
        held = self.held
        return time.monotonic() if held is None else held

    def hold(self) -> int:
        """Hold the clock at now; returns now in nanoseconds (the record's ``t``; ``held`` is ``t / 1e9``)."""
        now = time.monotonic_ns()
        self.held = now / 1e9
        return now

    def release(self) -> None:
        self.held = None
