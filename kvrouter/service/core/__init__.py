"""The router service's core: its state and decisions, with no socket and no HTTP (``state.py`` joins them).

``registry.py`` workers and partitions, ``reservations.py`` bookings, ``decider.py`` decisions and queries,
``decision.py`` the decision record and its sinks, ``queue.py`` the router queue, ``journal.py`` the rings,
``facts.py`` the index summary, ``lifecycle.py`` the phase, ``requests.py`` request bodies into typed
requests; per-worker views in ``trust.py``, ``accuracy.py``, ``affinity.py``, ``shadow.py``; counters in
``counters.py`` and ``histogram.py``; ``decisions.py`` the explain-by-id ring and the decision log;
``recording.py`` ``--record``'s front side; ``config.py`` the one :class:`ServiceConfig`.
"""

from __future__ import annotations

from .config import ServiceConfig
from .decision import Decision
from .state import Core

__all__ = ["Core", "Decision", "ServiceConfig"]
