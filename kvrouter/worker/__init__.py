"""The simulated engine: a vLLM-style worker model after Dynamo's mocker (``spec/routing-benchmark.md`` §2).

``timing`` (the two polynomials) → ``kv_cache`` (active / inactive block pools, LRU, KV events) →
``scheduler`` (``WorkerModel``: chunked prefill, decode, preemption, one ``Iteration`` per step). The
model has no clock; the simulator (``sim/simulator.py``) or a real-time mock engine drives it.

``publisher`` (``KvPublisher``) is the other side of a real engine: what it embeds to publish its KV
events in kvrouter's format and answer the router's recovery queries, from a ``local_indexer``
(``LocalIndexer``, also the durable-mode relay's per-rank state). ``engine_publisher``
(``EnginePublisher``) speaks vLLM's / SGLang's publisher wire instead, for mocks and tests.

``mock_engine`` (``MockEngine``) is that real-time driver: the model stepped on a wall clock, one
thread per dp rank, publishing through either publisher; ``mock_http`` is its HTTP front and
``kvrouter mock-worker`` the command.
"""

from __future__ import annotations

from .engine_publisher import EnginePublisher
from .kv_cache import KvCache
from .local_indexer import LocalIndexer
from .mock_engine import MockEngine, MockEngineConfig
from .publisher import KvPublisher
from .scheduler import GENERATED_ID_BASE, Iteration, WorkerConfig, WorkerModel, generated_block_id
from .timing import decode_ms, prefill_ms

__all__ = [
    "GENERATED_ID_BASE",
    "EnginePublisher",
    "Iteration",
    "KvCache",
    "KvPublisher",
    "LocalIndexer",
    "MockEngine",
    "MockEngineConfig",
    "WorkerConfig",
    "WorkerModel",
    "decode_ms",
    "generated_block_id",
    "prefill_ms",
]
