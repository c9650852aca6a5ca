from __future__ import annotations

from typing import Any, Literal

import msgpack
import pytest
from hypothesis import given

from kvrouter.errors import BadEvent
from kvrouter.events.codecs import sglang
from kvrouter.events.model import EngineHash, EventBatch, LocalHash, StorageTier, Stored, StoredBlock
from kvrouter.hashing import block_hashes
from tests.conftest import (
    ENGINES,
    captured_payloads,
    engine_batches,
    load_engine_frames,
    with_twin_lora,
)

WORKER_ID = 3
PAGE_SIZE = 4
"""For the synthetic batches below; the captured ones state their own page size."""

SglangFrames = tuple[str, dict[str, Any], dict[str, Any]]


@pytest.fixture(scope="module", params=[name for name in ENGINES if name.startswith("sglang-")])
def sglang_frames(request: pytest.FixtureRequest) -> SglangFrames:
    return request.param, *load_engine_frames(request.param)


def test_encoder_writes_what_sglang_published(sglang_frames: SglangFrames):
    """Same msgpack tree, key order included, for every captured batch the model holds whole: LoRA stores
    included (their name taken from the twin: the decoder keeps only the hashes it makes with it), no
    partial page (its blocks are not kept)."""
    _, captured, twin = sglang_frames
    page_size = twin["scenario"]["block_size"]
    decoder = sglang.Decoder(WORKER_ID, page_size)
    encoder = sglang.Encoder(twin["scenario"]["event_encoding"])
    compared = lora = 0
    for payload, expected in captured_payloads(captured, twin):
        events = expected["payload"][1]
        if any(e.get("block_size", page_size) != page_size for e in events):
            continue
        repacked = msgpack.packb(msgpack.unpackb(payload, raw=False), use_bin_type=True)
        assert encoder.encode(with_twin_lora(decoder.decode(payload), events)) == repacked
        compared += 1
        lora += any(e.get("lora_name") is not None for e in events)
    assert compared > 0
    assert lora > 0


@pytest.mark.parametrize("encoding", ["map", "array"])
@given(batch=engine_batches(worker_id=WORKER_ID, block_size=PAGE_SIZE, tiers=list(StorageTier), max_blocks=1))
def test_round_trip(encoding: Literal["map", "array"], batch: EventBatch):
    assert sglang.Decoder(WORKER_ID, PAGE_SIZE).decode(sglang.Encoder(encoding).encode(batch)) == batch


TOKENS = list(range(200, 212))
"""Three pages of PAGE_SIZE tokens."""
HASHES = [EngineHash(2**64 - 1), EngineHash(2**63), EngineHash(5)]
LOCAL = block_hashes(TOKENS, PAGE_SIZE)
BLOCKS = tuple(
    StoredBlock(h, LocalHash(lh), tuple(TOKENS[j * PAGE_SIZE : (j + 1) * PAGE_SIZE]))
    for j, (h, lh) in enumerate(zip(HASHES, LOCAL, strict=True))
)


def _payload(*events: object) -> bytes:
    packed: bytes = msgpack.packb([2.5, list(events), 1], use_bin_type=True)
    return packed


def _decode(payload: bytes) -> EventBatch:
    return sglang.Decoder(WORKER_ID, PAGE_SIZE).decode(payload)


def test_a_store_of_several_blocks_is_written_one_page_at_a_time():
    batch = EventBatch((Stored(WORKER_ID, EngineHash(9), BLOCKS, dp_rank=1),), timestamp=2.5, dp_rank=1)
    payload = sglang.Encoder().encode(batch)
    pages = msgpack.unpackb(payload, raw=False)[1]
    assert [(p["block_hashes"], p["parent_block_hash"]) for p in pages] == [
        ([-1], 9),
        ([-(2**63)], -1),
        ([5], -(2**63)),
    ]
    decoded = _decode(payload).events
    assert [(e.parent, e.blocks) for e in decoded if isinstance(e, Stored)] == [
        (EngineHash(9), BLOCKS[:1]),
        (HASHES[0], BLOCKS[1:2]),
        (HASHES[1], BLOCKS[2:]),
    ]


def test_optional_fields_and_mediums():
    page = {
        "type": "BlockStored",
        "block_hashes": [-1],
        "parent_block_hash": None,
        "token_ids": TOKENS[:PAGE_SIZE],
        "block_size": PAGE_SIZE,
        "lora_id": None,
        "medium": "EXTERNAL",
        "cache_salt": "tenant-a",
        "session_id": "s1",
        "lora_name": "adapter",
    }
    as_array = ["BlockStored", [-1], None, TOKENS[:PAGE_SIZE], PAGE_SIZE, None, "EXTERNAL", "tenant-a", "s1", "adapter"]
    (event,) = _decode(_payload(page)).events
    assert _decode(_payload(as_array)).events == (event,)
    local = block_hashes(TOKENS[:PAGE_SIZE], PAGE_SIZE, lora_name="adapter", cache_namespace="tenant-a")
    assert event == Stored(
        WORKER_ID,
        None,
        (StoredBlock(HASHES[0], LocalHash(local[0]), tuple(TOKENS[:PAGE_SIZE])),),
        dp_rank=1,
        tier=StorageTier.SHARED,
    )
    (removed,) = _decode(_payload({"type": "BlockRemoved", "block_hashes": [-1], "medium": "CPU_PINNED"})).events
    assert removed.tier is StorageTier.HOST


def test_partial_last_page_keeps_its_event_without_blocks():
    partial = {
        "type": "BlockStored",
        "block_hashes": [7],
        "parent_block_hash": -1,
        "token_ids": [1, 2],
        "block_size": 2,
    }
    assert _decode(_payload(partial)).events == (Stored(WORKER_ID, HASHES[0], (), dp_rank=1),)


MALFORMED = {
    "garbage-bytes": (b"\xc1", r"^sglang batch: not msgpack: "),
    "unknown-event-type": (
        _payload({"type": "BlockMoved"}),
        r"^sglang batch: \$\[1\]\[0\]: unknown event type 'BlockMoved'",
    ),
    "string-hash": (
        _payload({"type": "BlockRemoved", "block_hashes": ["-1"]}),
        r"^sglang batch: \$\[1\]\[0\]\.block_hashes\[0\]: expected an integer or bytes hash, got str$",
    ),
    "missing-token-ids": (
        _payload(["BlockStored", [-1], None]),
        r"^sglang batch: \$\[1\]\[0\]: missing field 'token_ids'$",
    ),
    "token-minus-1": (
        _payload({"type": "BlockStored", "block_hashes": [1], "token_ids": [-1, 2, 3, 4], "block_size": PAGE_SIZE}),
        r"^sglang batch: \$\[1\]\[0\]\.token_ids\[0\]: -1 is outside \[0, 4294967295\]$",
    ),
    "unknown-medium": (
        _payload({"type": "BlockRemoved", "block_hashes": [1], "medium": "NVME"}),
        r"^sglang batch: \$\[1\]\[0\]\.medium: unknown storage tier 'NVME'",
    ),
}


@pytest.mark.parametrize(("payload", "message"), MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_input_raises_bad_event_naming_the_place(payload: bytes, message: str):
    with pytest.raises(BadEvent, match=message):
        _decode(payload)
