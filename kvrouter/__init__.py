"""kvrouter: a KV-cache-aware request router for LLM inference fleets.

Layout (one folder per component; ``docs/ARCHITECTURE.md`` draws the whole picture):

- ``hashing/``   tokens → local block hashes → router sequence hashes (bit-exact with Dynamo)
- ``events/``    the event model and one codec per wire format (``events/codecs/``)
- ``index/``     who holds which blocks: ``RadixIndex`` (the contract's oracle), ``ApproxIndex`` (TTL)
- ``routing/``   config, cost, selection, slot tracking, and the ``Router`` that ties them to an index
- ``worker/``    the simulated engine model, and ``KvPublisher`` for real engines to embed
- ``engine.py``  the shared-memory index engine: supervisor, applier processes, lock-free readers
- ``plane/``     the event plane: workers' ZMQ streams into the appliers, gaps recovered or counted
- ``client/``    the one client of the service's HTTP API: ``Client`` (asyncio), ``SyncClient``
- ``errors.py``  the one exception hierarchy
- ``cli/``       the ``kvrouter`` command

This module only re-exports the public names; it holds no logic.
"""

from __future__ import annotations

from .client import Client as Client, SyncClient as SyncClient
from .engine import (
    Engine as Engine,
    ReaderHandle as ReaderHandle,
    ShardStats as ShardStats,
    WorkerStats as WorkerStats,
)
from .errors import (
    ApiError as ApiError,
    BadEvent as BadEvent,
    BlockNotFound as BlockNotFound,
    ConfigError as ConfigError,
    DuplicateRequest as DuplicateRequest,
    EncodeError as EncodeError,
    EngineError as EngineError,
    EventError as EventError,
    FlushTimeout as FlushTimeout,
    InvalidBlockSequence as InvalidBlockSequence,
    InvalidHashInput as InvalidHashInput,
    KvRouterError as KvRouterError,
    NoWorkerAvailable as NoWorkerAvailable,
    ParentNotFound as ParentNotFound,
    RequestFailed as RequestFailed,
    ServiceUnreachable as ServiceUnreachable,
)
from .events.model import (
    Cleared as Cleared,
    EngineHash as EngineHash,
    EventBatch as EventBatch,
    KvEvent as KvEvent,
    LocalHash as LocalHash,
    Removed as Removed,
    SeqHash as SeqHash,
    StorageTier as StorageTier,
    Stored as Stored,
    StoredBlock as StoredBlock,
    WorkerKey as WorkerKey,
    parse_tier as parse_tier,
)
from .hashing import (
    block_hashes as block_hashes,
    sequence_hashes as sequence_hashes,
)
from .index import ApproxIndex as ApproxIndex, RadixIndex as RadixIndex
from .plane import PlaneConfig as PlaneConfig, WorkerSpec as WorkerSpec
from .routing import (
    Router as Router,
    RouterConfig as RouterConfig,
    Selection as Selection,
    SlotManager as SlotManager,
    WorkerExplanation as WorkerExplanation,
)
from .worker import KvPublisher as KvPublisher

__version__ = "0.1.0"

__all__ = [
    "ApiError",
    "ApproxIndex",
    "BadEvent",
    "BlockNotFound",
    "Cleared",
    "Client",
    "ConfigError",
    "DuplicateRequest",
    "EncodeError",
    "Engine",
    "EngineError",
    "EngineHash",
    "EventBatch",
    "EventError",
    "FlushTimeout",
    "InvalidBlockSequence",
    "InvalidHashInput",
    "KvEvent",
    "KvPublisher",
    "KvRouterError",
    "LocalHash",
    "NoWorkerAvailable",
    "ParentNotFound",
    "PlaneConfig",
    "RadixIndex",
    "ReaderHandle",
    "Removed",
    "RequestFailed",
    "Router",
    "RouterConfig",
    "Selection",
    "SeqHash",
    "ServiceUnreachable",
    "ShardStats",
    "SlotManager",
    "StorageTier",
    "Stored",
    "StoredBlock",
    "SyncClient",
    "WorkerExplanation",
    "WorkerKey",
    "WorkerSpec",
    "WorkerStats",
    "block_hashes",
    "parse_tier",
    "sequence_hashes",
]


def _present_public_path() -> None:
    """Show exported classes and functions as ``kvrouter.X`` in reprs, tracebacks and pickles."""
    for name in __all__:
        obj = globals()[name]
        if getattr(obj, "__module__", "").startswith("kvrouter.") and hasattr(obj, "__qualname__"):
            obj.__module__ = "kvrouter"


_present_public_path()
