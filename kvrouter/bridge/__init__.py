"""The NATS bridge: router replicas kept in sync over a NATS server (``docs/nats-bridge.md``).

Layout, one job per module:

- ``subjects.py``  the subjects, the reference's under ``namespace.<ns>.component.<comp>``
- ``codec.py``     the JSON messages (the reference's ``ActiveSequenceEvent``, kvrouter's snapshot parts),
                   strict decoding that names the bad field
- ``sync.py``      ``ReplicaSync``: publish own reservations' events, apply peers', late join, counters
- ``events.py``    KV events over NATS: ``NatsEventRelay`` (``kv-events`` → local PUBs the appliers follow;
                   in durable mode every rank's local indexer too), ``NatsEventSink`` (``KvPublisher``'s)
- ``durable.py``   JetStream durable mode: ``DurableEvents`` (stream, durable consumer, snapshots, reset)
- ``snapshot.py``  the snapshot object's codec (compact msgpack, chains of packed u64 hashes)
"""

from __future__ import annotations

from .codec import ActiveSequenceEvent as ActiveSequenceEvent, AddRequest as AddRequest
from .subjects import Subjects as Subjects
from .sync import ReplicaSync as ReplicaSync, SyncCounters as SyncCounters, SyncHost as SyncHost

__all__ = ["ActiveSequenceEvent", "AddRequest", "ReplicaSync", "Subjects", "SyncCounters", "SyncHost"]
