"""``kvrouter.worker.kv_cache``: pools, prefix reuse, LRU eviction order and the events they cause."""

from __future__ import annotations

import pytest

from kvrouter.events.model import Removed, Stored
from kvrouter.worker import KvCache


def stored(event) -> tuple[int | None, list[int]]:
    assert isinstance(event, Stored)
    for block in event.blocks:
        assert int(block.engine_hash) == int(block.local_hash)
    return event.parent, [block.engine_hash for block in event.blocks]


def removed(event) -> list[int]:
    assert isinstance(event, Removed)
    return list(event.engine_hashes)


def test_new_blocks_are_stored_once_under_their_parent():
    kv = KvCache(3, 8)
    assert kv.acquire_full([10, 11, 12], None) == 3
    assert kv.acquire_full([10, 11], None) == 2  # a second holder of an active prefix
    (event,) = kv.drain_events()
    assert (event.worker_id, event.dp_rank) == (3, 0)
    assert stored(event) == (None, [10, 11, 12])
    assert (kv.refcount(10), kv.refcount(12), kv.active_blocks) == (2, 1, 3)


def test_a_reused_block_splits_the_stored_runs():
    kv = KvCache(0, 8)
    kv.acquire_full([2], None)
    kv.drain_events()
    kv.acquire_full([1, 2, 3], 0)  # 1 new under 0, 2 reused, 3 new under 2
    assert [stored(event) for event in kv.drain_events()] == [(0, [1]), (2, [3])]


def test_released_blocks_stay_cached_and_revive_silently():
    kv = KvCache(0, 4)
    kv.acquire_full([1, 2], None)
    kv.release([2, 1])
    kv.drain_events()
    assert (kv.active_blocks, kv.inactive_blocks, kv.prefix_hits([1, 2, 9])) == (0, 2, 2)
    assert kv.acquire_full([1, 2, 3], None) == 3
    assert [stored(event) for event in kv.drain_events()] == [(2, [3])]
    assert (kv.active_blocks, kv.inactive_blocks) == (3, 0)


def test_prefix_hits_stop_at_the_first_miss():
    kv = KvCache(0, 8)
    kv.acquire_full([1, 2], None)
    kv.acquire_full([4], None)
    assert kv.prefix_hits([1, 2, 3, 4]) == 2
    assert kv.prefix_hits([4, 1]) == 2
    assert kv.prefix_hits([5, 1]) == 0


def test_eviction_takes_the_least_recently_released_first():
    kv = KvCache(0, 4)
    kv.acquire_full([1, 2], None)
    kv.acquire_full([3, 4], None)
    kv.release([2, 1])  # leaf first, as a finishing sequence releases
    kv.release([4, 3])
    kv.acquire_full([3], None)  # revived: no longer evictable
    kv.drain_events()
    assert kv.inactive_order() == [2, 1, 4]
    assert kv.acquire_full([5, 6], None) == 2
    events = kv.drain_events()
    assert removed(events[0]) == [2, 1]  # flushed before the store that needed the room
    assert stored(events[1]) == (None, [5, 6])
    assert kv.inactive_order() == [4]
    assert kv.evictions == 2


def test_an_evicted_block_stored_again_is_removed_first():
    kv = KvCache(0, 1)
    kv.acquire_full([1], None)
    kv.release([1])
    kv.acquire_full([2], None)
    kv.release([2])
    kv.acquire_full([1], None)
    assert [type(event).__name__ for event in kv.drain_events()] == ["Stored", "Removed", "Stored", "Removed", "Stored"]


def test_a_full_pool_of_active_blocks_refuses():
    kv = KvCache(0, 3)
    assert kv.acquire_full([1, 2], None) == 2
    assert kv.acquire_full([3, 4], 2) == 1
    assert kv.acquire_partial() is None
    assert [stored(event) for event in kv.drain_events()] == [(None, [1, 2]), (2, [3])]


def test_partial_blocks_are_private_and_freed_on_release():
    kv = KvCache(0, 3)
    first, second = kv.acquire_partial(), kv.acquire_partial()
    assert first is not None
    assert second is not None
    assert first != second
    assert first < 0
    assert (kv.active_blocks, kv.free_blocks) == (2, 1)
    kv.release([first])
    assert (kv.active_blocks, kv.inactive_blocks, kv.free_blocks) == (1, 0, 2)
    assert kv.drain_events() == []


def test_a_filled_partial_block_is_promoted_and_stored():
    kv = KvCache(0, 2)
    kv.acquire_full([7], None)
    partial = kv.acquire_partial()
    assert partial is not None
    kv.drain_events()
    kv.promote(partial, 100, 7)
    assert [stored(event) for event in kv.drain_events()] == [(7, [100])]
    assert (kv.active_blocks, kv.free_blocks, kv.cached_ids()) == (2, 0, {7, 100})


def test_promoting_to_a_cached_block_shares_it_silently():
    kv = KvCache(0, 4)
    kv.acquire_full([7, 100], None)
    kv.release([100])
    partial = kv.acquire_partial()
    assert partial is not None
    kv.drain_events()
    kv.promote(partial, 100, 7)
    assert kv.drain_events() == []
    assert kv.refcount(100) == 1


def test_the_pool_needs_a_slot():
    with pytest.raises(ValueError, match="num_blocks"):
        KvCache(0, 0)
