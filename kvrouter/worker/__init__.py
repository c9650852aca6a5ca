"""The simulated engine: a vLLM-style worker model after Dynamo's mocker (``spec/routing-benchmark.md`` §2).

``timing`` (the two polynomials) → ``kv_cache`` (active / inactive block pools, LRU, KV events) →
``scheduler`` (``WorkerModel``: chunked prefill, decode, preemption, one ``Iteration`` per step). The
model has no clock; the simulator (``sim/simulator.py``) or a real-time mock engine drives it.

``publisher`` (``KvPublisher``) is the other side of a real engine: what it embeds to publish its KV
events in kvrouter's format and answer the router's recovery queries.
"""

from __future__ import annotations

from .kv_cache import KvCache
from .publisher import KvPublisher
from .scheduler import GENERATED_ID_BASE, Iteration, WorkerConfig, WorkerModel, generated_block_id
from .timing import decode_ms, prefill_ms

__all__ = [
    "GENERATED_ID_BASE",
    "Iteration",
    "KvCache",
    "KvPublisher",
    "WorkerConfig",
    "WorkerModel",
    "decode_ms",
    "generated_block_id",
    "prefill_ms",
]
