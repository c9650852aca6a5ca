"""The one in-memory shape of a KV-cache event, whatever wire it came from.

Every codec decodes into these classes and encodes from them; the index, the appliers and the
publisher only ever see them. The three hash kinds are distinct ``NewType``s so a local hash cannot
be passed where an engine hash is expected (the vocabulary of ``docs/ARCHITECTURE.md``):

- ``LocalHash``: XXH3 of one block's tokens, not chained (wire name ``tokens_hash``);
- ``SeqHash``: the router's chained hash of the prefix up to a block;
- ``EngineHash``: the engine's opaque block id (wire name ``block_hash``), only ever mapped.

Events are frozen dataclasses with slots: cheap to build, hashable, safe to share between threads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final, NewType, TypeAlias

from ..errors import BadEvent

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

LocalHash = NewType("LocalHash", int)
SeqHash = NewType("SeqHash", int)
EngineHash = NewType("EngineHash", int)
WorkerKey: TypeAlias = tuple[int, int]
"""One schedulable unit: ``(worker_id, dp_rank)``."""

U64_MAX: Final = (1 << 64) - 1


class StorageTier(enum.Enum):
    """Where a worker holds a block, fastest first; the order is the cost function's tier order."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    SHARED = "shared"

    @property
    def rank(self) -> int:
        """0 for device … 3 for shared: a tier at rank r also counts for every slower tier's overlap."""
        return _TIER_RANK[self]


_TIER_RANK: Final = {tier: rank for rank, tier in enumerate(StorageTier)}
TIERS_IN_ORDER: Final = tuple(StorageTier)
"""Every tier, fastest first, for the per-query paths: iterating the enum itself costs about a microsecond."""

TIER_NAMES: Final[dict[str, StorageTier]] = {
    # vLLM `medium` (0.10.2+)
    "GPU": StorageTier.DEVICE,
    "CPU": StorageTier.HOST,
    "STORAGE": StorageTier.DISK,
    # SGLang `medium`
    "CPU_PINNED": StorageTier.HOST,
    "DISK": StorageTier.DISK,
    "EXTERNAL": StorageTier.SHARED,
    # Dynamo's RouterEvent `storage_tier`
    "device": StorageTier.DEVICE,
    "host_pinned": StorageTier.HOST,
    "disk": StorageTier.DISK,
    "external": StorageTier.SHARED,
    # Dynamo's indexer HTTP overlap fields
    "gpu": StorageTier.DEVICE,
    "cpu": StorageTier.HOST,
    # kvrouter's own names
    "host": StorageTier.HOST,
    "shared": StorageTier.SHARED,
}
"""Every engine's tier spelling → kvrouter's tier: the one place the mapping lives
(``spec/wire-formats.md`` §1.2, §2.1; ``spec/dynamo-semantics.md`` §2.2; ``spec/interfaces.md`` §1.1)."""


def parse_tier(name: str | None) -> StorageTier:
    """Map an engine's medium / tier name to a :class:`StorageTier`; ``None`` means device.

    Raises:
        BadEvent: the name is not one any supported engine uses.
    """
    if name is None:
        return StorageTier.DEVICE
    tier = TIER_NAMES.get(name)
    if tier is None:
        raise BadEvent(f"unknown storage tier {name!r}; expected one of {sorted(TIER_NAMES)}")
    return tier


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One cached block: the engine's id for it, its content hash, and optionally its tokens."""

    engine_hash: EngineHash
    local_hash: LocalHash
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks cached by a worker, in prefix order, under ``parent`` (``None`` = at the root)."""

    worker_id: int
    parent: EngineHash | None
    blocks: tuple[StoredBlock, ...]
    dp_rank: int = 0
    event_id: int = 0
    tier: StorageTier = StorageTier.DEVICE
    lora_name: str | None = None
    """The LoRA adapter the blocks were computed with, as engines send it: their local hashes include it
    already; only the engine encoders, which send tokens rather than local hashes, need it."""
    lora_id: int | None = None
    """vLLM's number for that adapter (``LoRARequest.lora_int_id``), which vLLM sends beside the name; the
    router never reads it (vLLM deprecates it), only the vLLM encoder writes it."""
    cache_salt: str | None = None
    """The request's cache salt (vLLM's and SGLang's ``cache_salt``), in the local hashes already; for the
    engine encoders, like ``lora_name``."""


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks a worker evicted, named only by engine hash (engines send nothing else)."""

    worker_id: int
    engine_hashes: tuple[EngineHash, ...]
    dp_rank: int = 0
    event_id: int = 0
    tier: StorageTier = StorageTier.DEVICE


@dataclass(frozen=True, slots=True)
class Cleared:
    """Everything this (worker, dp_rank) held is gone (engine prefix-cache reset)."""

    worker_id: int
    dp_rank: int = 0
    event_id: int = 0
    tier: StorageTier = StorageTier.DEVICE


KvEvent: TypeAlias = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """What one wire message carries: events in order, the publisher's timestamp, its dp rank."""

    events: tuple[KvEvent, ...]
    timestamp: float | None = None
    dp_rank: int = 0
