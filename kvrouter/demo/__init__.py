"""``kvrouter up``'s embedded demo: mock engines, a gentle client and a status line, with no GPU and no
external service (``fleet.py``); the mock engines' processes (``mocks.py``, also ``kvrouter replay``'s) and
the synthetic chat workload (``workload.py``). The demo is a client of the service: it reaches it over HTTP
only, as an operator's engines and gateway would.
"""

from __future__ import annotations

from .fleet import Embedded, EmbeddedConfig, EmbeddedError
from .mocks import MockError, MockProcess, start_mock, stop_mocks
from .workload import Workload

__all__ = [
    "Embedded",
    "EmbeddedConfig",
    "EmbeddedError",
    "MockError",
    "MockProcess",
    "Workload",
    "start_mock",
    "stop_mocks",
]
