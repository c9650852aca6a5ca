"""Drains made from lists of messages, for the tests that hand a stream its messages without a socket."""

from __future__ import annotations

from kvrouter.plane import PlaneConfig
from kvrouter.plane.receive import Drain
from kvrouter.plane.stream import Stream


def drain_of(stream: Stream, messages: list[list[bytes]], config: PlaneConfig) -> Drain:
    """``messages`` as the applier's receive would hand them to ``stream`` (``receive.py``'s rules)."""
    return Drain.of(messages, stream.spec.topic, stream.buffers, config.max_message_bytes)
