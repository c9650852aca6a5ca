"""``kvrouter replay``: a workload driven through a live stack while one fault per drill is injected.

Layout, one job per module:

- ``workload.py``: a Mooncake trace as scaled token prompts; the driver (streamed ``/v1/completions``).
- ``stack.py``: ``kvrouter up`` and mock-engine processes (``LocalStack``) or a running router (``AttachedStack``).
- ``replicas.py``: two ``kvrouter up --router-replica-sync`` and the engines on NATS (``ReplicaStack``), for the
  NATS drills; ``natsd.py``: the run's own ``nats-server``.
- ``truth.py``: the probes (wrong answers against the engines' own caches) and the end equality check.
- ``drills.py``: each fault, how it is injected, how its being seen is told, what its stack needs.
- ``run.py``: one measured run (reset, load, fault, convergence, counters).
- ``session.py``: one invocation (stack, baseline, drills, progress).
- ``report.py``: the table, the JSON, the exit status; ``plot.py``: ``--plot``.
- ``logical.py``: ``--from FILE``, a recording (``kvrouter/recording/``) replayed in logical time, in-process;
  ``live.py``: ``--from FILE --live``, the recording played to a running router.
"""

from __future__ import annotations

from .drills import DRILLS, NOT_BUILT, Drill
from .replicas import ReplicaStack
from .report import JSON_VERSION, exit_status, report_json
from .run import RunResult, run
from .session import Outcomes, ReplayOptions, replay
from .stack import AttachedStack, LocalStack, ReplayError, StackConfig

__all__ = [
    "DRILLS",
    "JSON_VERSION",
    "NOT_BUILT",
    "AttachedStack",
    "Drill",
    "LocalStack",
    "Outcomes",
    "ReplayError",
    "ReplayOptions",
    "ReplicaStack",
    "RunResult",
    "StackConfig",
    "exit_status",
    "replay",
    "report_json",
    "run",
]
