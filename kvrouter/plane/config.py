"""``PlaneConfig``: the event plane's bounds and timers, each with the reason for its default.

The subscriber bounds are ``kvrouter up`` options, declared in their fields' ``metadata`` (``kvrouter/options.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from ..errors import ConfigError
from ..options import Panel, option

__all__ = ["PlaneConfig"]

SUBSCRIBER_HWM: Final = 1 << 20
"""Messages a SUB socket queues before libzmq drops (its default is 1000). An applier that stalls on a
table growth (tens of ms at 1 M blocks, ``spec/shm-engine.md`` §4.3) while a fleet publishes 100 k
batches/s needs a few thousand; a million leaves room for far longer stalls, and costs memory only while
used. Past it, drops are still silent on the wire but show up as a gap, which is recovered or counted."""


@dataclass(frozen=True, slots=True)
class PlaneConfig:
    """How the appliers follow workers. Validated on construction.

    Raises:
        ConfigError: a bound below 1 or a timer not above 0.
    """

    recovery_timeout: float = 5.0
    """Seconds a replay socket or local indexer may stay silent during a recovery before the missing range
    is counted lost. Dynamo's bootstrap gives a replay 5 s of inactivity (``spec/wire-formats.md`` §3)."""
    restore_retry: float = 5.0
    """Seconds before a kvrouter worker whose restore failed is asked for a full dump again."""
    stale_after: float = 60.0
    """Seconds of silence after which a worker is reported stale. Engines publish only when a step changes
    the cache, so an idle worker is quiet; a minute tells an operator something is off without crying
    wolf over a quiet night. Stale is a report: the worker's blocks stay routable."""
    max_buffered: int = 100_000
    """Live messages a stream buffers while it recovers; past it the recovery is abandoned as lost."""
    max_message_bytes: int = 64 << 20
    """A message larger than this is refused (counted as a bad frame) instead of decoded."""
    subscriber_hwm: int = field(
        default=SUBSCRIBER_HWM,
        metadata=option(
            "--subscriber-hwm",
            help="[messages] Events a worker's SUB queues unread before the worker's publisher must hold or drop "
            "them (a drop shows as a gap, recovered by replay or counted lost).",
            panel=Panel.EVENTS,
            min=1,
        ),
    )
    record_endpoint: str | None = None
    """The recorder's PULL address (``kvrouter up --record``): every applier copies what it applies there
    (``tap.py``). None: nothing is recorded."""
    subscriber_rcvbuf: int = field(
        default=0,
        metadata=option(
            "--subscriber-rcvbuf",
            help="[bytes] Kernel receive buffer of each SUB connection (SO_RCVBUF); 0 = the OS's default.",
            panel=Panel.EVENTS,
            min=0,
        ),
    )
    """Kernel receive buffer of each SUB connection in bytes (``SO_RCVBUF``); 0 keeps the OS's autotuned
    default. With ``subscriber_hwm`` it bounds what a stalled applier holds unread before the publisher's
    own queue fills and drops (the ``slow-consumer`` drill sets both small)."""

    def __post_init__(self) -> None:
        for name in ("recovery_timeout", "restore_retry", "stale_after"):
            if not getattr(self, name) > 0:
                raise ConfigError(
                    f"PlaneConfig.{name}: expected a positive number of seconds, got {getattr(self, name)}"
                )
        for name in ("max_buffered", "max_message_bytes", "subscriber_hwm"):
            if getattr(self, name) < 1:
                raise ConfigError(f"PlaneConfig.{name}: expected at least 1, got {getattr(self, name)}")
        if self.subscriber_rcvbuf < 0:
            raise ConfigError(f"PlaneConfig.subscriber_rcvbuf: expected bytes >= 0, got {self.subscriber_rcvbuf}")
