from __future__ import annotations

from typing import Any

import pytest

from kvrouter.errors import BadEvent, BlockNotFound, InvalidBlockSequence, ParentNotFound
from kvrouter.events.model import Cleared, EngineHash, LocalHash, Removed, StorageTier, Stored, StoredBlock
from kvrouter.index import RadixIndex
from tests.index.contract import replay


def test_contract_scenario(contract_scenario: dict[str, Any]):
    """Every op of every scenario: the expected error kind, or exactly the expected score list."""
    for where, got, expected in replay(RadixIndex(), contract_scenario):
        assert got == expected, where


W1, W2 = (1, 0), (2, 0)


def _chain(worker: int, hashes: list[int], *, tier: StorageTier = StorageTier.DEVICE, parent: int | None = None):
    """A store of blocks whose engine hash is 100 + local hash, so tests can name them."""
    blocks = tuple(StoredBlock(EngineHash(100 + h), LocalHash(h)) for h in hashes)
    return Stored(worker, None if parent is None else EngineHash(100 + parent), blocks, tier=tier)


def test_tier_overlaps_are_cumulative_fastest_first():
    index = RadixIndex()
    index.apply_event(1, _chain(1, [1, 2]))
    index.apply_event(1, _chain(1, [1, 2, 3, 4], tier=StorageTier.HOST))
    index.apply_event(1, _chain(1, [1, 2, 3, 4, 5], tier=StorageTier.DISK))
    index.apply_event(2, _chain(2, [1], tier=StorageTier.SHARED))
    by_tier = index.find_matches_by_tier([1, 2, 3, 4, 5, 6])
    assert by_tier == {
        StorageTier.DEVICE: {W1: 2},
        StorageTier.HOST: {W1: 4},
        StorageTier.DISK: {W1: 5},
        StorageTier.SHARED: {W1: 5, W2: 1},
    }
    assert index.find_matches([1, 2, 3]) == {W1: 2}


def test_a_gap_in_a_faster_tier_is_filled_by_a_slower_one():
    index = RadixIndex()
    index.apply_event(1, _chain(1, [1, 2, 3]))
    index.apply_event(1, _chain(1, [1, 2], tier=StorageTier.HOST))
    index.apply_event(1, Removed(1, (EngineHash(102),)))  # device loses block 2, host still has it
    by_tier = index.find_matches_by_tier([1, 2, 3])
    assert by_tier[StorageTier.DEVICE] == {W1: 1}
    assert by_tier[StorageTier.HOST] == {W1: 3}


def test_parents_and_removals_are_resolved_within_one_tier():
    index = RadixIndex()
    index.apply_event(1, _chain(1, [1]))
    with pytest.raises(ParentNotFound, match="host index"):
        index.apply_event(1, _chain(1, [2], parent=1, tier=StorageTier.HOST))
    with pytest.raises(BlockNotFound):
        index.apply_event(1, Removed(1, (EngineHash(101),), tier=StorageTier.DISK))
    assert index.find_matches([1]) == {W1: 1}


def test_cleared_releases_its_tier_and_clear_all_blocks_every_tier():
    index = RadixIndex()
    index.apply_event(1, _chain(1, [1, 2]))
    index.apply_event(1, _chain(1, [1, 2], tier=StorageTier.HOST))
    index.apply_event(1, Cleared(1))
    assert index.find_matches_by_tier([1, 2])[StorageTier.HOST] == {W1: 2}
    assert index.find_matches([1, 2]) == {}
    index.clear_all_blocks(1)
    assert index.find_matches_by_tier([1, 2])[StorageTier.DISK] == {}
    assert index.workers() == {W1}
    index.remove_worker(1)
    assert index.workers() == set()


def test_block_counts_per_tier_and_in_any_tier():
    index = RadixIndex()
    index.apply_event(1, _chain(1, [1, 2, 3]))
    index.apply_event(1, _chain(1, [1, 2, 3, 4], tier=StorageTier.HOST))
    index.apply_event(2, _chain(2, [1]))
    index.apply_event(2, Removed(2, (EngineHash(101),)))
    assert index.block_counts() == {W1: 4, W2: 0}
    assert index.block_counts(StorageTier.DEVICE) == {W1: 3, W2: 0}
    assert index.block_counts(StorageTier.HOST) == {W1: 4, W2: 0}


def test_two_engine_hashes_for_one_block_hold_it_until_both_go():
    index = RadixIndex()
    index.apply_event(1, _chain(1, [1]))
    index.apply_event(1, Stored(1, None, (StoredBlock(EngineHash(7), LocalHash(1)),)))
    index.apply_event(1, Removed(1, (EngineHash(101),)))
    assert index.find_matches([1]) == {W1: 1}
    index.apply_event(1, Removed(1, (EngineHash(7),)))
    assert index.find_matches([1]) == {}


def test_a_store_repeating_an_engine_hash_is_rejected_whole():
    index = RadixIndex()
    blocks = (StoredBlock(EngineHash(5), LocalHash(1)), StoredBlock(EngineHash(5), LocalHash(2)))
    with pytest.raises(InvalidBlockSequence, match="repeats"):
        index.apply_event(1, Stored(1, None, blocks))
    assert index.holdings() == {}


def test_an_event_of_another_worker_is_a_bad_event():
    with pytest.raises(BadEvent, match="applied as worker 2"):
        RadixIndex().apply_event(2, Cleared(1))


def test_dump_fills_gaps_with_synthetic_hashes_and_removes_them():
    index = RadixIndex()
    index.apply_event(1, _chain(1, [1, 2, 3]))
    index.apply_event(1, Removed(1, (EngineHash(102),)))  # interior eviction: 3 stays without 2
    events = index.dump()
    assert isinstance(events[-1], Removed)
    rebuilt = RadixIndex()
    for event in events:
        rebuilt.apply_event(event.worker_id, event)
    assert rebuilt.holdings() == index.holdings() == {(W1, StorageTier.DEVICE): {101: (1,), 103: (1, 2, 3)}}
