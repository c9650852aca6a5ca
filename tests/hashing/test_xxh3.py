"""``kvrouter.hashing._xxh3``: the compiled XXH3-64 is bit-exact with the ``xxhash`` package.

Word lengths 1..700 cross every path a multiple of 4 bytes reaches (4-8, 9-16, 17-128, 129-240 bytes,
and the long path with one, two and three 1 KiB blocks), for seeds at both ends of u64.
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings, strategies as st

from kvrouter.hashing._xxh3 import chain_hashes, hash_blocks

U64_MAX = (1 << 64) - 1
MAX_WORDS = 700


def _reference(words: np.ndarray, seed: int) -> int:
    return xxhash.xxh3_64_intdigest(words.astype("<u4").tobytes(), seed)


def _compiled(words: np.ndarray, seed: int) -> int:
    out = np.empty(1, dtype=np.uint64)
    hash_blocks(words, words.size, words.size, np.uint64(seed), out)
    return int(out[0])


@pytest.mark.parametrize("seed", [0, 1, 1337, 1 << 63, U64_MAX, 0x5DEECE66D2B1F8E3])
def test_every_length_matches_xxhash(seed: int):
    rng = np.random.default_rng(seed % (1 << 32))
    for n in range(1, MAX_WORDS + 1):
        words = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
        assert _compiled(words, seed) == _reference(words, seed), f"{n} words, seed {seed}"


@pytest.mark.parametrize(
    ("block_size", "window"),
    [(1, 1), (1, 2), (4, 4), (16, 16), (16, 17), (32, 33), (60, 61), (64, 64), (64, 65), (300, 300)],
)
def test_blocks_stride_and_window(block_size: int, window: int):
    """Many blocks in one call: offsets step by ``block_size``, each hashes ``window`` words, and the
    long path reuses one seeded secret for all of them."""
    rng = np.random.default_rng(block_size * 1000 + window)
    tokens = rng.integers(0, 1 << 32, 5 * block_size + window, dtype=np.uint64).astype(np.uint32)
    seed = 0x0123456789ABCDEF
    out = np.empty(6, dtype=np.uint64)
    hash_blocks(tokens, block_size, window, np.uint64(seed), out)
    starts = range(0, 6 * block_size, block_size)
    assert out.tolist() == [_reference(tokens[s : s + window], seed) for s in starts]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=MAX_WORDS),
    st.integers(0, U64_MAX),
)
def test_hypothesis_matches_xxhash(tokens: list[int], seed: int):
    words = np.array(tokens, dtype=np.uint32)
    assert _compiled(words, seed) == _reference(words, seed)


@pytest.mark.parametrize("seed", [0, 1337, U64_MAX])
def test_chain_matches_xxhash(seed: int):
    rng = np.random.default_rng(seed % 97)
    local = np.concatenate([np.array([0, U64_MAX, 1], dtype=np.uint64), rng.integers(0, U64_MAX, 200, dtype=np.uint64)])
    out = np.empty_like(local)
    chain_hashes(local, np.uint64(seed), out)
    expected = [int(local[0])]
    for h in local[1:].tolist():
        step = expected[-1].to_bytes(8, "little") + h.to_bytes(8, "little")
        expected.append(xxhash.xxh3_64_intdigest(step, seed))
    assert out.tolist() == expected


def test_chain_of_nothing_writes_nothing():
    out = np.empty(0, dtype=np.uint64)
    chain_hashes(np.empty(0, dtype=np.uint64), np.uint64(1337), out)
    assert out.size == 0
