"""NATS subject names of the replica sync: the reference's, under ``namespace.<ns>.component.<comp>``.

Dynamo's component publisher (``dynamo-runtime``, ``impl EventPublisher for Component``) names a
component's subjects ``namespace.{namespace}.component.{component}.{event}``, and the KV router's replica
sync publishes on the event ``active_sequences_events`` (``ACTIVE_SEQUENCES_SUBJECT`` in the reference's
``kv_router.rs``). kvrouter uses the same names so that a kvrouter replica and a tool watching the
reference's subject see the same traffic. The late-join snapshot has no counterpart in the reference
(a reference replica starts from zero), so its subjects are kvrouter's own, under the same prefix and
named so that nobody mistakes them for the reference's.

Names are checked once: a token holding ``.``, ``*``, ``>`` or whitespace would change what a subject
matches, so it is refused rather than escaped.
"""

from __future__ import annotations

import re
from typing import Final

from ..errors import ConfigError

__all__ = [
    "ACTIVE_SEQUENCES_EVENT",
    "SNAPSHOT_EVENT",
    "Subjects",
]

ACTIVE_SEQUENCES_EVENT: Final = "active_sequences_events"
"""The reference's replica-sync event name (``ACTIVE_SEQUENCES_SUBJECT``)."""
SNAPSHOT_EVENT: Final = "kvrouter_active_sequences_snapshot"
"""kvrouter's late-join snapshot: ``<prefix>.<this>`` finds a peer, ``<prefix>.<this>.<router_id>`` asks it."""
KV_EVENTS_EVENT: Final = "kv-events"
"""The reference's ``KV_EVENT_SUBJECT`` (``lib/kv-router/src/protocols.rs``): workers' ``RouterEvent``s."""
PRESENCE_EVENT: Final = "kvrouter_router_presence"
"""kvrouter's own: every replica says every few seconds that it is there, and when it said so."""
DEFAULT_NAMESPACE: Final = "dynamo"
DEFAULT_COMPONENT: Final = "backend"

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")


class Subjects:
    """The subjects of one (namespace, component).

    Raises:
        ConfigError: a name that is empty or holds anything but letters, digits, ``_`` and ``-``.
    """

    def __init__(self, namespace: str = DEFAULT_NAMESPACE, component: str = DEFAULT_COMPONENT) -> None:
        for field, value in (("namespace", namespace), ("component", component)):
            if not _TOKEN.match(value):
                raise ConfigError(f"{field} must be letters, digits, '_' or '-' (a NATS subject token), got {value!r}")
        self.namespace = namespace
        self.component = component
        self.prefix = f"namespace.{namespace}.component.{component}"
        self.active_sequences = f"{self.prefix}.{ACTIVE_SEQUENCES_EVENT}"
        """Every replica publishes its AddRequest / MarkPrefillCompleted / Free here and subscribes to it."""
        self.snapshot = f"{self.prefix}.{SNAPSHOT_EVENT}"
        """A joining replica's request here is answered by every peer with its router id (first wins)."""
        self.presence = f"{self.prefix}.{PRESENCE_EVENT}"
        """Every replica's ``{"router_id", "sent_at"}`` each ``PRESENCE_INTERVAL_S``: who is there, and the lag."""
        self.kv_events = f"{self.prefix}.{KV_EVENTS_EVENT}"
        """Workers publishing KV events on NATS publish here; the service's relay follows it (``events.py``)."""

    def snapshot_of(self, router_id: int) -> str:
        """Where the peer ``router_id`` answers a snapshot request, in parts, to the request's reply subject."""
        return f"{self.snapshot}.{router_id}"
