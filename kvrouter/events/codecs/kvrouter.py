"""kvrouter's own msgpack batches: what ``KvPublisher`` and the mock engines send (``docs/wire-format.md``).

Unlike the engines' formats, a kvrouter batch carries the **local hashes** the publisher computed,
so a router never re-hashes tokens, and the worker id and event ids, so gap detection needs no
side channel. Hashes travel as packed little-endian u64 ``bin`` fields rather than msgpack integer
arrays: 8 bytes a hash instead of 9, and one ``numpy.frombuffer`` to read a whole event, which is
what lets an applier ingest millions of blocks a second (``spec/shm-engine.md`` §5). Events are
positional arrays tagged by one letter; readers ignore trailing elements they do not know, so a
field can be appended without a version bump.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

import msgpack
import numpy as np
import numpy.typing as npt

from ...errors import BadEvent, EncodeError
from ..model import (
    Cleared,
    EngineHash,
    EventBatch,
    KvEvent,
    LocalHash,
    Removed,
    StorageTier,
    Stored,
    StoredBlock,
    parse_tier,
)
from ._fields import describe, expect_float, expect_int, expect_list, expect_map, expect_u64, field

__all__ = ["FORMAT_VERSION", "Decoder", "Encoder", "RawBatch", "RawEvent"]

FORMAT_VERSION: Final = 1
"""The ``v`` of a batch; a decoder rejects versions it does not know."""

_U64: Final = np.dtype("<u8")
_U32: Final = np.dtype("<u4")
_NO_HASHES: Final = np.empty(0, dtype=np.uint64)
_STORED: Final = "S"
_REMOVED: Final = "R"
_CLEARED: Final = "C"


def _pack_u64(values: Any) -> bytes:
    return np.asarray(values, dtype=_U64).tobytes()


def _unpack(blob: object, dtype: np.dtype[Any], where: str) -> Any:
    """A packed ``bin`` field as a read-only array over the message's own bytes (no copy)."""
    if not isinstance(blob, bytes):
        raise BadEvent(f"{where}: expected packed bytes, got {describe(blob)}")
    if len(blob) % dtype.itemsize:
        raise BadEvent(f"{where}: {len(blob)} bytes is not a whole number of {dtype.itemsize}-byte values")
    return np.frombuffer(blob, dtype=dtype)


class Encoder:
    """Encodes batches; blocks carry their token ids only when ``with_tokens`` and every block has them."""

    def __init__(self, *, with_tokens: bool = False) -> None:
        self.with_tokens = with_tokens

    def encode(self, batch: EventBatch) -> bytes:
        """Encode one batch.

        Raises:
            EncodeError: the events belong to several workers, or to a dp rank other than the batch's.
        """
        worker_ids = {e.worker_id for e in batch.events}
        if len(worker_ids) > 1:
            raise EncodeError(f"a kvrouter batch holds one worker's events, got workers {sorted(worker_ids)}")
        if any(e.dp_rank != batch.dp_rank for e in batch.events):
            raise EncodeError(f"every event of a kvrouter batch must have the batch's dp rank {batch.dp_rank}")
        worker_id = worker_ids.pop() if worker_ids else 0
        body = {
            "v": FORMAT_VERSION,
            "ts": batch.timestamp,
            "worker_id": worker_id,
            "dp_rank": batch.dp_rank,
            "events": [self._event(e) for e in batch.events],
        }
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return packed

    def _event(self, event: KvEvent) -> list[Any]:
        tier = event.tier.value
        match event:
            case Stored(parent=parent, blocks=blocks):
                tokens = None
                if self.with_tokens and blocks and all(b.token_ids is not None for b in blocks):
                    tokens = np.asarray([b.token_ids for b in blocks], dtype=_U32).tobytes()
                return [
                    _STORED,
                    event.event_id,
                    tier,
                    parent,
                    _pack_u64([b.engine_hash for b in blocks]),
                    _pack_u64([b.local_hash for b in blocks]),
                    tokens,
                ]
            case Removed(engine_hashes=hashes):
                return [_REMOVED, event.event_id, tier, _pack_u64(hashes)]
            case Cleared():
                return [_CLEARED, event.event_id, tier]


class RawEvent(NamedTuple):
    """One event as the wire holds it: hashes still packed arrays, for callers that index them whole
    (the applier hands ``engine`` and ``local`` straight to its kernels).

    ``RawEvent`` and ``RawBatch`` are named tuples rather than frozen dataclasses: the ingest path builds
    one of each per message, and a frozen dataclass's ``__init__`` (one ``object.__setattr__`` a field)
    costs about a microsecond more, a few percent of an applier's time per message."""

    tag: str
    """``"S"`` stored, ``"R"`` removed, ``"C"`` cleared."""
    event_id: int
    tier: StorageTier
    parent: EngineHash | None
    engine: npt.NDArray[np.uint64]
    local: npt.NDArray[np.uint64]
    tokens: npt.NDArray[np.uint32] | None
    """Every block's tokens, concatenated: ``len(engine)`` equal runs."""


class RawBatch(NamedTuple):
    worker_id: int
    dp_rank: int
    timestamp: float | None
    events: tuple[RawEvent, ...]
    skipped_events: int = 0
    """Engine events of another attention group (``group_idx`` != 0), skipped without an event id."""
    dropped_blocks: int = 0
    """Engine blocks not indexed: every block of a store whose ``block_size`` is not the router's, and
    blocks past the last full block of ``token_ids``."""
    foreign_block_size: int = 0
    """The ``block_size`` of the last store dropped for not being the router's (0: none was)."""


class Decoder:
    """Decodes kvrouter batches; the worker id, dp rank and event ids come from the batch itself."""

    def decode(self, payload: bytes, *, first_event_id: int = 0) -> EventBatch:
        """Decode one batch into model events; ``first_event_id`` is unused (events carry their ids).

        Raises:
            BadEvent: not msgpack, an unknown version, or a malformed event; the message names the place.
        """
        raw = self.decode_raw(payload)
        events = tuple(_to_model(event, raw.worker_id, raw.dp_rank) for event in raw.events)
        return EventBatch(events, timestamp=raw.timestamp, dp_rank=raw.dp_rank)

    def decode_raw(self, payload: bytes) -> RawBatch:
        """Decode and validate one batch, leaving hashes as arrays (no object per block).

        Raises:
            BadEvent: as ``decode``.
        """
        try:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types for bad bytes
            raise BadEvent(f"kvrouter batch: not msgpack: {exc}") from exc
        batch = expect_map(obj, "kvrouter batch $")
        version = field(batch, "v", "$")
        if version != FORMAT_VERSION:
            raise BadEvent(f"kvrouter batch $.v: unsupported version {version!r}, expected {FORMAT_VERSION}")
        ts_raw = batch.get("ts")
        timestamp = None if ts_raw is None else expect_float(ts_raw, "$.ts")
        worker_id = expect_u64(field(batch, "worker_id", "$"), "$.worker_id")
        dp_rank = expect_int(field(batch, "dp_rank", "$"), "$.dp_rank", hi=(1 << 32) - 1)
        raw_events = expect_list(field(batch, "events", "$"), "$.events")
        events = tuple(_decode_event(raw, f"$.events[{i}]") for i, raw in enumerate(raw_events))
        return RawBatch(worker_id, dp_rank, timestamp, events)


def _decode_event(raw: object, where: str) -> RawEvent:
    items = expect_list(raw, where)
    if len(items) < 3:
        raise BadEvent(f"{where}: expected [tag, event_id, tier, ...], got {len(items)} elements")
    tag, event_id_raw, tier_raw = items[0], items[1], items[2]
    event_id = expect_u64(event_id_raw, f"{where}[1]")
    if not isinstance(tier_raw, str):
        raise BadEvent(f"{where}[2]: expected a tier name, got {describe(tier_raw)}")
    try:
        tier = parse_tier(tier_raw)
    except BadEvent as exc:
        raise BadEvent(f"{where}[2]: {exc}") from None
    if tag == _STORED:
        if len(items) < 7:
            raise BadEvent(f"{where}: a stored event has 7 elements, got {len(items)}")
        parent = None if items[3] is None else EngineHash(expect_u64(items[3], f"{where}[3]"))
        engine = _unpack(items[4], _U64, f"{where}[4]")
        local = _unpack(items[5], _U64, f"{where}[5]")
        if len(engine) != len(local):
            raise BadEvent(f"{where}: {len(engine)} engine hashes but {len(local)} local hashes")
        tokens = None
        if items[6] is not None:
            tokens = _unpack(items[6], _U32, f"{where}[6]")
            if not len(engine) or len(tokens) % len(engine):
                raise BadEvent(f"{where}[6]: {len(tokens)} tokens do not split evenly into {len(engine)} blocks")
        return RawEvent(_STORED, event_id, tier, parent, engine, local, tokens)
    if tag == _REMOVED:
        if len(items) < 4:
            raise BadEvent(f"{where}: a removed event has 4 elements, got {len(items)}")
        return RawEvent(_REMOVED, event_id, tier, None, _unpack(items[3], _U64, f"{where}[3]"), _NO_HASHES, None)
    if tag == _CLEARED:
        return RawEvent(_CLEARED, event_id, tier, None, _NO_HASHES, _NO_HASHES, None)
    raise BadEvent(f"{where}[0]: unknown event tag {tag!r}; expected 'S', 'R' or 'C'")


def _to_model(event: RawEvent, worker_id: int, dp_rank: int) -> KvEvent:
    event_id, tier = event.event_id, event.tier
    if event.tag == _REMOVED:
        hashes = tuple(map(EngineHash, event.engine.tolist()))
        return Removed(worker_id, hashes, dp_rank=dp_rank, event_id=event_id, tier=tier)
    if event.tag == _CLEARED:
        return Cleared(worker_id, dp_rank=dp_rank, event_id=event_id, tier=tier)
    count = len(event.engine)
    if event.tokens is None or not count:
        tokens: list[tuple[int, ...] | None] = [None] * count
    else:
        size = len(event.tokens) // count
        flat = event.tokens.tolist()
        tokens = [tuple(flat[i * size : (i + 1) * size]) for i in range(count)]
    blocks = tuple(
        StoredBlock(EngineHash(e), LocalHash(h), t)
        for e, h, t in zip(event.engine.tolist(), event.local.tolist(), tokens, strict=True)
    )
    return Stored(worker_id, event.parent, blocks, dp_rank=dp_rank, event_id=event_id, tier=tier)
