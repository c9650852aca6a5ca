from __future__ import annotations

import json
from typing import Any

import pytest
from dynamo._core import RadixTree
from hypothesis import given

from kvrouter.errors import BadEvent
from kvrouter.events.codecs import dynamo
from kvrouter.events.model import (
    Cleared,
    EngineHash,
    EventBatch,
    LocalHash,
    Removed,
    StorageTier,
    Stored,
    StoredBlock,
)
from tests.strategies import batches


def test_contract_events_decode_exactly_when_the_reference_accepts_them(contract_scenario: dict[str, Any]):
    """Every event of the contract fixtures: bad_event expectations raise BadEvent, all others decode."""
    for i, op in enumerate(contract_scenario["ops"]):
        if op["op"] != "apply_event":
            continue
        if op["expect_error"] == "bad_event":
            with pytest.raises(BadEvent):
                dynamo.event_from_dict(op["event"], op["worker_id"])
        else:
            event = dynamo.event_from_dict(op["event"], op["worker_id"])
            assert event.worker_id == op["worker_id"], f"op {i}"
            assert event.dp_rank == op["event"].get("dp_rank", 0)


def test_decodes_each_variant():
    decoder = dynamo.Decoder(worker_id=7)
    stored = (
        b'{"event_id":3,"dp_rank":1,"data":{"stored":{"parent_hash":9,"blocks":[{"block_hash":1,"tokens_hash":2}]}}}'
    )
    assert decoder.decode(stored).events == (
        Stored(7, EngineHash(9), (StoredBlock(EngineHash(1), LocalHash(2)),), dp_rank=1, event_id=3),
    )
    removed = b'{"event_id":4,"data":{"removed":{"block_hashes":[1,2]}}}'
    assert decoder.decode(removed).events == (Removed(7, (EngineHash(1), EngineHash(2)), event_id=4),)
    assert decoder.decode(b'{"event_id":5,"data":"cleared","extra":1}').events == (Cleared(7, event_id=5),)


def test_parent_hash_may_be_absent():
    event = dynamo.event_from_dict({"event_id": 0, "data": {"stored": {"blocks": []}}}, 1)
    assert isinstance(event, Stored)
    assert event.parent is None


def test_router_events_carry_worker_and_tier():
    record = {"worker_id": 3, "storage_tier": "host_pinned", "event": {"event_id": 1, "data": "cleared"}}
    batch = dynamo.Decoder(worker_id=0).decode(json.dumps([record]).encode())
    assert batch.events == (Cleared(3, event_id=1, tier=StorageTier.HOST),)


@pytest.mark.parametrize(
    ("payload", "names"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "$[0]: expected a map"),
        (b'{"data":"cleared"}', "missing field 'event_id'"),
        (b'{"event_id":1,"data":{"stored":{"blocks":[{"block_hash":1}]}}}', "$.data.stored.blocks[0]"),
        (b'{"event_id":1,"data":{"stored":{},"removed":{}}}', "exactly one of"),
        (b'{"event_id":1,"dp_rank":4294967296,"data":"cleared"}', "$.dp_rank"),
        (b'{"event_id":1,"data":{"removed":{"block_hashes":[true]}}}', "block_hashes[0]: expected an integer"),
        (b'[{"worker_id":1,"storage_tier":"vram","event":{"event_id":1,"data":"cleared"}}]', "storage_tier"),
    ],
)
def test_malformed_input_names_the_place(payload: bytes, names: str):
    with pytest.raises(BadEvent, match=None) as info:
        dynamo.Decoder(worker_id=1).decode(payload)
    assert names in str(info.value)
    assert info.value.kind == "bad_event"


@given(batches())
def test_round_trip(batch: EventBatch):
    decoded = dynamo.Decoder(worker_id=0).decode(dynamo.Encoder().encode(batch))
    assert decoded.events == batch.events


def test_reference_reads_what_we_write_and_we_read_its_dump():
    tree = RadixTree()
    encoder = dynamo.Encoder()
    blocks = tuple(StoredBlock(EngineHash(100 + i), LocalHash(i + 1)) for i in range(3))
    tree.apply_event(1, encoder.encode_event(Stored(1, None, blocks, dp_rank=2, event_id=0)))
    tree.apply_event(1, encoder.encode_event(Removed(1, (EngineHash(102),), dp_rank=2, event_id=1)))
    scores: object = tree.find_matches([1, 2, 3]).scores  # the stub's dict[int, int] is wrong: keys are pairs
    assert scores == {(1, 2): 2}
    dump = [json.loads(line) for line in tree.dump_tree_as_events()]
    events = dynamo.Decoder(worker_id=0).decode(json.dumps(dump).encode()).events
    rebuilt = [
        (e.worker_id, e.dp_rank, b.engine_hash, b.local_hash) for e in events if isinstance(e, Stored) for b in e.blocks
    ]
    assert rebuilt == [(1, 2, EngineHash(100), LocalHash(1)), (1, 2, EngineHash(101), LocalHash(2))]
