"""Routing quality: a deterministic trace-driven simulator and the routing policies of the field.

``trace`` (Mooncake JSONL → requests) → ``simulator.simulate`` (virtual time, ``kvrouter.worker``
engines, KV events into a ``RadixIndex``) under a ``policies`` policy → ``metrics.RunResult`` →
``report`` (table, JSON, plot); ``ceiling`` gives the pooled-LRU hit-rate ceiling to compare against.
"""

from __future__ import annotations

from .metrics import RunResult
from .policies import POLICIES, make_policy
from .policy import Cluster, Policy, Request
from .simulator import simulate
from .trace import Trace, load_sample, load_trace

__all__ = [
    "POLICIES",
    "Cluster",
    "Policy",
    "Request",
    "RunResult",
    "Trace",
    "load_sample",
    "load_trace",
    "make_policy",
    "simulate",
]
