"""The replica sync's JSON: the reference's serde spelling round-trips, and every refusal names its field."""

from __future__ import annotations

import json

import pytest

from kvrouter.bridge.codec import (
    FREE,
    MARK_PREFILL_COMPLETED,
    ActiveSequenceEvent,
    AddRequest,
    SnapshotPart,
    decode_event,
    decode_snapshot_part,
    encode_event,
    encode_snapshot_part,
    split_snapshot,
)
from kvrouter.bridge.subjects import Subjects
from kvrouter.errors import BadMessage, ConfigError

U64 = (1 << 64) - 1
ADD = ActiveSequenceEvent(
    "req-1", (3, 1), AddRequest((1, U64, 42), 48, True, 7, 1.5), router_id=U64, lora_name="adapter"
)


@pytest.mark.parametrize(
    "event",
    [
        ADD,
        ActiveSequenceEvent("r", (0, 0), AddRequest(None, None), 1),
        ActiveSequenceEvent("r", (U64, 2**32 - 1), AddRequest((), 0, track_prefill_tokens=False), 0),
        ActiveSequenceEvent("r", (1, 0), FREE, 5),
        ActiveSequenceEvent("r", (1, 0), MARK_PREFILL_COMPLETED, 5),
    ],
)
def test_events_round_trip(event: ActiveSequenceEvent) -> None:
    assert decode_event(encode_event(event)) == event


def test_the_wire_is_serdes_default_spelling() -> None:
    wire = json.loads(encode_event(ADD))
    assert wire == {
        "request_id": "req-1",
        "worker": {"worker_id": 3, "dp_rank": 1},
        "data": {
            "AddRequest": {
                "token_sequence": [1, U64, 42],
                "track_prefill_tokens": True,
                "expected_output_tokens": 7,
                "prefill_load_hint": {
                    "initial_effective_prefill_tokens": 48,
                    "expected_prefill_duration": {"secs": 1, "nanos": 500_000_000},
                },
            }
        },
        "router_id": U64,
        "lora_name": "adapter",
    }
    assert json.loads(encode_event(ActiveSequenceEvent("r", (1, 0), FREE, 5)))["data"] == "Free"
    assert json.loads(encode_event(ActiveSequenceEvent("r", (1, 0), MARK_PREFILL_COMPLETED, 5)))["data"] == (
        "MarkPrefillCompleted"
    )


def test_absent_options_and_unknown_fields_read_as_serde_does() -> None:
    body = {
        "request_id": "r",
        "worker": {"worker_id": 1, "dp_rank": 0},
        "data": {"AddRequest": {"token_sequence": [9]}},
        "router_id": 2,
        "stride": 1,  # a newer reference's field: ignored
    }
    event = decode_event(json.dumps(body).encode())
    assert event.data == AddRequest((9,), None, track_prefill_tokens=True)
    assert event.lora_name is None


def _with(path: list[str | int], value: object) -> bytes:
    body = json.loads(encode_event(ADD))
    node = body
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("payload", "names"),
    [
        (b"{not json", "not JSON"),
        (b"[]", "$: expected an object"),
        (_with(["request_id"], 5), "$.request_id: expected a string"),
        (_with(["worker"], KeyError), "$.worker: missing"),
        (_with(["worker", "dp_rank"], -1), "$.worker.dp_rank: expected an integer in 0..4294967295"),
        (_with(["worker", "worker_id"], True), "$.worker.worker_id: expected an integer"),
        (_with(["router_id"], "me"), "$.router_id: expected an integer"),
        (_with(["data"], "Drop"), '$.data: expected "Free"'),
        (_with(["data", "AddRequest", "token_sequence", 1], 1 << 64), "$.data.AddRequest.token_sequence[1]"),
        (_with(["data", "AddRequest", "token_sequence"], "abc"), "$.data.AddRequest.token_sequence: expected a list"),
        (
            _with(["data", "AddRequest", "prefill_load_hint", "initial_effective_prefill_tokens"], 1.5),
            "$.data.AddRequest.prefill_load_hint.initial_effective_prefill_tokens",
        ),
        (_with(["data", "AddRequest", "track_prefill_tokens"], 1), "track_prefill_tokens: expected true or false"),
        (_with(["lora_name"], 3), "$.lora_name: expected a string"),
    ],
)
def test_refusals_name_the_field(payload: bytes, names: str) -> None:
    with pytest.raises(BadMessage, match=r"^active_sequences_events: ") as caught:
        decode_event(payload)
    assert names in str(caught.value)


def test_snapshot_parts_round_trip_and_split_below_the_bound() -> None:
    events = [
        ActiveSequenceEvent(f"r{i}", (1, 0), AddRequest(tuple(range(i * 100, i * 100 + 64)), i), 9) for i in range(50)
    ]
    parts = split_snapshot(9, events, 8 * 1024)
    assert len(parts) > 1
    assert all(len(p) <= 8 * 1024 for p in parts)
    decoded = [decode_snapshot_part(p) for p in parts]
    assert [p.part for p in decoded] == list(range(len(parts)))
    assert {p.parts for p in decoded} == {len(parts)}
    assert [e for p in decoded for e in p.events] == events
    one = SnapshotPart(9, 0, 1, tuple(events[:2]))
    assert decode_snapshot_part(encode_snapshot_part(one)) == one
    assert decode_snapshot_part(split_snapshot(9, [], 1024)[0]) == SnapshotPart(9, 0, 1, ())


def test_snapshot_refusals() -> None:
    done = ActiveSequenceEvent("r", (1, 0), MARK_PREFILL_COMPLETED, 5)
    with pytest.raises(BadMessage, match=r"\$\.events\[0\]\.data: expected an AddRequest or Free"):
        decode_snapshot_part(encode_snapshot_part(SnapshotPart(1, 0, 1, (done,))))
    free = ActiveSequenceEvent("r", (1, 0), FREE, 5)  # a tombstone: a request freed lately
    assert decode_snapshot_part(encode_snapshot_part(SnapshotPart(1, 0, 1, (free,)))).events == (free,)
    with pytest.raises(BadMessage, match=r"\$\.part: expected an integer below parts"):
        decode_snapshot_part(b'{"router_id": 1, "part": 2, "parts": 2, "events": []}')


def test_subjects_are_the_references_under_namespace_and_component() -> None:
    subjects = Subjects()
    assert subjects.active_sequences == "namespace.dynamo.component.backend.active_sequences_events"
    assert Subjects("ns1", "router-a").snapshot_of(7) == (
        "namespace.ns1.component.router-a.kvrouter_active_sequences_snapshot.7"
    )
    for bad in ("", "a.b", "a*", "a b", ">"):
        with pytest.raises(ConfigError, match="namespace"):
            Subjects(bad, "backend")
