"""The local-indexer query protocol: how a router asks a kvrouter worker for events it missed.

A kvrouter worker (``KvPublisher``) binds a ZMQ ROUTER on its query endpoint; the router connects a
DEALER, sends one request and reads one reply (``docs/wire-format.md``, "Query protocol"). This is
Dynamo's ``get_events_in_id_range`` (``spec/dynamo-semantics.md`` §6.2) over ZMQ instead of its
request plane: ``Events`` when the range is still in the worker's ring, ``TreeDump`` when it is not
(or when the router asks for everything), ``TooNew`` when the router is ahead of the worker.

Both messages are one msgpack map after the empty delimiter frame, with a version ``v`` checked on
read. Maps rather than positional arrays (the event format's choice) because a query is tiny and
rare: naming the fields costs nothing and makes a captured exchange readable. The reply's ``batches``
are complete kvrouter-format batch payloads, so the router decodes them with the same
:class:`~kvrouter.events.codecs.kvrouter.Decoder` as live messages and needs no second event codec.

Rejected: reusing vLLM's replay protocol (``[b"", seq8]`` then one frame per batch and an END
marker). It is keyed by batch seq, cannot say "that is older than I keep, here is my whole state",
and its reply length is unknown until the END marker, so a lost END means a timeout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

import msgpack

from ...errors import BadEvent
from ._fields import describe, expect_int, expect_list, expect_map, field

__all__ = [
    "QUERY_VERSION",
    "QueryReply",
    "QueryRequest",
    "ReplyKind",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
]

QUERY_VERSION: Final = 1
"""The ``v`` of every request and reply; a reader rejects any other."""

OP_EVENTS: Final = "events"
"""The one request operation: events by id range (``start`` None = everything, as a dump)."""

ReplyKind: TypeAlias = Literal["events", "tree_dump", "too_new"]
REPLY_KINDS: Final[tuple[ReplyKind, ...]] = ("events", "tree_dump", "too_new")


@dataclass(frozen=True, slots=True)
class QueryRequest:
    """Ask for the events with ``start <= event_id <= end``.

    ``start`` None asks for a full restore (the worker always answers with a tree dump); ``end`` None
    means "up to the latest". ``end`` below ``start`` is malformed.
    """

    start: int | None = None
    end: int | None = None


@dataclass(frozen=True, slots=True)
class QueryReply:
    """A worker's answer.

    - ``events``: ``batches`` hold every buffered event of the range, in order, with their real ids
      (possibly none, when the router is exactly up to date).
    - ``tree_dump``: ``batches`` hold synthetic events that rebuild the worker's blocks from an empty
      state; apply them after clearing the worker. Their ``event_id`` fields number the dump from 0
      and are not live ids; the cursor to resume from is ``last_event_id``.
    - ``too_new``: the request starts beyond ``last_event_id + 1``; ``batches`` is empty.
    """

    reply: ReplyKind
    last_event_id: int | None
    """The worker's last published event id (None before its first event)."""
    batches: tuple[bytes, ...] = ()
    """Complete kvrouter-format batch payloads (``kvrouter.events.codecs.kvrouter``)."""


def _pack(body: Mapping[str, object]) -> bytes:
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def _optional_id(value: object, where: str) -> int | None:
    return None if value is None else expect_int(value, where)


def _body(frames: Sequence[bytes], what: str) -> dict[str, object]:
    """The map of a ``[b"", payload]`` message, version checked."""
    if len(frames) != 2:
        raise BadEvent(f"{what}: expected 2 frames [b'', payload], got {len(frames)}")
    delimiter, payload = frames
    if delimiter:
        raise BadEvent(f"{what} frame 0: expected the empty delimiter, got {len(delimiter)} bytes")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise BadEvent(f"{what}: not msgpack: {exc}") from exc
    body = dict(expect_map(obj, f"{what} $"))
    version = field(body, "v", f"{what} $")
    if version != QUERY_VERSION:
        raise BadEvent(f"{what} $.v: unsupported version {version!r}, expected {QUERY_VERSION}")
    return body


def encode_request(request: QueryRequest) -> list[bytes]:
    """The frames a DEALER sends: ``[b"", payload]``.

    Raises:
        BadEvent: an id outside u64, or ``end`` below ``start``.
    """
    _check_range(request.start, request.end, "query request")
    return [b"", _pack({"v": QUERY_VERSION, "op": OP_EVENTS, "start": request.start, "end": request.end})]


def _check_range(start: object, end: object, what: str) -> tuple[int | None, int | None]:
    start_id = _optional_id(start, f"{what} $.start")
    end_id = _optional_id(end, f"{what} $.end")
    if start_id is not None and end_id is not None and end_id < start_id:
        raise BadEvent(f"{what} $.end: {end_id} is below start {start_id}")
    return start_id, end_id


def decode_request(frames: Sequence[bytes]) -> QueryRequest:
    """Read a request as the ROUTER holds it once the peer's identity frame is taken off.

    Raises:
        BadEvent: not ``[b"", payload]``, not msgpack, an unknown version or op, ids that are not u64
            or nil, or ``end`` below ``start``; the message names the place.
    """
    body = _body(frames, "query request")
    op = field(body, "op", "query request $")
    if op != OP_EVENTS:
        raise BadEvent(f"query request $.op: unknown operation {op!r}, expected {OP_EVENTS!r}")
    start, end = _check_range(body.get("start"), body.get("end"), "query request")
    return QueryRequest(start, end)


def encode_reply(reply: QueryReply) -> list[bytes]:
    """The frames a ROUTER sends after the peer's identity: ``[b"", payload]``.

    Raises:
        BadEvent: an unknown reply kind, or a ``last_event_id`` outside u64.
    """
    if reply.reply not in REPLY_KINDS:
        raise BadEvent(f"query reply $.reply: unknown reply {reply.reply!r}, expected one of {list(REPLY_KINDS)}")
    last = _optional_id(reply.last_event_id, "query reply $.last_event_id")
    body = {"v": QUERY_VERSION, "reply": reply.reply, "last_event_id": last, "batches": list(reply.batches)}
    return [b"", _pack(body)]


def decode_reply(frames: Sequence[bytes]) -> QueryReply:
    """Read a reply as a DEALER receives it: ``[b"", payload]``.

    The batches are returned as bytes, undecoded; each is a kvrouter batch for
    :meth:`~kvrouter.events.codecs.kvrouter.Decoder.decode_raw`.

    Raises:
        BadEvent: not ``[b"", payload]``, not msgpack, an unknown version or reply kind, a
            ``last_event_id`` that is not u64 or nil, or batches that are not a list of bin.
    """
    body = _body(frames, "query reply")
    kind = field(body, "reply", "query reply $")
    if kind not in REPLY_KINDS:
        raise BadEvent(f"query reply $.reply: unknown reply {kind!r}, expected one of {list(REPLY_KINDS)}")
    last = _optional_id(field(body, "last_event_id", "query reply $"), "query reply $.last_event_id")
    raw_batches = expect_list(field(body, "batches", "query reply $"), "query reply $.batches")
    for i, batch in enumerate(raw_batches):
        if not isinstance(batch, bytes):
            raise BadEvent(f"query reply $.batches[{i}]: expected a bin batch payload, got {describe(batch)}")
    if kind == "too_new" and raw_batches:
        raise BadEvent(f"query reply $.batches: a too_new reply carries no batches, got {len(raw_batches)}")
    return QueryReply(kind, last, tuple(raw_batches))
