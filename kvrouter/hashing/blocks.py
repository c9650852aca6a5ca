"""Tokens → local block hashes, bit-exact with Dynamo's ``compute_block_hash_for_seq`` (spec §1.2).

Tokens become one contiguous ``uint32`` array with no per-token Python step, and one compiled call
(``_xxh3.hash_blocks``) hashes every block. A list goes through ``array('I').fromlist``: about 2.8 ns per
token on the bench machine, against 4 for ``array('I', tokens)`` and 12.5 for ``np.array``
(``spec/shm-engine.md`` §2.1). An ``array('I')`` or a ``uint32`` ndarray from the tokenizer is used in
place, without a copy. ``tools/bench_hash.py`` compares the whole call with the reference binding.

Multimodal blocks are rare, so they are re-hashed with the ``xxhash`` package over the block's token
bytes plus its sorted ``mm_hash`` values, replacing the kernel's plain hash: exact by construction, and
no second kernel to keep bit-exact.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import xxhash

from ..errors import InvalidHashInput
from ._xxh3 import hash_blocks

__all__ = ["XXH3_SEED", "block_hashes", "block_hashes_array"]

XXH3_SEED: Final = 1337
"""Dynamo's block-hash seed (``XXH3_SEED`` in ``lib/kv-router/src/protocols.rs``). Pinned by
``tests/hashing/test_blocks.py::test_vectors`` and ``tests/hashing/test_chain.py::test_vectors``."""

_BASE_SEED: Final = np.uint64(XXH3_SEED)
"""The seed of a request without LoRA or namespace, built once: ``np.uint64()`` costs 0.17 µs a call."""
_U64: Final = (1 << 64) - 1
_U32_MAX: Final = (1 << 32) - 1

Tokens = Sequence[int] | npt.NDArray[np.integer[Any]]
MmInfos = Sequence[Mapping[str, Any] | None]


def _seed(lora_name: str | None, cache_namespace: str | None) -> np.uint64:
    """The request's seed (``compute_salt_hash``): 1337, plus (wrapping) ``xxh3_64(lora_name, seed=0)``
    and ``xxh3_64(cache_namespace, seed=1)`` when they are non-empty."""
    if not lora_name and not cache_namespace:
        return _BASE_SEED
    seed = XXH3_SEED
    if lora_name:
        seed += xxhash.xxh3_64_intdigest(lora_name.encode(), 0)
    if cache_namespace:
        seed += xxhash.xxh3_64_intdigest(cache_namespace.encode(), 1)
    return np.uint64(seed & _U64)


def _token_words(tokens: Tokens) -> npt.NDArray[np.uint32]:
    """Tokens as a contiguous ``uint32`` array, copying only when the input is not one already."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise InvalidHashInput(f"tokens: expected a 1-d integer array, got {tokens.ndim}-d {tokens.dtype}")
        if tokens.dtype != np.uint32:
            if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > _U32_MAX):
                raise InvalidHashInput(
                    f"tokens: ids must fit in u32, got range [{tokens.min()}, {tokens.max()}] ({tokens.dtype})"
                )
            return tokens.astype(np.uint32)
        return np.ascontiguousarray(tokens)
    if not (isinstance(tokens, array) and tokens.typecode == "I"):
        words = array("I")
        try:
            words.fromlist(tokens if isinstance(tokens, list) else list(tokens))
        except (OverflowError, TypeError) as exc:
            raise InvalidHashInput(f"tokens: ids must be integers in [0, 2**32), {exc}") from exc
        tokens = words
    # The buffer's format "I" (C unsigned int) is uint32 on every platform numba supports; asarray
    # reads it without a copy in half the time of frombuffer.
    return np.asarray(tokens)


def _mm_suffix(info: Mapping[str, Any] | None) -> bytes:
    """A block's sorted ``mm_hash`` values as u64 little-endian bytes; empty when it has none."""
    if not info or not info.get("mm_objects"):
        return b""
    try:
        return b"".join(h.to_bytes(8, "little") for h in sorted(o["mm_hash"] for o in info["mm_objects"]))
    except OverflowError as exc:
        raise InvalidHashInput(f"mm_hash must fit in u64: {exc}") from exc


def block_hashes_array(
    tokens: Tokens,
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
    mm_infos: MmInfos | None = None,
    eagle: bool = False,
) -> npt.NDArray[np.uint64]:
    """Local hash of every full block, as a ``uint64`` array (see ``block_hashes``)."""
    if block_size < 1:
        raise InvalidHashInput(f"block_size must be >= 1, got {block_size}")
    words = _token_words(tokens)
    window = block_size + 1 if eagle else block_size
    count = (words.size - window) // block_size + 1 if words.size >= window else 0
    out = np.empty(count, dtype=np.uint64)
    if count == 0:
        return out
    seed = _seed(lora_name, cache_namespace)
    hash_blocks(words, block_size, window, seed, out)
    for i, info in enumerate(mm_infos[:count] if mm_infos else ()):
        suffix = _mm_suffix(info)
        if suffix:
            data = words[i * block_size : i * block_size + window].astype("<u4", copy=False).tobytes()
            out[i] = xxhash.xxh3_64_intdigest(data + suffix, int(seed))
    return out


def block_hashes(
    tokens: Tokens,
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
    mm_infos: MmInfos | None = None,
    eagle: bool = False,
) -> list[int]:
    """Local hash of every full block of ``tokens``, as Dynamo's ``compute_block_hash_for_seq``.

    Args:
        tokens: token ids, each in u32: a list, an ``array('I')`` (no copy) or an integer ndarray
            (``uint32`` contiguous: no copy; other integer dtypes are range-checked and converted).
        block_size: tokens per block (``kv_block_size``); a partial last block is not hashed.
        lora_name: adapter name salted into the seed; empty or None means the base model.
        cache_namespace: tenant salt mixed into the seed; empty or None means none.
        mm_infos: per block, None or a mapping whose ``mm_objects[*]["mm_hash"]`` (u64) values are
            appended, sorted, to that block's bytes; may be shorter than the number of blocks.
        eagle: hash windows of ``block_size + 1`` tokens at stride ``block_size``.

    Returns:
        One u64 per full block (window), in order.

    Raises:
        InvalidHashInput: a token id outside u32 or not an integer, a non-1-d array, ``block_size < 1``,
            or an ``mm_hash`` outside u64.
    """
    hashes: list[int] = block_hashes_array(
        tokens,
        block_size,
        lora_name=lora_name,
        cache_namespace=cache_namespace,
        mm_infos=mm_infos,
        eagle=eagle,
    ).tolist()
    return hashes
