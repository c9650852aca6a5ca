"""``kvrouter.hashing.chain``: the sequence hashes of every reference vector, from list or array."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvrouter.errors import InvalidHashInput
from kvrouter.hashing.chain import sequence_hashes, sequence_hashes_array


def test_vectors(hash_case: dict[str, Any]):
    assert sequence_hashes(hash_case["block_hashes"]) == hash_case["sequence_hashes"]


def test_array_input_and_output_agree(hash_case: dict[str, Any]):
    local = np.array(hash_case["block_hashes"], dtype=np.uint64)
    got = sequence_hashes_array(local)
    assert got.dtype == np.uint64
    assert got.tolist() == hash_case["sequence_hashes"]


def test_signed_array_is_read_as_u64_bits(hash_case: dict[str, Any]):
    signed = np.array(hash_case["block_hashes"], dtype=np.uint64).view(np.int64)
    assert sequence_hashes(signed) == hash_case["sequence_hashes"]


@pytest.mark.parametrize("bad", [[1, -1], [1, 1 << 64], [1, "2"], [1.5]])
def test_rejects_hash_outside_u64(bad: list[Any]):
    with pytest.raises(InvalidHashInput, match="local_hashes"):
        sequence_hashes(bad)


def test_rejects_non_integer_array():
    with pytest.raises(InvalidHashInput, match="float64"):
        sequence_hashes(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="2-d"):
        sequence_hashes(np.zeros((2, 2), dtype=np.uint64))
