"""``WorkerSlots``: dense, stable numbering; ``overlaps_from_tiers``: dict answers as slot arrays."""

from __future__ import annotations

from kvrouter import RadixIndex, StorageTier
from kvrouter.events.model import EngineHash, LocalHash, Stored, StoredBlock
from kvrouter.index.dense import WorkerSlots, overlaps_from_tiers


def test_slots_are_dense_stable_and_versioned():
    slots = WorkerSlots([(7, 0), (3, 1)])
    version = slots.version
    assert [slots.slot((7, 0)), slots.slot((3, 1))] == [0, 1]
    assert slots.version == version  # seen before: nothing assigned
    assert slots.slot((5, 0)) == 2
    assert slots.version != version
    assert (slots.ids.tolist(), slots.ranks.tolist()) == ([7, 3, 5], [0, 1, 0])
    assert slots.slots([(5, 0), (9, 9)]).tolist() == [2, 3]
    assert (slots.get((8, 8)), slots.key(3), len(slots), (9, 9) in slots) == (None, (9, 9), 4, True)


def test_no_two_numberings_show_the_same_version():
    """A reader stamps its bit -> slot maps with the numbering's version alone, so equal versions of two
    numberings would let a decision read another numbering's slots."""
    first, second = WorkerSlots([(1, 0)]), WorkerSlots([(1, 0)])
    seen = {first.version, second.version}
    for worker in range(2, 6):
        first.slot((worker, 0))
        second.slot((worker, 0))
        seen |= {first.version, second.version}
    assert len(seen) == 10
    assert 0 not in seen


def test_overlaps_from_tiers_matches_the_index_answer():
    index = RadixIndex()
    blocks = tuple(StoredBlock(EngineHash(100 + h), LocalHash(h)) for h in (1, 2, 3))
    index.apply_event(1, Stored(1, None, blocks))
    index.apply_event(2, Stored(2, None, blocks[:1], tier=StorageTier.HOST))
    slots = WorkerSlots([(2, 0), (1, 0), (4, 0)])
    table = overlaps_from_tiers(index.find_matches_by_tier([1, 2, 3]), slots)
    assert table.tolist() == [[0, 3, 0], [1, 3, 0], [1, 3, 0], [1, 3, 0]]
    assert overlaps_from_tiers(index.find_matches_by_tier([1, 2, 3]), slots, ntiers=1).tolist() == [[0, 3, 0]]
