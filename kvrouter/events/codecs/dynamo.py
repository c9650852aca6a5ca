"""The reference's JSON events: ``KvCacheEvent`` and ``RouterEvent`` (``spec/dynamo-semantics.md`` §2.2, §2.6).

This is what ``dynamo._core.RadixTree.apply_event(worker_id, data)`` takes and what its
``dump_tree_as_events()`` returns, and the shape of ``fixtures/radix_contract.json``'s events. The
validation follows the reference's serde decisions exactly, because the fixtures' ``bad_event``
expectations are those decisions: hashes and ids are strict u64 (no negatives, no strings),
``event_id`` is required, ``dp_rank`` (u32) and ``parent_hash`` may be absent, ``cleared`` is the
bare lowercase string, unknown top-level keys are ignored.

The reference's events carry no storage tier (``RouterEvent`` does), and never token ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from ...errors import BadEvent
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
from ._fields import describe, expect_int, expect_list, expect_map, expect_u64, field

__all__ = ["Decoder", "Encoder", "event_from_dict"]

U32_MAX: Final = (1 << 32) - 1

TIER_WIRE_NAMES: Final = {
    StorageTier.DEVICE: "device",
    StorageTier.HOST: "host_pinned",
    StorageTier.DISK: "disk",
    StorageTier.SHARED: "external",
}
"""kvrouter tier → the reference's ``storage_tier`` spelling (the reverse of ``model.TIER_NAMES``)."""


def event_from_dict(
    obj: object, worker_id: int, *, tier: StorageTier = StorageTier.DEVICE, where: str = "$"
) -> KvEvent:
    """Convert one ``KvCacheEvent`` as a parsed JSON dict.

    Raises:
        BadEvent: the dict is not a valid ``KvCacheEvent``; the message names the field.
    """
    event = expect_map(obj, where)
    event_id = expect_u64(field(event, "event_id", where), f"{where}.event_id")
    dp_rank = expect_int(event.get("dp_rank", 0), f"{where}.dp_rank", hi=U32_MAX)
    data = field(event, "data", where)
    here = f"{where}.data"
    if data == "cleared":
        return Cleared(worker_id, dp_rank=dp_rank, event_id=event_id, tier=tier)
    if isinstance(data, str):
        raise BadEvent(f"{here}: unknown variant {data!r}; expected 'cleared', 'stored' or 'removed'")
    variant = expect_map(data, here)
    if len(variant) != 1:
        raise BadEvent(f"{here}: expected exactly one of 'stored', 'removed', got keys {sorted(variant)}")
    ((kind, body),) = variant.items()
    if kind == "stored":
        return _stored(expect_map(body, f"{here}.stored"), worker_id, dp_rank, event_id, tier, f"{here}.stored")
    if kind == "removed":
        body = expect_map(body, f"{here}.removed")
        hashes = expect_list(field(body, "block_hashes", f"{here}.removed"), f"{here}.removed.block_hashes")
        engine = tuple(EngineHash(expect_u64(h, f"{here}.removed.block_hashes[{i}]")) for i, h in enumerate(hashes))
        return Removed(worker_id, engine, dp_rank=dp_rank, event_id=event_id, tier=tier)
    raise BadEvent(f"{here}: unknown variant {kind!r}; expected 'cleared', 'stored' or 'removed'")


def _stored(
    body: Mapping[str, Any], worker_id: int, dp_rank: int, event_id: int, tier: StorageTier, where: str
) -> Stored:
    parent_raw = body.get("parent_hash")
    parent = None if parent_raw is None else EngineHash(expect_u64(parent_raw, f"{where}.parent_hash"))
    raw_blocks = expect_list(field(body, "blocks", where), f"{where}.blocks")
    blocks = []
    for i, raw in enumerate(raw_blocks):
        at = f"{where}.blocks[{i}]"
        block = expect_map(raw, at)
        blocks.append(
            StoredBlock(
                EngineHash(expect_u64(field(block, "block_hash", at), f"{at}.block_hash")),
                LocalHash(expect_u64(field(block, "tokens_hash", at), f"{at}.tokens_hash")),
            )
        )
    return Stored(worker_id, parent, tuple(blocks), dp_rank=dp_rank, event_id=event_id, tier=tier)


def _router_event(obj: Mapping[str, Any], where: str) -> KvEvent:
    worker_id = expect_u64(field(obj, "worker_id", where), f"{where}.worker_id")
    tier_name = obj.get("storage_tier", "device")
    if not isinstance(tier_name, str):
        raise BadEvent(f"{where}.storage_tier: expected a string, got {describe(tier_name)}")
    try:
        tier = parse_tier(tier_name)
    except BadEvent as exc:
        raise BadEvent(f"{where}.storage_tier: {exc}") from None
    return event_from_dict(field(obj, "event", where), worker_id, tier=tier, where=f"{where}.event")


class Decoder:
    """Decodes a JSON ``KvCacheEvent``, a ``RouterEvent``, or an array of either (a dump).

    A bare ``KvCacheEvent`` belongs to ``worker_id``; ``RouterEvent``s name their own worker and tier.
    """

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id

    def decode(self, payload: bytes, *, first_event_id: int = 0) -> EventBatch:
        """Decode one payload; ``first_event_id`` is unused (the events carry their own ids).

        Raises:
            BadEvent: not JSON, or not an event; the message names the place.
        """
        try:
            obj = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadEvent(f"dynamo event: not JSON: {exc}") from exc
        items = obj if isinstance(obj, list) else [obj]
        events = []
        for i, item in enumerate(items):
            where = f"$[{i}]" if isinstance(obj, list) else "$"
            if isinstance(item, dict) and "event" in item:
                events.append(_router_event(item, where))
            else:
                events.append(event_from_dict(item, self.worker_id, where=where))
        dp_rank = events[0].dp_rank if events else 0
        return EventBatch(tuple(events), timestamp=None, dp_rank=dp_rank)


class Encoder:
    """Encodes events as the reference reads them.

    ``encode`` writes an array of ``RouterEvent`` records (the dump's form, which ``Decoder`` reads
    back); ``encode_event`` writes one bare ``KvCacheEvent``, the argument of ``RadixTree.apply_event``;
    ``encode_router_event`` one ``RouterEvent`` object, a NATS ``kv-events`` message.
    """

    def encode(self, batch: EventBatch) -> bytes:
        records = [
            {"worker_id": e.worker_id, "storage_tier": TIER_WIRE_NAMES[e.tier], "event": _event_dict(e)}
            for e in batch.events
        ]
        return json.dumps(records, separators=(",", ":")).encode()

    def encode_event(self, event: KvEvent) -> bytes:
        return json.dumps(_event_dict(event), separators=(",", ":")).encode()

    def encode_router_event(self, event: KvEvent) -> bytes:
        """One ``RouterEvent`` object: what the reference's worker publishes per message on NATS's
        ``kv-events`` subject (``component.publish(KV_EVENT_SUBJECT, &router_event)``)."""
        tier = TIER_WIRE_NAMES[event.tier]
        record = {"worker_id": event.worker_id, "storage_tier": tier, "event": _event_dict(event)}
        return json.dumps(record, separators=(",", ":")).encode()


def _event_dict(event: KvEvent) -> dict[str, Any]:
    data: Any
    match event:
        case Stored(parent=parent, blocks=blocks):
            data = {
                "stored": {
                    "parent_hash": parent,
                    "blocks": [{"block_hash": b.engine_hash, "tokens_hash": b.local_hash} for b in blocks],
                }
            }
        case Removed(engine_hashes=hashes):
            data = {"removed": {"block_hashes": list(hashes)}}
        case Cleared():
            data = "cleared"
    return {"event_id": event.event_id, "dp_rank": event.dp_rank, "data": data}
