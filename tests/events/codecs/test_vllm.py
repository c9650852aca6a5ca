from __future__ import annotations

import itertools
from typing import Any, Literal

import msgpack
import pytest
from hypothesis import given

from kvrouter.errors import BadEvent, EncodeError
from kvrouter.events.codecs import vllm
from kvrouter.events.codecs._fields import expect_hash
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
from kvrouter.hashing import block_hashes
from tests.conftest import (
    ENGINES,
    captured_payloads,
    engine_batches,
    load_engine_frames,
    twin_fields,
    with_twin_lora,
)

WORKER_ID = 7
BLOCK_SIZE = 4
"""For the synthetic batches below; the captured ones state their own block size."""

VllmFrames = tuple[str, dict[str, Any], dict[str, Any]]


@pytest.fixture(scope="module", params=[name for name in ENGINES if name.startswith("vllm-")])
def vllm_frames(request: pytest.FixtureRequest) -> VllmFrames:
    return request.param, *load_engine_frames(request.param)


def test_encoder_writes_what_vllm_published(vllm_frames: VllmFrames):
    """Same msgpack tree, key order included, for every captured batch, LoRA stores included (their name
    taken from the twin: the decoder keeps only the hashes it makes with it); msgpack-python re-packs the
    capture to even out header widths."""
    engine, captured, twin = vllm_frames
    decoder = vllm.Decoder(WORKER_ID, twin["scenario"]["block_size"])
    encoder = vllm.Encoder(twin["scenario"]["event_encoding"])
    compared = lora = 0
    for payload, expected in captured_payloads(captured, twin):
        events = expected["payload"][1]
        repacked = msgpack.packb(msgpack.unpackb(payload, raw=False), use_bin_type=True)
        assert encoder.encode(with_twin_lora(decoder.decode(payload), events)) == repacked
        compared += 1
        lora += any(twin_fields(e).get("lora_name") is not None for e in events)
    assert compared > 0
    assert lora > 0 or engine == "vllm-0.23.0"  # its capture ran no adapter


@pytest.mark.parametrize("encoding", ["map", "array"])
@given(
    batch=engine_batches(
        worker_id=WORKER_ID,
        block_size=BLOCK_SIZE,
        tiers=[StorageTier.DEVICE, StorageTier.HOST, StorageTier.DISK],
        max_blocks=3,
    )
)
def test_round_trip(encoding: Literal["map", "array"], batch: EventBatch):
    assert vllm.Decoder(WORKER_ID, BLOCK_SIZE).decode(vllm.Encoder(encoding).encode(batch)) == batch


# --- synthetic batches: one behaviour each ---------------------------------------------------------------

TOKENS = list(range(100, 108))
"""Two blocks of BLOCK_SIZE tokens."""


def _payload(*events: object, rank: object = 0, ts: object = 1.5) -> bytes:
    packed: bytes = msgpack.packb([ts, list(events), rank], use_bin_type=True)
    return packed


def _stored(**fields: object) -> dict[str, object]:
    event: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": TOKENS,
        "block_size": BLOCK_SIZE,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    event.update(fields)
    return event


def _decode(payload: bytes, first_event_id: int = 0) -> EventBatch:
    return vllm.Decoder(WORKER_ID, BLOCK_SIZE).decode(payload, first_event_id=first_event_id)


def _blocks(hashes: list[int], local: list[int], tokens: list[int]) -> tuple[StoredBlock, ...]:
    return tuple(
        StoredBlock(EngineHash(h), LocalHash(lh), tuple(tokens[j * BLOCK_SIZE : (j + 1) * BLOCK_SIZE]))
        for j, (h, lh) in enumerate(zip(hashes, local, strict=False))
    )


PLAIN = _blocks([11, 12], block_hashes(TOKENS, BLOCK_SIZE), TOKENS)


def test_map_and_array_events_decode_alike():
    as_map = _decode(_payload(_stored(), {"type": "BlockRemoved", "block_hashes": [12], "medium": "CPU"}))
    as_array = _decode(
        _payload(
            ["BlockStored", [11, 12], None, TOKENS, BLOCK_SIZE, None, "GPU", None, None, 0, None, None],
            ["BlockRemoved", [12], "CPU", 0],
        )
    )
    assert as_map == as_array
    assert as_map.events == (
        Stored(WORKER_ID, None, PLAIN, event_id=0),
        Removed(WORKER_ID, (EngineHash(12),), event_id=1, tier=StorageTier.HOST),
    )


def test_unknown_keys_short_arrays_and_trailing_elements_are_accepted():
    """0.9.0 arrays stop after lora_id; newer versions may append; maps may grow keys (locality, ...)."""
    expected = _decode(_payload(_stored()))
    assert _decode(_payload(_stored(locality="LOCAL", ownership="x", lookahead_token_ids=[[1]]))) == expected
    assert _decode(_payload(["BlockStored", [11, 12], None, TOKENS, BLOCK_SIZE, None])) == expected
    long_array = ["BlockStored", [11, 12], None, TOKENS, BLOCK_SIZE, None, "GPU", None, None, 0, None, None, "x", 9]
    assert _decode(_payload(long_array)) == expected
    assert _decode(_payload(["AllBlocksCleared", "extra"])).events == (Cleared(WORKER_ID),)


def test_two_item_batch_and_nil_rank_mean_rank_0():
    two_items: bytes = msgpack.packb([1.5, [{"type": "AllBlocksCleared"}]])
    assert _decode(two_items) == EventBatch((Cleared(WORKER_ID),), timestamp=1.5, dp_rank=0)
    assert _decode(_payload({"type": "AllBlocksCleared"}, rank=None)).dp_rank == 0
    assert _decode(_payload({"type": "AllBlocksCleared"}, rank=3)).events == (Cleared(WORKER_ID, dp_rank=3),)


def test_hash_forms_all_cast_to_u64():
    digest = bytes(range(32))
    batch = _decode(_payload(_stored(block_hashes=[-1, digest], parent_block_hash=-2)))
    (event,) = batch.events
    assert isinstance(event, Stored)
    assert event.parent == 2**64 - 2
    assert [b.engine_hash for b in event.blocks] == [2**64 - 1, int.from_bytes(digest, "big") % 2**64]


def test_event_ids_count_from_first_event_id():
    batch = _decode(_payload({"type": "AllBlocksCleared"}, _stored(), {"type": "AllBlocksCleared"}), 41)
    assert [e.event_id for e in batch.events] == [41, 42, 43]


def test_other_block_size_drops_every_block_but_keeps_the_event():
    batch = _decode(_payload(_stored(block_size=BLOCK_SIZE * 2, parent_block_hash=5)))
    assert batch.events == (Stored(WORKER_ID, EngineHash(5), ()),)


def test_blocks_without_a_full_block_of_tokens_are_dropped():
    batch = _decode(_payload(_stored(token_ids=TOKENS[:-1])))
    assert batch.events == (Stored(WORKER_ID, None, PLAIN[:1]),)


def test_lora_name_salts_the_local_hashes():
    (event,) = _decode(_payload(_stored(lora_name="adapter", lora_id=3, extra_keys=[["adapter"], ["adapter"]]))).events
    assert event == Stored(
        WORKER_ID, None, _blocks([11, 12], block_hashes(TOKENS, BLOCK_SIZE, lora_name="adapter"), TOKENS)
    )


def test_multimodal_extra_keys_are_hashed_and_a_later_blocks_strings_are_not():
    """Only a request's first block carries its salt (vLLM's ``generate_block_hash_extra_keys``): the
    second block's strings are LoRA names or digests, never read as one."""
    mm_id = "0123456789abcdef" + "f" * 48
    extra_keys = [[[mm_id, 0]], ["adapter", "a" * 63]]
    (event,) = _decode(_payload(_stored(extra_keys=extra_keys))).events
    mm_infos = [{"mm_objects": [{"mm_hash": 0x0123456789ABCDEF, "offsets": []}]}, None]
    assert event == Stored(
        WORKER_ID, None, _blocks([11, 12], block_hashes(TOKENS, BLOCK_SIZE, mm_infos=mm_infos), TOKENS)
    )
    assert _decode(_payload(_stored(extra_keys=[[mm_id], None]))) == _decode(_payload(_stored(extra_keys=extra_keys)))


def test_a_cache_salt_in_the_first_blocks_extra_keys_salts_its_chain():
    """vLLM mixes a request's ``cache_salt`` into its first block's extra keys after the LoRA name and the
    multimodal keys; every block of the chain is hashed with it, the blocks stored under it later too, until
    they are removed or cleared; a store under an unsalted block stays unsalted."""
    mm_id = "0123456789abcdef" + "f" * 48
    decoder = vllm.Decoder(WORKER_ID, BLOCK_SIZE)
    salted = _stored(lora_name="adapter", extra_keys=[["adapter", [mm_id, 0], "tenant-a"], ["adapter"]])
    mm_infos = [{"mm_objects": [{"mm_hash": 0x0123456789ABCDEF, "offsets": []}]}, None]
    root_local = block_hashes(TOKENS, BLOCK_SIZE, lora_name="adapter", cache_namespace="tenant-a", mm_infos=mm_infos)
    more = list(range(200, 204))
    under = _stored(block_hashes=[13], parent_block_hash=12, token_ids=more, lora_name="adapter")
    plain_under = _stored(block_hashes=[23], parent_block_hash=22, token_ids=more, lora_name="adapter")
    batch = decoder.decode(_payload(salted, under, plain_under))
    root, child, plain_child = batch.events
    assert root == Stored(WORKER_ID, None, _blocks([11, 12], root_local, TOKENS))
    salted_local = block_hashes(more, BLOCK_SIZE, lora_name="adapter", cache_namespace="tenant-a")
    assert child == Stored(WORKER_ID, EngineHash(12), _blocks([13], salted_local, more), event_id=1)
    plain_local = block_hashes(more, BLOCK_SIZE, lora_name="adapter")
    assert plain_child == Stored(WORKER_ID, EngineHash(22), _blocks([23], plain_local, more), event_id=2)
    removed = {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}
    (_, again) = decoder.decode(_payload(removed, under)).events  # 12 gone: its salt with it
    assert again == Stored(WORKER_ID, EngineHash(12), _blocks([13], plain_local, more), event_id=1)
    decoder.decode(_payload(_stored(extra_keys=[["tenant-b"], None]), {"type": "AllBlocksCleared"}))
    (after,) = decoder.decode(_payload(under)).events
    assert isinstance(after, Stored)
    assert after.blocks == _blocks([13], plain_local, more)


def test_the_encoder_writes_a_salt_where_vllm_does_and_the_decoder_reads_it_back():
    salt_blocks = _blocks([11, 12], block_hashes(TOKENS, BLOCK_SIZE, cache_namespace="t"), TOKENS)
    root = Stored(WORKER_ID, None, salt_blocks, cache_salt="t")
    more = list(range(200, 204))
    child_blocks = _blocks([13], block_hashes(more, BLOCK_SIZE, cache_namespace="t"), more)
    child = Stored(WORKER_ID, EngineHash(12), child_blocks, event_id=1, cache_salt="t")
    for encoding in ("map", "array"):
        payload = vllm.Encoder(encoding).encode(EventBatch((root, child), timestamp=1.0))
        events = msgpack.unpackb(payload, raw=False)[1]
        keys = [e.get("extra_keys") if encoding == "map" else e[8] for e in events]
        assert keys == [[["t"], None], None]  # the first block of the request only
        decoded = vllm.Decoder(WORKER_ID, BLOCK_SIZE).decode(payload).events
        assert [e.blocks for e in decoded] == [salt_blocks, child_blocks]  # type: ignore[union-attr]


def test_eagle_bigram_token_ids_hash_overlapping_windows():
    tokens = [*TOKENS, 108]
    pairs = [list(pair) for pair in itertools.pairwise(tokens)]
    (event,) = _decode(_payload(_stored(token_ids=pairs))).events
    assert event == Stored(WORKER_ID, None, _blocks([11, 12], block_hashes(tokens, BLOCK_SIZE, eagle=True), tokens))


def test_only_the_main_attention_group_is_kept_and_skipped_events_take_no_id():
    events = [
        _stored(group_idx=1),
        _stored(kv_cache_spec_kind="sliding_window", group_idx=0),
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 2},
        ["BlockStored", [11, 12], None, TOKENS, BLOCK_SIZE, None, "GPU", None, None, 0, "mamba", None],
        _stored(kv_cache_spec_kind="mla_attention"),
        _stored(group_idx=0, kv_cache_spec_kind="full_attention"),
        {"type": "AllBlocksCleared"},
    ]
    batch = _decode(_payload(*events), first_event_id=10)
    assert batch.events == (
        Stored(WORKER_ID, None, PLAIN, event_id=10),
        Stored(WORKER_ID, None, PLAIN, event_id=11),
        Cleared(WORKER_ID, event_id=12),
    )


@pytest.mark.parametrize(
    ("medium", "tier"), [("GPU", "device"), ("CPU", "host"), ("STORAGE", "disk"), (None, "device")]
)
def test_medium_gives_the_tier(medium: str | None, tier: str):
    (event,) = _decode(_payload(_stored(medium=medium))).events
    assert event.tier is StorageTier(tier)


# --- malformed input: BadEvent, naming the place -----------------------------------------------------------

MALFORMED = {
    "garbage-bytes": (b"\xc1\xc1\xc1", r"^vllm batch: not msgpack: "),
    "truncated-msgpack": (_payload(_stored())[:-5], r"^vllm batch: not msgpack: "),
    "invalid-utf8": (b"\x93\xcb" + bytes(8) + b"\x91\xa1\xff\x00", r"^vllm batch: not msgpack: "),
    "batch-not-an-array": (msgpack.packb({"ts": 1.0}), r"^vllm batch: \$: expected an array, got dict$"),
    "batch-too-short": (msgpack.packb([1.0]), r"^vllm batch: \$: expected \[ts, events, dp_rank\]"),
    "ts-not-a-number": (_payload(ts="now"), r"^vllm batch: \$\[0\]: expected a number, got str$"),
    "events-not-an-array": (msgpack.packb([1.0, {}, 0]), r"^vllm batch: \$\[1\]: expected an array, got dict$"),
    "negative-dp-rank": (_payload(rank=-1), r"^vllm batch: \$\[2\]: -1 is outside \[0, 2147483647\]$"),
    "event-not-map-or-array": (_payload(5), r"^vllm batch: \$\[1\]\[0\]: expected an event map or array, got int$"),
    "event-without-type": (_payload({"block_hashes": []}), r"^vllm batch: \$\[1\]\[0\]: missing field 'type'$"),
    "unknown-event-type": (
        _payload({"type": "AllBlocksCleared"}, {"type": "BlockMoved"}),
        r"^vllm batch: \$\[1\]\[1\]: unknown event type 'BlockMoved'; expected 'BlockStored', ",
    ),
    "unknown-array-tag": (_payload(["BlockMoved", [1]]), r"^vllm batch: \$\[1\]\[0\]: unknown event type 'BlockMoved'"),
    "empty-event-array": (_payload([]), r"^vllm batch: \$\[1\]\[0\]: empty event array"),
    "string-hash": (
        _payload(_stored(block_hashes=[11, "12"])),
        r"^vllm batch: \$\[1\]\[0\]\.block_hashes\[1\]: expected an integer or bytes hash, got str$",
    ),
    "string-parent": (
        _payload(_stored(parent_block_hash="0x1")),
        r"^vllm batch: \$\[1\]\[0\]\.parent_block_hash: expected an integer or bytes hash, got str$",
    ),
    "removed-hash-float": (
        _payload({"type": "BlockRemoved", "block_hashes": [1.5], "medium": "GPU"}),
        r"^vllm batch: \$\[1\]\[0\]\.block_hashes\[0\]: expected an integer or bytes hash, got float$",
    ),
    "missing-token-ids": (
        _payload({k: v for k, v in _stored().items() if k != "token_ids"}),
        r"^vllm batch: \$\[1\]\[0\]: missing field 'token_ids'$",
    ),
    "missing-token-ids-array": (
        _payload(["BlockStored", [11], None]),
        r"^vllm batch: \$\[1\]\[0\]: missing field 'token_ids'$",
    ),
    "missing-block-hashes": (
        _payload({"type": "BlockRemoved"}),
        r"^vllm batch: \$\[1\]\[0\]: missing field 'block_hashes'$",
    ),
    "token-minus-1": (
        _payload(_stored(token_ids=[*TOKENS[:3], -1, *TOKENS[4:]])),
        r"^vllm batch: \$\[1\]\[0\]\.token_ids\[3\]: -1 is outside \[0, 4294967295\]$",
    ),
    "token-beyond-u32": (
        _payload(_stored(token_ids=[*TOKENS[:-1], 2**32])),
        r"^vllm batch: \$\[1\]\[0\]\.token_ids\[7\]: 4294967296 is outside \[0, 4294967295\]$",
    ),
    "token-bool": (
        _payload(_stored(token_ids=[True, *TOKENS[1:]])),
        r"^vllm batch: \$\[1\]\[0\]\.token_ids\[0\]: expected an integer, got bool$",
    ),
    "token-ids-not-an-array": (
        _payload(_stored(token_ids="abc")),
        r"^vllm batch: \$\[1\]\[0\]\.token_ids: expected an array, got str$",
    ),
    "bigram-not-a-pair": (
        _payload(_stored(token_ids=[[1, 2], [2]])),
        r"^vllm batch: \$\[1\]\[0\]\.token_ids\[1\]: expected an EAGLE \[token, next token\] pair, got 1 items$",
    ),
    "negative-block-size": (
        _payload(_stored(block_size=-4)),
        r"^vllm batch: \$\[1\]\[0\]\.block_size: -4 is outside \[0, ",
    ),
    "unknown-medium": (
        _payload(_stored(medium="TAPE")),
        r"^vllm batch: \$\[1\]\[0\]\.medium: unknown storage tier 'TAPE'",
    ),
    "lora-name-not-a-string": (
        _payload(_stored(lora_name=1)),
        r"^vllm batch: \$\[1\]\[0\]\.lora_name: expected a string or null, got int$",
    ),
    "extra-keys-block-not-an-array": (
        _payload(_stored(extra_keys=["adapter", None])),
        r"^vllm batch: \$\[1\]\[0\]\.extra_keys\[0\]: expected an array, got str$",
    ),
    "group-idx-not-an-integer": (
        _payload(_stored(group_idx="0")),
        r"^vllm batch: \$\[1\]\[0\]\.group_idx: expected an integer, got str$",
    ),
}


@pytest.mark.parametrize(("payload", "message"), MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_input_raises_bad_event_naming_the_place(payload: bytes, message: str):
    with pytest.raises(BadEvent, match=message):
        _decode(payload)


def test_hash_beyond_64_bits_cannot_reach_the_decoder():
    """msgpack has no integer above 2**64 - 1, so no payload can carry one; the hash check the decoder
    applies to every hash names such a value anyway."""
    with pytest.raises(OverflowError):
        _payload(_stored(block_hashes=[2**64]))
    with pytest.raises(
        BadEvent, match=r"^vllm batch: \$\[1\]\[0\]\.block_hashes\[0\]: hash 18446744073709551616 does not"
    ):
        expect_hash(2**64, "vllm batch: $[1][0].block_hashes[0]")


def test_decoder_refuses_a_block_size_below_1():
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        vllm.Decoder(WORKER_ID, 0)


# --- what the encoder cannot write ---------------------------------------------------------------------------

BLOCK = StoredBlock(EngineHash(1), LocalHash(2), (1, 2, 3, 4))


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (
            EventBatch((Stored(1, None, (StoredBlock(EngineHash(1), LocalHash(2)),)),)),
            r"event 0: block 0 has no token_ids",
        ),
        (
            EventBatch((Stored(1, None, (BLOCK, StoredBlock(EngineHash(3), LocalHash(4), (1, 2)))),)),
            r"event 0: blocks of one store have unequal token counts \[2, 4\]",
        ),
        (
            EventBatch((Cleared(1), Removed(1, (), tier=StorageTier.SHARED))),
            r"event 1: tier 'shared' has no vllm medium",
        ),
        (EventBatch((Cleared(1), Cleared(2))), r"one worker's events"),
        (EventBatch((Cleared(1, dp_rank=1),), dp_rank=0), r"event 0: dp rank 1 differs from the batch's 0"),
    ],
    ids=["no-tokens", "unequal-blocks", "shared-tier", "two-workers", "other-rank"],
)
def test_encoder_refuses_what_vllm_cannot_carry(batch: EventBatch, message: str):
    with pytest.raises(EncodeError, match=rf"^vllm encode: .*{message}"):
        vllm.Encoder().encode(batch)


def test_encoder_stamps_a_missing_timestamp():
    batch = _decode(vllm.Encoder().encode(EventBatch((Cleared(WORKER_ID),))))
    assert isinstance(batch.timestamp, float)
