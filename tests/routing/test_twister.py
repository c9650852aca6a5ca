"""The compiled draws against ``random.Random``, the generator the oracle draws from."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings, strategies as st

from kvrouter.routing._twister import STATE_WORDS, advance, generator, state, uniform


def state_of(rng: random.Random) -> np.ndarray:
    words = state(rng)
    assert words.size == STATE_WORDS
    return words


@settings(max_examples=40, deadline=None)
@given(
    seed=st.one_of(st.none(), st.integers(0, 2**64)),
    steps=st.lists(st.tuples(st.booleans(), st.integers(1, 400)), min_size=1, max_size=12),
)
def test_draws_and_skips_leave_the_state_random_would_have(seed: int | None, steps: list[tuple[bool, int]]) -> None:
    """Up to a few thousand words: several twists of the 624-word state, and skips across them."""
    rng = random.Random(seed)
    mt = state_of(rng)
    for draw, n in steps:
        if draw:
            for _ in range(n):
                assert uniform(mt) == rng.random()
        else:
            rng.getrandbits(64 * n)
            advance(mt, 2 * n)
        assert tuple(mt.tolist()) == rng.getstate()[1]


def test_a_state_mid_block_is_taken_back_by_setstate() -> None:
    """What ``Router.rng`` hands out: a ``random.Random`` set from the array draws on from the same point."""
    rng = random.Random(7)
    mt = state_of(rng)
    for _ in range(5):
        uniform(mt)
    copy = generator(mt)
    assert [copy.random() for _ in range(700)] == [uniform(mt) for _ in range(700)]
