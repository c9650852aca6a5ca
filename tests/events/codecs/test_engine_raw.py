"""``EngineDecoder.decode_raw``, the applier's array path, against ``decode`` and an oracle written here.

The oracle (:func:`_expected`) reads the wire fields a test generated, not the codec, so a decoder bug
shows up as a disagreement instead of being copied into the expectation.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvrouter.errors import BadEvent
from kvrouter.events.codecs import sglang, vllm
from kvrouter.events.codecs._engine import EngineDecoder
from kvrouter.events.codecs.kvrouter import RawBatch
from kvrouter.events.model import (
    Cleared,
    EngineHash,
    EventBatch,
    KvEvent,
    LocalHash,
    Removed,
    Stored,
    StoredBlock,
    parse_tier,
)
from kvrouter.hashing import block_hashes
from tests.conftest import captured_payloads, expected_engine_event, twin_fields
from tests.strategies import u32, u64

WORKER_ID = 3
BLOCK_SIZE = 4
DECODERS: dict[str, type[EngineDecoder]] = {"vllm": vllm.Decoder, "sglang": sglang.Decoder}
MAIN_KINDS = {"full_attention", "mla_attention", "sink_full_attention"}
MM_ID = "0123456789abcdef" + "e" * 48
"""A 64-hex-digit multimodal identifier, as vLLM writes them in ``extra_keys``."""


def _to_u64(value: int | bytes) -> int:
    return int.from_bytes(value, "big") % 2**64 if isinstance(value, bytes) else value % 2**64


def _main(fields: Mapping[str, Any]) -> bool:
    kind = fields.get("kv_cache_spec_kind")
    return kind in MAIN_KINDS if kind is not None else fields.get("group_idx") in (None, 0)


def _mm_infos(extra_keys: Sequence[Any] | None) -> list[dict[str, Any] | None] | None:
    if extra_keys is None:
        return None
    infos: list[dict[str, Any] | None] = []
    for keys in extra_keys:
        ids = [k[0] if isinstance(k, list) else k for k in keys or ()]
        mm = [int(k[:16], 16) for k in ids if k == MM_ID]
        infos.append({"mm_objects": [{"mm_hash": h, "offsets": []} for h in mm]} if mm else None)
    return infos


def _salt(engine: str, fields: Mapping[str, Any], parent: int | None, salts: Mapping[int, str]) -> str | None:
    """A store's cache salt: SGLang's field; vLLM's last string of a root store's first block's extra keys that
    is not its LoRA name (first) or a multimodal identifier, or its parent's."""
    if engine == "sglang":
        return fields.get("cache_salt") or None
    if parent is not None:
        return salts.get(parent)
    keys = fields.get("extra_keys")
    if not keys or not isinstance(keys[0], list):
        return None
    first = keys[0][1:] if fields.get("lora_name") and keys[0][:1] == [fields["lora_name"]] else keys[0]
    texts = [k for k in first if isinstance(k, str) and k and k != MM_ID]
    return texts[-1] if texts else None


def _expected(
    engine: str, fields_seen: Sequence[Mapping[str, Any]], dp_rank: int, first_id: int
) -> tuple[list[KvEvent], int, int]:
    """(model events, skipped events, dropped blocks) the decoder must give for these wire events."""
    events: list[KvEvent] = []
    skipped = dropped = 0
    salts: dict[int, str] = {}
    for fields in fields_seen:
        event_id = first_id + len(events)
        if fields["type"] == "AllBlocksCleared":
            events.append(Cleared(WORKER_ID, dp_rank=dp_rank, event_id=event_id))
            salts.clear()
            continue
        if not _main(fields):
            skipped += 1
            continue
        hashes = [EngineHash(_to_u64(h)) for h in fields["block_hashes"]]
        tier = parse_tier(fields.get("medium"))
        if fields["type"] == "BlockRemoved":
            events.append(Removed(WORKER_ID, tuple(hashes), dp_rank=dp_rank, event_id=event_id, tier=tier))
            for gone in hashes:
                salts.pop(gone, None)
            continue
        token_ids = fields["token_ids"]
        eagle = bool(token_ids) and isinstance(token_ids[0], list)
        tokens = [p[0] for p in token_ids] + [token_ids[-1][1]] if eagle else list(token_ids)
        blocks: list[StoredBlock] = []
        parent = fields.get("parent_block_hash")
        parent = None if parent is None else EngineHash(_to_u64(parent))
        salt = _salt(engine, fields, parent, salts)
        if fields["block_size"] == BLOCK_SIZE:
            local = block_hashes(
                tokens,
                BLOCK_SIZE,
                lora_name=fields.get("lora_name"),
                cache_namespace=salt,
                mm_infos=_mm_infos(fields.get("extra_keys")),
                eagle=eagle,
            )
            blocks = [
                StoredBlock(h, LocalHash(lh), tuple(tokens[j * BLOCK_SIZE : (j + 1) * BLOCK_SIZE]))
                for j, (h, lh) in enumerate(zip(hashes, local, strict=False))
            ]
            if salt:
                salts.update((block.engine_hash, salt) for block in blocks)
        dropped += len(hashes) - len(blocks)
        events.append(Stored(WORKER_ID, parent, tuple(blocks), dp_rank=dp_rank, event_id=event_id, tier=tier))
    return events, skipped, dropped


def _model(raw: RawBatch, block_size: int = BLOCK_SIZE) -> list[KvEvent]:
    """What ``decode`` builds from a raw batch, spelled out here from the arrays alone."""
    out: list[KvEvent] = []
    for e in raw.events:
        common: dict[str, Any] = {"dp_rank": raw.dp_rank, "event_id": e.event_id, "tier": e.tier}
        assert e.engine.dtype == np.uint64
        assert e.local.dtype == np.uint64
        if e.tag == "C":
            out.append(Cleared(raw.worker_id, **common))
        elif e.tag == "R":
            out.append(Removed(raw.worker_id, tuple(e.engine.tolist()), **common))
        else:
            assert e.tokens is not None
            assert e.tokens.dtype == np.uint32
            assert len(e.tokens) == block_size * len(e.engine) == block_size * len(e.local)
            tokens = e.tokens.tolist()
            blocks = tuple(
                StoredBlock(h, lh, tuple(tokens[j * block_size : (j + 1) * block_size]))
                for j, (h, lh) in enumerate(zip(e.engine.tolist(), e.local.tolist(), strict=True))
            )
            out.append(Stored(raw.worker_id, e.parent, blocks, **common))
    return out


# --- the captured frames ------------------------------------------------------------------------------------


def test_captured_frames_decode_raw_as_decode_and_the_twin(engine_frames: tuple[str, Any, Any]):
    """Every live and replayed batch: the same events as ``decode`` and as the twin says; SGLang's partial
    pages are counted as dropped blocks."""
    _, captured, twin = engine_frames
    block_size = twin["scenario"]["block_size"]
    decoder = DECODERS[twin["engine"]](WORKER_ID, block_size)
    for payload, expected in captured_payloads(captured, twin):
        ts, twin_events, rank = expected["payload"]
        raw = decoder.decode_raw(payload, first_event_id=7)
        decoded = decoder.decode(payload, first_event_id=7)
        assert (raw.worker_id, raw.dp_rank, raw.timestamp) == (WORKER_ID, rank, ts)
        assert EventBatch(tuple(_model(raw, block_size)), timestamp=ts, dp_rank=rank) == decoded
        assert decoded.events == tuple(
            expected_engine_event(e, worker_id=WORKER_ID, dp_rank=rank, event_id=7 + i, block_size=block_size)
            for i, e in enumerate(twin_events)
        )
        fields = [twin_fields(e) for e in twin_events]
        assert raw.skipped_events == 0
        assert raw.dropped_blocks == sum(
            len(f["block_hashes"]) for f in fields if f["type"] == "BlockStored" and f["block_size"] != block_size
        )


# --- generated wire batches ---------------------------------------------------------------------------------

i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
hashes = st.one_of(u64, i64, st.binary(min_size=1, max_size=32))
tokens = st.one_of(st.integers(0, 2), u32)
"""0 and 1 included: msgpack booleans read as ints 0 and 1 by anything that does not check types."""


@st.composite
def wire_event(draw: st.DrawFn, engine: str) -> dict[str, Any]:
    """One engine event's fields as a publisher could write them, odd cases included."""
    kind = draw(st.sampled_from(["stored", "stored", "stored", "removed", "cleared"]))
    if kind == "cleared":
        return {"type": "AllBlocksCleared"}
    mediums = ["GPU", "CPU", "STORAGE"] if engine == "vllm" else ["GPU", "CPU_PINNED", "DISK", "EXTERNAL"]
    fields: dict[str, Any] = {"medium": draw(st.sampled_from([None, *mediums]))}
    fields["group_idx"] = draw(st.sampled_from([None, 0, 0, 1]))
    fields["kv_cache_spec_kind"] = draw(st.sampled_from([None, None, "full_attention", "sliding_window"]))
    if kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": draw(st.lists(hashes, max_size=4)), **fields}
    count = draw(st.integers(0, 4))
    size = draw(st.sampled_from([BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE * 2, 1]))
    length = max(0, count * size + draw(st.integers(-size, size)))  # short, whole or with extra tokens
    ids = draw(st.lists(tokens, min_size=length, max_size=length))
    bigrams: bool = draw(st.booleans())
    if ids and bigrams:  # EAGLE bigrams: len(ids) - 1 pairs
        token_ids: list[Any] = [list(pair) for pair in itertools.pairwise(ids)] or ids
    else:
        token_ids = ids
    extra_key = st.sampled_from([MM_ID, [MM_ID, 0], "salt", "a" * 63, "adapter"])
    return {
        "type": "BlockStored",
        "block_hashes": draw(st.lists(hashes, min_size=count, max_size=count)),
        "parent_block_hash": draw(st.none() | hashes),
        "token_ids": token_ids,
        "block_size": size,
        "lora_id": None,
        "lora_name": draw(st.sampled_from([None, "", "adapter"])),
        "extra_keys": draw(st.none() | st.lists(st.none() | st.lists(extra_key, max_size=3), max_size=count)),
        "cache_salt": draw(st.sampled_from([None, "", "tenant"])),
        **fields,
    }


def _as_wire(fields: Mapping[str, Any], layout: Mapping[str, Sequence[str]], encoding: str) -> Any:
    if encoding == "map":
        return dict(fields)
    return [fields["type"], *(fields.get(name) for name in layout.get(fields["type"], ()))]


def _seen(fields: Mapping[str, Any], layout: Mapping[str, Sequence[str]], encoding: str) -> Mapping[str, Any]:
    """The fields a decoder can see once the event is on the wire (an array carries only its layout)."""
    if encoding == "map":
        return fields
    return {"type": fields["type"], **{name: fields.get(name) for name in layout.get(fields["type"], ())}}


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_generated_batches_decode_raw_as_decode_and_the_oracle(engine: str, encoding: str, data: st.DataObject):
    decoder = DECODERS[engine](WORKER_ID, BLOCK_SIZE)
    dialect = decoder.dialect
    layout = {"BlockStored": dialect.stored_fields, "BlockRemoved": dialect.removed_fields}
    wire = data.draw(st.lists(wire_event(engine), max_size=5))
    dp_rank = data.draw(st.integers(0, 3))
    first_id = data.draw(st.integers(0, 2**40))
    payload = msgpack.packb([1.25, [_as_wire(f, layout, encoding) for f in wire], dp_rank], use_bin_type=True)

    raw = decoder.decode_raw(payload, first_event_id=first_id)
    events, skipped, dropped = _expected(engine, [_seen(f, layout, encoding) for f in wire], dp_rank, first_id)
    assert _model(raw) == events
    assert decoder.decode(payload, first_event_id=first_id) == EventBatch(
        tuple(events), timestamp=1.25, dp_rank=dp_rank
    )
    assert (raw.skipped_events, raw.dropped_blocks) == (skipped, dropped)


# --- the counters, one behaviour each -----------------------------------------------------------------------


def _payload(*events: object) -> bytes:
    packed: bytes = msgpack.packb([1.0, list(events), 0], use_bin_type=True)
    return packed


def _stored(**fields: object) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": [1, 2], "token_ids": list(range(8)), "block_size": 4, **fields}


def test_other_attention_groups_are_counted_as_skipped_and_take_no_id():
    raw = vllm.Decoder(WORKER_ID, BLOCK_SIZE).decode_raw(
        _payload(_stored(group_idx=1), {"type": "BlockRemoved", "block_hashes": [1], "group_idx": 2}, _stored()),
        first_event_id=5,
    )
    assert [e.event_id for e in raw.events] == [5]
    assert (raw.skipped_events, raw.dropped_blocks) == (2, 0)


def test_blocks_of_another_size_and_short_token_ids_are_counted_as_dropped():
    decoder = vllm.Decoder(WORKER_ID, BLOCK_SIZE)
    raw = decoder.decode_raw(_payload(_stored(block_size=8), _stored(token_ids=list(range(7))), _stored()))
    assert [len(e.engine) for e in raw.events] == [0, 1, 2]
    assert (raw.skipped_events, raw.dropped_blocks) == (0, 3)


def test_engine_hashes_are_u64_whatever_their_wire_form():
    digest = bytes(range(32))
    raw = sglang.Decoder(WORKER_ID, BLOCK_SIZE).decode_raw(
        _payload(_stored(block_hashes=[-1, digest], parent_block_hash=-(2**63)))
    )
    (event,) = raw.events
    assert event.engine.tolist() == [2**64 - 1, int.from_bytes(digest, "big") % 2**64]
    assert event.parent == 2**63


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (_stored(token_ids=[0, 1, False, 3]), r"\$\[1\]\[0\]\.token_ids\[2\]: expected an integer, got bool$"),
        (_stored(block_hashes=[1, True]), r"\$\[1\]\[0\]\.block_hashes\[1\]: expected an integer or bytes hash"),
        (_stored(token_ids=[0, 1, 2, 2**32]), r"\$\[1\]\[0\]\.token_ids\[3\]: 4294967296 is outside"),
        (_stored(token_ids=[0, 1.0, 2, 3]), r"\$\[1\]\[0\]\.token_ids\[1\]: expected an integer, got float$"),
    ],
    ids=["bool-token", "bool-hash", "token-beyond-u32", "float-token"],
)
def test_decode_raw_raises_as_decode(event: dict[str, object], message: str):
    decoder = vllm.Decoder(WORKER_ID, BLOCK_SIZE)
    with pytest.raises(BadEvent, match=rf"^vllm batch: {message}"):
        decoder.decode_raw(_payload(event))
    with pytest.raises(BadEvent, match=rf"^vllm batch: {message}"):
        decoder.decode(_payload(event))


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_integer_arrays_are_lifted_and_the_rest_is_read_as_it_was(engine: str, encoding: str):
    """The fast path is taken: token ids and engine hashes arrive as arrays, other arrays as lists."""
    decoder = DECODERS[engine](WORKER_ID, BLOCK_SIZE)
    layout = {"BlockStored": decoder.dialect.stored_fields, "BlockRemoved": decoder.dialect.removed_fields}
    stored = _stored(block_hashes=[-5, 2**64 - 1], token_ids=[0, 1, 2**32 - 1, 300] * 2, extra_keys=[["salt"], None])
    removed = {"type": "BlockRemoved", "block_hashes": [7, -(2**63)], "medium": "GPU"}
    payload = msgpack.packb([1.0, [_as_wire(stored, layout, encoding), _as_wire(removed, layout, encoding)], 0])
    tree = decoder._unpack(payload)
    assert isinstance(tree, list)
    events = [_seen(dict(e) if isinstance(e, dict) else _fields_of(e, layout), layout, "map") for e in tree[1]]
    assert isinstance(events[0]["token_ids"], np.ndarray)
    assert events[0]["token_ids"].tolist() == stored["token_ids"]
    assert events[0]["block_hashes"].tolist() == [2**64 - 5, 2**64 - 1]
    assert events[1]["block_hashes"].tolist() == [7, 2**63]
    if encoding == "map":
        assert events[0]["extra_keys"] == [["salt"], None]


def _fields_of(event: Sequence[Any], layout: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    return {"type": event[0], **dict(zip(layout[event[0]], event[1:], strict=False))}
