from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, strategies as st

from kvrouter.errors import BadEvent
from kvrouter.events.codecs.query import (
    QUERY_VERSION,
    QueryReply,
    QueryRequest,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from tests.strategies import u64


def _frames(body: Any) -> list[bytes]:
    return [b"", msgpack.packb(body, use_bin_type=True)]


@given(start=st.none() | u64, end=st.none() | u64)
def test_requests_round_trip(start: int | None, end: int | None):
    if start is not None and end is not None and end < start:
        start, end = end, start
    request = QueryRequest(start, end)
    frames = encode_request(request)
    assert frames[0] == b""
    assert msgpack.unpackb(frames[1]) == {"v": QUERY_VERSION, "op": "events", "start": start, "end": end}
    assert decode_request(frames) == request


@given(
    kind=st.sampled_from(["events", "tree_dump"]),
    last=st.none() | u64,
    batches=st.lists(st.binary(max_size=64), max_size=4),
)
def test_replies_round_trip(kind: Any, last: int | None, batches: list[bytes]):
    reply = QueryReply(kind, last, tuple(batches))
    assert decode_reply(encode_reply(reply)) == reply


def test_a_too_new_reply_round_trips_without_batches():
    reply = QueryReply("too_new", 41)
    frames = encode_reply(reply)
    assert msgpack.unpackb(frames[1]) == {"v": 1, "reply": "too_new", "last_event_id": 41, "batches": []}
    assert decode_reply(frames) == reply


def test_a_request_with_only_start_means_up_to_the_latest():
    assert decode_request(_frames({"v": 1, "op": "events", "start": 5})) == QueryRequest(5, None)


BAD_REQUESTS = {
    "one frame": ([b"x"], "expected 2 frames"),
    "three frames": ([b"", b"x", b"y"], "expected 2 frames"),
    "no delimiter": ([b"id", msgpack.packb({"v": 1, "op": "events"})], "frame 0: expected the empty delimiter"),
    "not msgpack": ([b"", b"\xc1"], "not msgpack"),
    "truncated msgpack": ([b"", b"\x92\x01"], "not msgpack"),
    "not a map": (_frames([1, "events", None, None]), "query request $: expected a map, got list"),
    "no version": (_frames({"op": "events", "start": None}), "missing field 'v'"),
    "wrong version": (_frames({"v": 2, "op": "events"}), "$.v: unsupported version 2"),
    "version as string": (_frames({"v": "1", "op": "events"}), "$.v: unsupported version '1'"),
    "no op": (_frames({"v": 1, "start": 1}), "missing field 'op'"),
    "unknown op": (_frames({"v": 1, "op": "dump"}), "$.op: unknown operation 'dump'"),
    "negative start": (_frames({"v": 1, "op": "events", "start": -1}), "$.start: -1 is outside"),
    "string start": (_frames({"v": 1, "op": "events", "start": "0"}), "$.start: expected an integer, got str"),
    "bool end": (_frames({"v": 1, "op": "events", "start": 0, "end": True}), "$.end: expected an integer, got bool"),
    "float end": (_frames({"v": 1, "op": "events", "end": 1.5}), "$.end: expected an integer, got float"),
    "end before start": (_frames({"v": 1, "op": "events", "start": 5, "end": 4}), "$.end: 4 is below start 5"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_malformed_requests_raise_bad_event_naming_the_place(case: str):
    frames, message = BAD_REQUESTS[case]
    with pytest.raises(BadEvent, match=message.replace("$", r"\$").replace("[", r"\[")):
        decode_request(frames)


BAD_REPLIES = {
    "one frame": ([b""], "expected 2 frames"),
    "no delimiter": ([b"\x00", _frames({})[1]], "frame 0: expected the empty delimiter"),
    "not msgpack": ([b"", b"\xc1"], "not msgpack"),
    "not a map": (_frames("events"), "query reply $: expected a map, got str"),
    "wrong version": (_frames({"v": 0, "reply": "events", "last_event_id": 1, "batches": []}), "unsupported version 0"),
    "no reply": (_frames({"v": 1, "last_event_id": 1, "batches": []}), "missing field 'reply'"),
    "unknown reply": (_frames({"v": 1, "reply": "error", "last_event_id": 1, "batches": []}), "unknown reply 'error'"),
    "no last id": (_frames({"v": 1, "reply": "events", "batches": []}), "missing field 'last_event_id'"),
    "negative last id": (_frames({"v": 1, "reply": "events", "last_event_id": -3, "batches": []}), "-3 is outside"),
    "no batches": (_frames({"v": 1, "reply": "events", "last_event_id": 1}), "missing field 'batches'"),
    "batches not a list": (
        _frames({"v": 1, "reply": "events", "last_event_id": 1, "batches": b"x"}),
        "$.batches: expected an array, got bytes",
    ),
    "batch as string": (
        _frames({"v": 1, "reply": "tree_dump", "last_event_id": 1, "batches": [b"ok", "no"]}),
        "$.batches[1]: expected a bin batch payload, got str",
    ),
    "too_new with batches": (
        _frames({"v": 1, "reply": "too_new", "last_event_id": 1, "batches": [b"x"]}),
        "a too_new reply carries no batches",
    ),
}


@pytest.mark.parametrize("case", BAD_REPLIES, ids=list(BAD_REPLIES))
def test_malformed_replies_raise_bad_event_naming_the_place(case: str):
    frames, message = BAD_REPLIES[case]
    with pytest.raises(BadEvent, match=message.replace("$", r"\$").replace("[", r"\[")):
        decode_reply(frames)


def test_encoders_refuse_what_the_decoders_would_refuse():
    with pytest.raises(BadEvent, match="below start"):
        encode_request(QueryRequest(3, 2))
    with pytest.raises(BadEvent, match="outside"):
        encode_request(QueryRequest(-1))
    with pytest.raises(BadEvent, match="unknown reply"):
        encode_reply(QueryReply("nope", None))  # type: ignore[arg-type]
