from __future__ import annotations

import msgpack
import pytest
from hypothesis import given

from kvrouter.errors import BadEvent, EncodeError
from kvrouter.events.codecs import kvrouter
from kvrouter.events.model import Cleared, EngineHash, EventBatch, LocalHash, Removed, Stored, StoredBlock
from tests.strategies import batches


@given(batches(with_tokens=True))
def test_round_trip_with_tokens(batch: EventBatch):
    assert kvrouter.Decoder().decode(kvrouter.Encoder(with_tokens=True).encode(batch)) == batch


@given(batches(with_tokens=True))
def test_tokens_are_optional(batch: EventBatch):
    decoded = kvrouter.Decoder().decode(kvrouter.Encoder().encode(batch))
    for got, sent in zip(decoded.events, batch.events, strict=True):
        if isinstance(sent, Stored):
            assert isinstance(got, Stored)
            assert all(b.token_ids is None for b in got.blocks)
            assert [(b.engine_hash, b.local_hash) for b in got.blocks] == [
                (b.engine_hash, b.local_hash) for b in sent.blocks
            ]
        else:
            assert got == sent


def test_hashes_travel_packed():
    blocks = tuple(StoredBlock(EngineHash(2**64 - 1 - i), LocalHash(i)) for i in range(64))
    payload = kvrouter.Encoder().encode(EventBatch((Stored(1, None, blocks),)))
    assert len(payload) < 64 * 16 + 64  # 16 bytes a block plus a small envelope


def test_encoder_refuses_mixed_workers_and_ranks():
    with pytest.raises(EncodeError, match="one worker"):
        kvrouter.Encoder().encode(EventBatch((Cleared(1), Cleared(2))))
    with pytest.raises(EncodeError, match="dp rank"):
        kvrouter.Encoder().encode(EventBatch((Cleared(1, dp_rank=1),), dp_rank=0))


def _batch(*events: object, **overrides: object) -> bytes:
    body = {"v": 1, "ts": 1.0, "worker_id": 1, "dp_rank": 0, "events": list(events), **overrides}
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


@pytest.mark.parametrize(
    ("payload", "names"),
    [
        (b"\xc1", "not msgpack"),
        (b"\x93\x01", "not msgpack"),
        (msgpack.packb([1, 2]), "expected a map"),
        (_batch(v=2), "unsupported version 2"),
        (_batch(worker_id=-1), "$.worker_id"),
        (_batch(["X", 1, "device"]), "$.events[0][0]: unknown event tag 'X'"),
        (_batch(["C", 1, "vram"]), "$.events[0][2]: unknown storage tier 'vram'"),
        (_batch(["S", 1, "device", None, b"\x00" * 8, b"\x00" * 7, None]), "$.events[0][5]: 7 bytes"),
        (_batch(["S", 1, "device", None, b"\x00" * 8, b"", None]), "1 engine hashes but 0 local hashes"),
        (_batch(["S", 1, "device", None, b"\x00" * 16, b"\x00" * 16, b"\x00" * 12]), "split evenly"),
        (_batch(["R", 1, "device", [1, 2]]), "$.events[0][3]: expected packed bytes"),
        (_batch(["R", 1]), "expected [tag, event_id, tier, ...]"),
    ],
)
def test_malformed_input_names_the_place(payload: bytes, names: str):
    with pytest.raises(BadEvent) as info:
        kvrouter.Decoder().decode(payload)
    assert names in str(info.value)


def test_unknown_trailing_elements_are_ignored():
    payload = _batch(["R", 5, "host", (7).to_bytes(8, "little"), "future field"])
    (event,) = kvrouter.Decoder().decode(payload).events
    assert isinstance(event, Removed)
    assert event.engine_hashes == (EngineHash(7),)
