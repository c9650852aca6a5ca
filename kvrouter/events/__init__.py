"""The event model and its codecs."""

from __future__ import annotations

from .model import (
    Cleared,
    EngineHash,
    EventBatch,
    KvEvent,
    LocalHash,
    Removed,
    SeqHash,
    StorageTier,
    Stored,
    StoredBlock,
    WorkerKey,
    parse_tier,
)

__all__ = [
    "Cleared",
    "EngineHash",
    "EventBatch",
    "KvEvent",
    "LocalHash",
    "Removed",
    "SeqHash",
    "StorageTier",
    "Stored",
    "StoredBlock",
    "WorkerKey",
    "parse_tier",
]
