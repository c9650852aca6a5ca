"""``Core``: the router service without its transports: one typed part per concern, joined in one context.

Each part has one job and its own module: the registry of workers and partitions (``registry.py``), the
bookings (``reservations.py``), the decisions (``decider.py``, ``decision.py`` and its sinks), the router
queue (``queue.py``), the two rings (``journal.py``), the index summary (``facts.py``), the phase
(``lifecycle.py``), and the per-worker views (trust, accuracy, affinity, shadows, counters). ``Core``
builds them from a :class:`ServiceConfig` and an index, and wires what each tells another (a registration
retries the queue, a booking goes to the replica sync) once, here. Nothing in ``core/`` opens a socket or
knows HTTP: the edges (``service/edges/``) translate requests into calls on these parts and refusals into
statuses, and the process layer (``service/process/``) starts, runs and stops them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .accuracy import Accuracy
from .affinity import Affinity
from .config import ServiceConfig
from .counters import ServiceCounters
from .decider import Decider, ReadIndex
from .decision import sinks
from .decisions import DecisionLog, DecisionRecords
from .facts import IndexFacts
from .journal import Journal
from .lifecycle import Lifecycle
from .matches import Matches
from .predictions import Predictions
from .queue import RouterQueue
from .registry import Peers, Registry
from .reservations import ReplicaHost, Reservations
from .shadow import Shadows
from .trust import Trust

if TYPE_CHECKING:
    from .recording import ServiceRecording

__all__ = ["Core"]


class Core:
    """Every part of the router service's state, built and wired from one config; see the module docstring.

    ``index`` is what decisions read: front 0's engine or another front's view of it. Used on the
    service's event loop only.
    """

    def __init__(self, config: ServiceConfig, index: ReadIndex, *, recording: ServiceRecording | None = None) -> None:
        self.config = config
        self.recording = recording
        self.lifecycle = Lifecycle()
        self.counters = ServiceCounters()
        self.journal = Journal(events=config.events_ring, decisions=config.decisions_ring)
        self.facts = IndexFacts()
        self.accuracy = Accuracy(self.counters, lambda kind, fields: self.journal.event(kind, **fields))
        """Predicted against engine-reported reuse, per worker (``accuracy.py``)."""
        self.trust = Trust(self.counters, lambda kind, fields: self.journal.event(kind, **fields))
        """Each worker's trust state and the misconfigurations found, updated by the health loop."""
        self.affinity = Affinity(config.session_affinity_ttl_secs)
        self.shadows = Shadows(config.shadow_policies, self.counters) if config.shadow_policies else None
        """``--shadow-policy``: other policies' choices on every decision, compared, never used."""
        self.records = DecisionRecords()
        """Every decision with an id, kept to explain by id (``GET /decisions/{selection_id}``)."""
        self.decision_log = None if config.decision_log is None else DecisionLog(config.decision_log)
        """``--decision-log FILE``: a line per decision."""
        self.matches = Matches()
        self.registry = Registry(config, self.journal, self.trust, self.accuracy, recording=recording)
        self.predictions = Predictions(self.counters, index)
        """The predicted tier's bets on own reservations and how they ended (``predictions.py``)."""
        self.registry.dropped = self.predictions.dropped
        self.reservations = Reservations(self.registry, self.accuracy, self.predictions, recording=recording)
        self.reservations.stopping = lambda: self.lifecycle.stopping
        self.decider = Decider(
            index,
            self.registry,
            self.reservations,
            self.lifecycle,
            self.counters,
            self.affinity,
            sinks(
                counters=self.counters,
                affinity=self.affinity,
                matches=self.matches,
                journal=self.journal,
                records=self.records,
                log=self.decision_log,
                shadows=self.shadows,
            ),
            self.journal.next_decision,
            shadows=self.shadows,
            recording=recording,
            keep_records=self.decision_log is not None,
            disagg=config.disagg,
        )
        self.queue = RouterQueue(
            self.decider,
            self.counters,
            threshold=config.queue_threshold,
            policy=config.queue_policy,
            timeout_secs=config.queue_timeout_secs,
            age_secs=config.queue_priority_age_secs,
        )
        self.registry.changed = self.queue.changed
        self.reservations.changed = self.queue.changed
        self.replica_host = ReplicaHost(self.registry, self.reservations)
        """What the replica sync calls back (``bridge/sync.py``'s ``SyncHost``)."""

    def connect_peers(self, peers: Peers) -> None:
        """The replica sync (over NATS, or the fronts' local bus) hears of every booking from now on."""
        self.registry.peers = peers
