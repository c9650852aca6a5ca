"""A service is ready only with what its start left frozen out of the garbage collector's reach.

A file of its own: the service here is this process's one engine, and ``--dist loadfile`` runs a file's
tests together, so no other module's service is alive beside it.
"""

from __future__ import annotations

import gc

from kvrouter.service.core.config import ServiceConfig
from kvrouter.service.process.app import Service
from tests.service.conftest import own_segments, serve, stop_served


def test_a_service_is_ready_with_what_its_start_left_frozen():
    """A full collection walking numba's and aiohttp's objects held every request for 55-80 ms (``app.py``):
    by the time the service says it is ready, they are out of the collector's reach."""
    gc.unfreeze()  # what an earlier test's service froze in this process
    assert gc.get_freeze_count() == 0
    service = Service(ServiceConfig(port=0, shards=1, drain_secs=0.5))
    service.start()  # forks the applier: before the service thread
    thread = None
    try:
        thread, _ = serve(service)
        assert gc.get_freeze_count() > 10_000
    finally:
        stop_served(service, thread)
    assert own_segments() == []
