"""The replica sync's JSON messages: the reference's ``ActiveSequenceEvent``, and kvrouter's snapshot parts.

``ActiveSequenceEvent`` is spelled as serde spells the reference's struct (``lib/kv-router/src/
protocols.rs``) by default: fields by name, the ``data`` enum externally tagged, so a struct variant is a
one-key object (``{"AddRequest": {...}}``) and a unit variant a bare string (``"Free"``,
``"MarkPrefillCompleted"``); ``Option`` is ``null`` or absent; a ``Duration`` is ``{"secs", "nanos"}``.
Unknown fields are ignored, as serde does (the reference has added fields before: ``lora_name``,
``stride``). Decoding is strict about everything else and every refusal is a
:class:`~kvrouter.errors.BadMessage` naming the JSON path and the value, because a peer on another
version that sends something else must be counted and seen, never half-applied.

The AddRequest carries no prompt length (the reference dropped ``isl`` and ``overlap`` from it): a
replica takes the request's prefill load from ``prefill_load_hint.initial_effective_prefill_tokens``,
which the sending router fills with the tokens it booked (prompt minus the cached prefix), exactly as the
reference's replica does (``ActiveSequences::add_request_with_prefill_tracking`` uses the hint when
present). kvrouter always sends the hint, and reads a missing one as 0 tokens.

The snapshot (``SnapshotPart``) is kvrouter's: a late joiner's state, split into parts below NATS's 1
MiB payload limit, each a list of AddRequest events whose hint holds the request's *remaining* prefill
tokens (0 once its first token is out). orjson encodes and decodes: a 64-block AddRequest is about 1.5
KB and takes a few microseconds either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from ..errors import BadMessage
from ..events.model import WorkerKey

__all__ = [
    "FREE",
    "MARK_PREFILL_COMPLETED",
    "ActiveSequenceEvent",
    "AddRequest",
    "Data",
    "SnapshotPart",
    "decode_event",
    "decode_snapshot_part",
    "encode_event",
    "encode_snapshot_part",
    "event_object",
    "split_snapshot",
]

FREE: Final = "Free"
MARK_PREFILL_COMPLETED: Final = "MarkPrefillCompleted"
U32: Final = (1 << 32) - 1
U64: Final = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class AddRequest:
    """``ActiveSequenceEventData::AddRequest``: a request booked on ``worker``."""

    token_sequence: tuple[int, ...] | None
    """The request's sequence hashes, one per full block (None when blocks are not tracked)."""
    prefill_tokens: int | None
    """``prefill_load_hint.initial_effective_prefill_tokens``: tokens it still has to prefill; None: no hint."""
    track_prefill_tokens: bool = True
    expected_output_tokens: int | None = None
    expected_prefill_secs: float | None = None
    """``prefill_load_hint.expected_prefill_duration`` in seconds (kept for the round trip, not used)."""


Data = AddRequest | Literal["Free", "MarkPrefillCompleted"]


@dataclass(frozen=True, slots=True)
class ActiveSequenceEvent:
    """One replica-sync event: ``data`` happened to ``request_id`` on ``worker``, decided by ``router_id``."""

    request_id: str
    worker: WorkerKey
    data: Data
    router_id: int
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class SnapshotPart:
    """Part ``part`` (0-based) of ``parts`` of the snapshot the replica ``router_id`` sent."""

    router_id: int
    part: int
    parts: int
    events: tuple[ActiveSequenceEvent, ...]


# -- encoding -----------------------------------------------------------------------------------------


def _duration(secs: float | None) -> dict[str, int] | None:
    if secs is None:
        return None
    whole = int(secs)
    return {"secs": whole, "nanos": round((secs - whole) * 1e9)}


def event_object(event: ActiveSequenceEvent) -> dict[str, Any]:
    """The event as the JSON object serde writes (before bytes: snapshot parts embed it)."""
    data: Any = event.data
    if isinstance(data, AddRequest):
        hint = None
        if data.prefill_tokens is not None:
            hint = {
                "initial_effective_prefill_tokens": data.prefill_tokens,
                "expected_prefill_duration": _duration(data.expected_prefill_secs),
            }
        data = {
            "AddRequest": {
                "token_sequence": None if data.token_sequence is None else list(data.token_sequence),
                "track_prefill_tokens": data.track_prefill_tokens,
                "expected_output_tokens": data.expected_output_tokens,
                "prefill_load_hint": hint,
            }
        }
    return {
        "request_id": event.request_id,
        "worker": {"worker_id": event.worker[0], "dp_rank": event.worker[1]},
        "data": data,
        "router_id": event.router_id,
        "lora_name": event.lora_name,
    }


def encode_event(event: ActiveSequenceEvent) -> bytes:
    """One event as the JSON payload of an ``active_sequences_events`` message."""
    return orjson.dumps(event_object(event))


def encode_snapshot_part(part: SnapshotPart) -> bytes:
    return orjson.dumps(
        {
            "router_id": part.router_id,
            "part": part.part,
            "parts": part.parts,
            "events": [event_object(e) for e in part.events],
        }
    )


# -- decoding -----------------------------------------------------------------------------------------


def _fail(what: str, path: str, expected: str, value: object) -> BadMessage:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return BadMessage(f"{what}: {path}: expected {expected}, got {shown}")


class _Reader:
    """Checked field access for one message: every failure a BadMessage naming its path."""

    def __init__(self, what: str) -> None:
        self.what = what

    def obj(self, value: object, path: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise _fail(self.what, path, "an object", value)
        return value

    def field(self, obj: Mapping[str, Any], name: str, path: str) -> Any:
        if name not in obj:
            raise BadMessage(f"{self.what}: {path}.{name}: missing")
        return obj[name]

    def uint(self, value: object, path: str, top: int) -> int:
        if type(value) is not int or not 0 <= value <= top:
            raise _fail(self.what, path, f"an integer in 0..{top}", value)
        return value

    def opt_uint(self, value: object, path: str, top: int) -> int | None:
        return None if value is None else self.uint(value, path, top)

    def string(self, value: object, path: str) -> str:
        if not isinstance(value, str):
            raise _fail(self.what, path, "a string", value)
        return value

    def boolean(self, value: object, path: str) -> bool:
        if not isinstance(value, bool):
            raise _fail(self.what, path, "true or false", value)
        return value

    def event(self, value: object, path: str) -> ActiveSequenceEvent:
        top = self.obj(value, path)
        request_id = self.string(self.field(top, "request_id", path), f"{path}.request_id")
        worker = self.obj(self.field(top, "worker", path), f"{path}.worker")
        key = (
            self.uint(self.field(worker, "worker_id", f"{path}.worker"), f"{path}.worker.worker_id", U64),
            self.uint(self.field(worker, "dp_rank", f"{path}.worker"), f"{path}.worker.dp_rank", U32),
        )
        router_id = self.uint(self.field(top, "router_id", path), f"{path}.router_id", U64)
        lora = top.get("lora_name")
        lora_name = None if lora is None else self.string(lora, f"{path}.lora_name")
        data = self.data(self.field(top, "data", path), f"{path}.data")
        return ActiveSequenceEvent(request_id, key, data, router_id, lora_name)

    def data(self, value: object, path: str) -> Data:
        if value == FREE:
            return FREE
        if value == MARK_PREFILL_COMPLETED:
            return MARK_PREFILL_COMPLETED
        if not isinstance(value, dict) or len(value) != 1 or "AddRequest" not in value:
            raise _fail(self.what, path, '"Free", "MarkPrefillCompleted" or {"AddRequest": {...}}', value)
        path = f"{path}.AddRequest"
        add = self.obj(value["AddRequest"], path)
        hashes = add.get("token_sequence")
        sequence: tuple[int, ...] | None = None
        if hashes is not None:
            if not isinstance(hashes, list):
                raise _fail(self.what, f"{path}.token_sequence", "a list of u64 hashes or null", hashes)
            for i, h in enumerate(hashes):  # hot path: one check per block
                if type(h) is not int or not 0 <= h <= U64:
                    raise _fail(self.what, f"{path}.token_sequence[{i}]", f"an integer in 0..{U64}", h)
            sequence = tuple(hashes)
        track = add.get("track_prefill_tokens", True)  # serde(default = true)
        track = self.boolean(track, f"{path}.track_prefill_tokens")
        output = self.opt_uint(add.get("expected_output_tokens"), f"{path}.expected_output_tokens", U32)
        tokens: int | None = None
        secs: float | None = None
        hint = add.get("prefill_load_hint")
        if hint is not None:
            hpath = f"{path}.prefill_load_hint"
            hint = self.obj(hint, hpath)
            tokens = self.uint(
                self.field(hint, "initial_effective_prefill_tokens", hpath),
                f"{hpath}.initial_effective_prefill_tokens",
                U64,
            )
            duration = hint.get("expected_prefill_duration")
            if duration is not None:
                dpath = f"{hpath}.expected_prefill_duration"
                duration = self.obj(duration, dpath)
                whole = self.uint(self.field(duration, "secs", dpath), f"{dpath}.secs", U64)
                nanos = self.uint(self.field(duration, "nanos", dpath), f"{dpath}.nanos", 999_999_999)
                secs = whole + nanos / 1e9
        return AddRequest(sequence, tokens, track, output, secs)


def _load(payload: bytes, what: str) -> Any:
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise BadMessage(f"{what}: not JSON: {exc}") from exc


def decode_event(payload: bytes) -> ActiveSequenceEvent:
    """An ``active_sequences_events`` payload.

    Raises:
        BadMessage: not JSON, or a field missing, mistyped or out of range (the message names its path).
    """
    reader = _Reader("active_sequences_events")
    return reader.event(_load(payload, reader.what), "$")


def decode_snapshot_part(payload: bytes) -> SnapshotPart:
    """A snapshot part.

    Raises:
        BadMessage: not JSON, a field missing or mistyped, ``part`` not below ``parts``, or an event of it bad
            (a MarkPrefillCompleted: a snapshot holds active requests as AddRequests and recently freed ones
            as Frees, the tombstones a re-sync reconciles with).
    """
    reader = _Reader("snapshot")
    top = reader.obj(_load(payload, reader.what), "$")
    router_id = reader.uint(reader.field(top, "router_id", "$"), "$.router_id", U64)
    parts = reader.uint(reader.field(top, "parts", "$"), "$.parts", U32)
    part = reader.uint(reader.field(top, "part", "$"), "$.part", U32)
    if part >= parts:
        raise BadMessage(f"snapshot: $.part: expected an integer below parts ({parts}), got {part}")
    events = reader.field(top, "events", "$")
    if not isinstance(events, list):
        raise _fail(reader.what, "$.events", "a list of events", events)
    decoded = tuple(reader.event(e, f"$.events[{i}]") for i, e in enumerate(events))
    for i, e in enumerate(decoded):
        if not isinstance(e.data, AddRequest) and e.data != FREE:
            raise _fail(reader.what, f"$.events[{i}].data", "an AddRequest or Free", e.data)
    return SnapshotPart(router_id, part, parts, decoded)


def split_snapshot(router_id: int, events: Sequence[ActiveSequenceEvent], max_bytes: int) -> list[bytes]:
    """The snapshot of ``events`` as encoded parts, each at most ``max_bytes`` (at least one part, maybe
    empty). An event too big for a part on its own still gets a part of its own (NATS refuses it then,
    and the joiner counts the part missing)."""
    chunks: list[list[dict[str, Any]]] = [[]]
    size = 64  # the envelope
    for event in events:
        obj = event_object(event)
        n = len(orjson.dumps(obj)) + 1
        if chunks[-1] and size + n > max_bytes:
            chunks.append([])
            size = 64
        chunks[-1].append(obj)
        size += n
    parts = len(chunks)
    return [
        orjson.dumps({"router_id": router_id, "part": i, "parts": parts, "events": chunk})
        for i, chunk in enumerate(chunks)
    ]
