"""The engine codecs end to end: every captured frame decodes to what its JSON twin says, and the live
batches, converted, are exactly router_view.json's events and leave the reference's own ``RadixTree``
with its scores after each batch."""

from __future__ import annotations

import json
from typing import Any

import pytest
from dynamo._core import RadixTree

from kvrouter.events.codecs import dynamo, sglang, vllm
from kvrouter.events.codecs._engine import EngineDecoder
from tests.conftest import (
    ENGINES,
    captured_payloads,
    decode_in_router_view_order,
    expected_engine_event,
    load_engine_frames,
)

WORKER_ID = 1
"""router_view.json converts every engine's events as worker 1."""

DECODERS: dict[str, type[EngineDecoder]] = {"vllm": vllm.Decoder, "sglang": sglang.Decoder}


def _scores(tree: RadixTree, query: list[int]) -> list[list[int]]:
    # The binding's stub types scores as dict[int, int]; at run time the keys are (worker_id, dp_rank).
    scores: dict[tuple[int, int], int] = tree.find_matches(query).scores  # type: ignore[assignment]
    return sorted([worker, rank, score] for (worker, rank), score in scores.items())


@pytest.mark.parametrize("engine", ENGINES)
def test_captured_batches_decode_as_the_twin_says(engine: str):
    """Every live and replayed batch: hashes cast to u64 (SGLang's are signed), blocks of another size
    dropped (SGLang's partial page), token ids re-hashed, event ids counted from ``first_event_id``."""
    captured, twin = load_engine_frames(engine)
    block_size = twin["scenario"]["block_size"]
    decoder = DECODERS[twin["engine"]](WORKER_ID, block_size)
    for payload, expected in captured_payloads(captured, twin):
        ts, twin_events, rank = expected["payload"]
        batch = decoder.decode(payload, first_event_id=100)
        assert batch.timestamp == ts
        assert batch.dp_rank == rank
        assert batch.events == tuple(
            expected_engine_event(e, worker_id=WORKER_ID, dp_rank=rank, event_id=100 + i, block_size=block_size)
            for i, e in enumerate(twin_events)
        )


@pytest.mark.parametrize("engine", ENGINES)
def test_live_batches_convert_to_the_router_view(engine: str, router_view: dict[str, Any]):
    """Every engine's live batches, decoded in router_view.json's order, are exactly its router events."""
    captured, twin = load_engine_frames(engine)
    decoder = DECODERS[twin["engine"]](WORKER_ID, twin["scenario"]["block_size"])
    as_router_event = dynamo.Encoder().encode_event
    for batch, entry in decode_in_router_view_order(decoder, captured, router_view[engine]):
        assert all(r["error"] is None for r in entry["router_events"])
        assert [json.loads(as_router_event(e)) for e in batch.events] == [r["event"] for r in entry["router_events"]]


@pytest.mark.parametrize("engine", ENGINES)
def test_reference_tree_fed_our_events_scores_as_router_view(engine: str, router_view: dict[str, Any]):
    captured, twin = load_engine_frames(engine)
    view = router_view[engine]
    decoder = DECODERS[twin["engine"]](WORKER_ID, twin["scenario"]["block_size"])
    encoder = dynamo.Encoder()
    tree = RadixTree()
    for batch, entry in decode_in_router_view_order(decoder, captured, view):
        for event in batch.events:
            tree.apply_event(WORKER_ID, encoder.encode_event(event))
        for prompt, query in view["query_tokens_hashes"].items():
            assert _scores(tree, query) == entry["scores_after"][prompt], (entry["dp_rank"], entry["seq"], prompt)
