"""The slot manager's compiled refcount tables against a dict model, with hashes crowded onto few home
rows so that probe runs wrap, collide and are shifted back on every delete."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings, strategies as st

from kvrouter.routing import _active as active

SLOTS = 70
"""Past one bitset word, so the second word is exercised."""
ROWS = 16


def crowded(low: int, high: int) -> int:
    """A hash whose home row in a 16-row table is ``low % 4``: many keys share a few runs."""
    return (high << 8) | (low % 4) | 12


operation = st.tuples(
    st.booleans(),  # add or remove
    st.integers(0, SLOTS - 1),
    st.lists(st.tuples(st.integers(0, 7), st.integers(0, 3)), min_size=1, max_size=6),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(operation, max_size=60))
def test_tables_match_a_dict_model(operations: list[tuple[bool, int, list[tuple[int, int]]]]) -> None:
    pairs = active.pair_table(ROWS)
    holders = active.widen(active.holder_table(ROWS), SLOTS)
    used = np.zeros(2, dtype=np.int64)
    model: Counter[tuple[int, int]] = Counter()
    for adding, slot, raw in operations:
        seqs = np.array([crowded(low, high) for low, high in raw], dtype=np.uint64)
        if adding:
            pairs = active.room(pairs, int(used[0]), len(seqs), pairs=True)
            holders = active.room(holders, int(used[1]), len(seqs), pairs=False)
            expected = 0
            for seq in seqs.tolist():
                expected += model[seq, slot] == 0
                model[seq, slot] += 1
            assert active.add(pairs, holders, used, seqs, slot) == expected
        else:
            expected = 0
            for seq in seqs.tolist():
                if model[seq, slot] == 1:
                    expected += 1
                if model[seq, slot]:
                    model[seq, slot] -= 1
            model += Counter()  # drop zero counts
            assert active.remove(pairs, holders, used, seqs, slot) == expected
        assert used[0] == len(model)
        assert used[1] == len({seq for seq, _ in model})
        for (seq, held_slot), _count in model.items():
            assert active.held_run(pairs, np.array([seq], dtype=np.uint64), held_slot) == 1
        out = np.zeros(SLOTS, dtype=np.int64)
        touched = np.zeros(SLOTS, dtype=np.int64)
        alive = np.zeros(SLOTS, dtype=np.int64)
        for seq in {seq for seq, _ in model}:
            n = active.leading(holders, np.array([seq], dtype=np.uint64), out, touched, alive)
            assert sorted(touched[:n].tolist()) == sorted(s for q, s in model if q == seq)
            out[touched[:n]] = 0
    for (seq, slot), count in list(model.items()):
        for _ in range(count):
            active.remove(pairs, holders, used, np.array([seq], dtype=np.uint64), slot)
    assert not used.any()
    assert not pairs.any()
    assert not holders.any()


def test_leading_counts_each_slots_run() -> None:
    pairs, holders, used = active.pair_table(), active.widen(active.holder_table(), 200), np.zeros(2, dtype=np.int64)
    prompt = np.arange(1, 11, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    active.add(pairs, holders, used, prompt[:10], 3)
    active.add(pairs, holders, used, prompt[:4], 150)
    active.add(pairs, holders, used, prompt[1:], 7)  # holds no first block: no leading run
    out = np.zeros(200, dtype=np.int64)
    touched = np.zeros(200, dtype=np.int64)
    n = active.leading(holders, prompt, out, touched, np.zeros(200, dtype=np.int64))
    assert sorted(touched[:n].tolist()) == [3, 150]
    assert (out[3], out[150], out[7]) == (10, 4, 0)


WIDE = 150
"""Three bitset words: a run may end in any of them, at bit 63 and at bit 0 of the next."""
request = st.tuples(
    st.sampled_from([0, 1, 62, 63, 64, 65, 127, 128, 149]),
    st.integers(0, 11),  # first block taken from the prompt
    st.integers(0, 12),  # one past the last
)


@settings(max_examples=300, deadline=None)
@given(st.lists(request, max_size=14), st.integers(1, 12))
def test_leading_matches_each_slots_run_in_a_model(requests: list[tuple[int, int, int]], length: int) -> None:
    """Every slot's leading run of the prompt, over slots that stop at different blocks in different words."""
    prompt = np.arange(1, length + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    pairs, holders, used = active.pair_table(), active.widen(active.holder_table(), WIDE), np.zeros(2, dtype=np.int64)
    held: dict[int, set[int]] = {}
    for slot, first, end in requests:
        seqs = prompt[first:end]
        if not len(seqs):
            continue
        pairs = active.room(pairs, int(used[0]), len(seqs), pairs=True)
        holders = active.room(holders, int(used[1]), len(seqs), pairs=False)
        active.add(pairs, holders, used, seqs, slot)
        held.setdefault(slot, set()).update(seqs.tolist())
    expected = {}
    for slot, hashes in held.items():
        run = 0
        while run < length and int(prompt[run]) in hashes:
            run += 1
        if run:
            expected[slot] = run
    out, touched, alive = (np.zeros(WIDE, dtype=np.int64) for _ in range(3))
    n = active.leading(holders, prompt, out, touched, alive)
    assert sorted(touched[:n].tolist()) == sorted(expected)
    assert {slot: int(run) for slot, run in enumerate(out) if run} == expected
