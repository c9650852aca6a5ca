"""``kvrouter.hashing.blocks``: every reference vector, every token input type, and what is rejected."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import pytest

from kvrouter.errors import InvalidHashInput
from kvrouter.hashing.blocks import block_hashes, block_hashes_array


def _call(inputs: dict[str, Any], tokens: Any = None) -> list[int]:
    """``block_hashes`` with a fixture case's inputs; a null input is not passed at all."""
    options = {
        "lora_name": inputs["lora_name"],
        "cache_namespace": inputs["cache_namespace"],
        "mm_infos": inputs["block_mm_infos"],
        "eagle": inputs["is_eagle"],
    }
    given = {name: value for name, value in options.items() if value is not None}
    chosen = inputs["tokens"] if tokens is None else tokens
    return block_hashes(chosen, inputs["kv_block_size"], **given)


def test_vectors(hash_case: dict[str, Any]):
    assert _call(hash_case["inputs"]) == hash_case["block_hashes"]


@pytest.mark.parametrize(
    "convert",
    [
        pytest.param(lambda t: array("I", t), id="array_I"),
        pytest.param(lambda t: np.array(t, dtype=np.uint32), id="uint32"),
        pytest.param(lambda t: np.array(t, dtype=np.int64), id="int64"),
        pytest.param(lambda t: np.repeat(np.array(t, dtype=np.uint32), 2)[::2], id="uint32_strided"),
        pytest.param(tuple, id="tuple"),
    ],
)
def test_token_containers_agree(hash_case: dict[str, Any], convert: Any):
    inputs = hash_case["inputs"]
    assert _call(inputs, convert(inputs["tokens"])) == hash_case["block_hashes"]


def test_array_variant_returns_uint64(hash_case: dict[str, Any]):
    inputs = hash_case["inputs"]
    kwargs = {"eagle": bool(inputs["is_eagle"]), "mm_infos": inputs["block_mm_infos"]}
    got = block_hashes_array(inputs["tokens"], inputs["kv_block_size"], **kwargs)
    assert got.dtype == np.uint64
    assert got.tolist() == block_hashes(inputs["tokens"], inputs["kv_block_size"], **kwargs)


def test_u32_bounds_are_accepted():
    edges = [0, (1 << 32) - 1, 0, (1 << 32) - 1]
    expected = block_hashes(edges, 2)
    assert block_hashes(np.array(edges, dtype=np.int64), 2) == expected
    assert block_hashes(np.array(edges, dtype=np.uint64), 2) == expected


@pytest.mark.parametrize(
    "tokens",
    [
        pytest.param([1, -1], id="negative"),
        pytest.param([1, 1 << 32], id="above_u32"),
        pytest.param([1, 2.0], id="float"),
        pytest.param([1, "2"], id="str"),
        pytest.param([1, None], id="none"),
        pytest.param(np.array([1, -1], dtype=np.int64), id="ndarray_negative"),
        pytest.param(np.array([1, 1 << 32], dtype=np.uint64), id="ndarray_above_u32"),
        pytest.param(np.array([1.0, 2.0]), id="ndarray_float"),
        pytest.param(np.zeros((2, 2), dtype=np.uint32), id="ndarray_2d"),
    ],
)
def test_rejects_tokens_outside_u32(tokens: Any):
    with pytest.raises(InvalidHashInput, match="tokens"):
        block_hashes(tokens, 1)
    with pytest.raises(ValueError, match="tokens"):
        block_hashes(tokens, 1)


@pytest.mark.parametrize("block_size", [0, -16])
def test_rejects_block_size_below_one(block_size: int):
    with pytest.raises(InvalidHashInput, match="block_size"):
        block_hashes([1, 2, 3], block_size)


def test_rejects_mm_hash_outside_u64():
    infos = [{"mm_objects": [{"mm_hash": 1 << 64, "offsets": [[0, 1]]}]}]
    with pytest.raises(InvalidHashInput, match="mm_hash"):
        block_hashes([1, 2], 2, mm_infos=infos)
