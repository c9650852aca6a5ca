"""Injected time for tests: a clock that moves only when a test says so (as trio's MockClock)."""

from __future__ import annotations


class FakeClock:
    """Seconds, starting at 0; set ``now`` to move it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
