"""``fastparse``: differential against the ordinary path (``orjson`` + ``requests.parse_select`` or
``parse_query``).

For every body, generated or malformed, each fast parser (``/select``'s and ``/query``'s) either gives the
request the ordinary path gives (token ids equal and ``uint32``, every other field equal) or declines
(None): it never answers where the ordinary path refuses, and never answers differently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvrouter.errors import ServiceError
from kvrouter.service.core.requests import QueryRequest, SelectRequest, parse_body, parse_query, parse_select
from kvrouter.service.edges.fastparse import fast_query, fast_select, scan_tokens

Request = SelectRequest | QueryRequest
PARSERS: list[tuple[Callable[[bytes], Request | None], Callable[[dict[str, Any]], Request]]] = [
    (fast_select, parse_select),
    (fast_query, lambda body: parse_query(body, by_hash=False)),
]
"""Each fast parser and the ordinary validator it must agree with."""


def slow(body: bytes, validate: Callable[[dict[str, Any]], Request]) -> Request | None:
    try:
        return validate(parse_body(body))
    except ServiceError:
        return None


def check(body: bytes) -> bool:
    """Each fast answer equals the slow one, or that fast parser declined. True when both answered."""
    answered = True
    for fast_parse, validate in PARSERS:
        fast = fast_parse(body)
        if fast is None:
            answered = False
            continue
        reference = slow(body, validate)
        assert reference is not None, body
        assert fast.token_ids is not None
        assert reference.token_ids is not None
        assert fast.token_ids.dtype == np.uint32
        assert np.array_equal(fast.token_ids, reference.token_ids), body
        for f in dataclasses.fields(type(fast)):
            if f.name != "token_ids":
                assert getattr(fast, f.name) == getattr(reference, f.name), (f.name, body)
    return answered


json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 40), 1 << 40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)
token = st.one_of(
    st.integers(0, (1 << 32) - 1),
    st.sampled_from([0, 1, (1 << 32) - 1, 1 << 32, -1, -0]),
)
token_list = st.lists(token, max_size=40)
odd_token_list = st.lists(st.one_of(token, json_scalar), max_size=6)
fields = st.fixed_dictionaries(
    {},
    optional={
        "model_name": st.one_of(st.text(min_size=1, max_size=6), json_scalar),
        "routing_group": st.sampled_from(["default", "g", ""]),
        "isl_tokens": st.one_of(st.integers(0, 1 << 20), json_scalar),
        "selection_id": st.one_of(st.text(min_size=1, max_size=6), st.none()),
        "explain": st.one_of(st.booleans(), json_scalar),
        "fallbacks": st.integers(-1, 70),
        "block_hashes": st.lists(st.integers(0, 1 << 63), max_size=3),
        "lora_name": st.one_of(st.text(max_size=4), json_scalar),
        "cache_salt": st.one_of(st.text(max_size=4), json_scalar),
        "extra": json_value,
        "ključ\u2028": json_value,
    },
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    members: dict[str, Any] = draw(fields)
    if draw(st.booleans()):
        members["token_ids"] = draw(st.one_of(token_list, token_list, odd_token_list, json_value))
    items = list(members.items())
    draw(st.randoms()).shuffle(items)
    ws = draw(st.sampled_from(["", " ", "\n\t ", "\r\n"]))
    parts = [orjson.dumps(k).decode() + ws + ":" + ws + orjson.dumps(v).decode() for k, v in items]
    text = ws + "{" + ws + ("," + ws).join(parts) + ws + "}" + ws
    return text.encode()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies())
def test_generated_bodies(body: bytes) -> None:
    check(body)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies(), st.data())
def test_mutated_bodies(body: bytes, data: st.DataObject) -> None:
    """One byte changed, inserted or removed: malformed bodies never get a fast answer the slow path
    would refuse."""
    position = data.draw(st.integers(0, len(body)))
    byte = data.draw(st.sampled_from(list(b'{}[]",:-.eE0123456789\\ \x00tnf')))
    action = data.draw(st.sampled_from(["replace", "insert", "delete"]))
    if action == "insert":
        mutated = body[:position] + bytes([byte]) + body[position:]
    elif position < len(body):
        mutated = body[:position] + (bytes([byte]) if action == "replace" else b"") + body[position + 1 :]
    else:
        mutated = body
    check(mutated)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model_name": "m", "token_ids": [1, 2, 3]}',
        b'{"token_ids":[],"model_name":"m"}',
        b' {\n"token_ids" :\t[ 0 , 4294967295 ] , "isl_tokens": 7, "explain": true }\n',
        b'{"model_name": "m\\"token_ids\\": [9]", "token_ids": [5]}',
        b'{"x": {"token_ids": [9]}, "token_ids": [5], "y": ["]", "}"]}',
    ],
)
def test_fast_answers(body: bytes) -> None:
    assert check(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"token_ids": [1.0]}',
        b'{"token_ids": [1e3]}',
        b'{"token_ids": [-1]}',
        b'{"token_ids": [-0]}',
        b'{"token_ids": [01]}',
        b'{"token_ids": [4294967296]}',
        b'{"token_ids": [99999999999]}',
        b'{"token_ids": [1, [2]]}',
        b'{"token_ids": [1,]}',
        b'{"token_ids": [null]}',
        b'{"token_ids": [1], "token_ids": [2]}',
        b'{"token\\u005fids": [1], "token_ids": [2]}',
        b'{"token_ids": [1]',
        b'{"token_ids": [1]} x',
        b'[{"token_ids": [1]}]',
        b'{"token_ids": "1"}',
        b'{"token_ids": null, "block_hashes": [1]}',
        b'{"model_name": 1, "token_ids": [1]}',
        b'{"model_name": "\xff", "token_ids": [1]}',
        b"{}",
        b"",
    ],
)
def test_declines(body: bytes) -> None:
    assert fast_select(body) is None
    assert fast_query(body) is None
    check(body)


def test_scan_span() -> None:
    body = b'{"a": "b", "token_ids": [7, 8]}'
    found = scan_tokens(body)
    assert found is not None
    tokens, start, end = found
    assert body[start:end] == b"[7, 8]"
    assert tokens.tolist() == [7, 8]


@st.composite
def valid_bodies(draw: st.DrawFn) -> bytes:
    members: dict[str, Any] = {
        "token_ids": draw(st.lists(st.integers(0, (1 << 32) - 1), max_size=60)),
        "model_name": draw(st.text(min_size=1, max_size=6)),
    }
    members.update(draw(st.dictionaries(st.sampled_from(["extra", "other", "ключ"]), json_value, max_size=2)))
    if draw(st.booleans()):
        members["explain"] = draw(st.booleans())
    items = list(members.items())
    draw(st.randoms()).shuffle(items)
    return orjson.dumps(dict(items))


@settings(max_examples=200, deadline=None)
@given(valid_bodies())
def test_valid_bodies_answered_fast(body: bytes) -> None:
    """The hot shape (any key order, escapes in other members' strings, nested extras) is taken."""
    assert check(body)
