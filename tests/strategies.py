"""Hypothesis strategies for kvrouter's event model, shared by the codec and index tests."""

from __future__ import annotations

from hypothesis import strategies as st

from kvrouter.events.model import (
    Cleared,
    EngineHash,
    EventBatch,
    KvEvent,
    LocalHash,
    Removed,
    StorageTier,
    Stored,
    StoredBlock,
)

u64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
u32 = st.integers(min_value=0, max_value=(1 << 32) - 1)
tiers = st.sampled_from(list(StorageTier))


def stored_blocks(*, with_tokens: bool, block_size: int = 4) -> st.SearchStrategy[StoredBlock]:
    tokens = st.tuples(*[u32] * block_size) if with_tokens else st.none()
    return st.builds(StoredBlock, u64.map(EngineHash), u64.map(LocalHash), tokens)


@st.composite
def events(
    draw: st.DrawFn, *, worker_id: int | None = None, dp_rank: int | None = None, with_tokens: bool = False
) -> KvEvent:
    wid = draw(u32) if worker_id is None else worker_id
    rank = draw(st.integers(0, 7)) if dp_rank is None else dp_rank
    event_id, tier = draw(u64), draw(tiers)
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    if kind == "stored":
        parent = draw(st.none() | u64.map(EngineHash))
        blocks = draw(st.lists(stored_blocks(with_tokens=with_tokens), max_size=6))
        return Stored(wid, parent, tuple(blocks), dp_rank=rank, event_id=event_id, tier=tier)
    if kind == "removed":
        hashes = tuple(draw(st.lists(u64.map(EngineHash), max_size=6)))
        return Removed(wid, hashes, dp_rank=rank, event_id=event_id, tier=tier)
    return Cleared(wid, dp_rank=rank, event_id=event_id, tier=tier)


@st.composite
def batches(draw: st.DrawFn, *, with_tokens: bool = False) -> EventBatch:
    """A batch of one worker's events at one dp rank, as every wire format sends them."""
    worker_id = draw(u32)
    dp_rank = draw(st.integers(0, 7))
    evs = draw(st.lists(events(worker_id=worker_id, dp_rank=dp_rank, with_tokens=with_tokens), max_size=5))
    ts = draw(st.none() | st.floats(min_value=0, max_value=2e9, allow_nan=False))
    return EventBatch(tuple(evs), timestamp=ts, dp_rank=dp_rank)
