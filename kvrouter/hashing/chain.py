"""Local hashes → the router's sequence hashes (spec §1.3), in one compiled pass.

``seq[0] = local[0]``; ``seq[i] = xxh3_64(u64le(seq[i-1]) ‖ u64le(local[i]), seed=1337)``. Each step
depends on the one before, so the chain cannot be vectorised; what the kernel saves is the per-block
Python call and the two ``to_bytes`` (``spec/shm-engine.md`` §2.1).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt

from ..errors import InvalidHashInput
from ._xxh3 import chain_hashes
from .blocks import XXH3_SEED

__all__ = ["local_hash_array", "local_hash_words", "sequence_hashes", "sequence_hashes_array"]

_SEED: Final = np.uint64(XXH3_SEED)
"""The chain's seed as the kernel takes it, built once (``np.uint64()`` costs 0.17 µs a call)."""

LocalHashes = Sequence[int] | npt.NDArray[np.integer[Any]]
_U64: Final = np.dtype(np.uint64)

_WORD: Final = "L" if array("L").itemsize == 8 else "Q"
"""The ``array`` type code a list of hashes is converted through: ``L`` (C ``unsigned long``, 64 bits on
Linux) where it is 8 bytes, since CPython 3.11 converts each int for it with ``PyLong_AsUnsignedLong``,
about twice as fast for 64-bit values as ``Q``'s ``PyLong_AsUnsignedLongLong`` (byte-array path): 0.8
against 1.6 µs for 64 hashes. Both refuse negative and oversized ints alike."""


def local_hash_array(local_hashes: LocalHashes) -> npt.NDArray[np.uint64]:
    """Local hashes as a contiguous ``uint64`` array, as the compiled walks take them (no copy for one).

    Raises:
        InvalidHashInput: as ``sequence_hashes``.
    """
    if (  # hot path: what the router and the readers pass, taken as it is (0.2 against 0.8 µs)
        type(local_hashes) is np.ndarray
        and local_hashes.dtype is _U64
        and local_hashes.ndim == 1
        and local_hashes.flags.c_contiguous
    ):
        return cast("npt.NDArray[np.uint64]", local_hashes)  # a string: the subscript costs µs at run time
    if isinstance(local_hashes, np.ndarray):
        if local_hashes.ndim != 1 or local_hashes.dtype.kind not in "iu":
            raise InvalidHashInput(
                f"local_hashes: expected a 1-d integer array, got {local_hashes.ndim}-d {local_hashes.dtype}"
            )
        local = np.ascontiguousarray(local_hashes, dtype=np.uint64)
    else:
        try:
            words = array(_WORD)
            words.fromlist(local_hashes if isinstance(local_hashes, list) else list(local_hashes))
            local = np.frombuffer(words, dtype=np.uint64)
        except (OverflowError, TypeError) as exc:
            raise InvalidHashInput(f"local_hashes: hashes must be integers in [0, 2**64), {exc}") from exc
    return local


def local_hash_words(local_hashes: list[int]) -> array[int]:
    """A list of local hashes as an ``array`` of u64 words, for a kernel that takes the buffer's address
    (``IndexReader.find_matches``): 1.0 µs for 64 hashes, where ``local_hash_array`` adds a numpy array
    over it (0.5 µs more).

    Raises:
        InvalidHashInput: as ``sequence_hashes``.
    """
    try:
        return array(_WORD, local_hashes)
    except (OverflowError, TypeError) as exc:
        raise InvalidHashInput(f"local_hashes: hashes must be integers in [0, 2**64), {exc}") from exc


def sequence_hashes_array(local_hashes: LocalHashes) -> npt.NDArray[np.uint64]:
    """Sequence hash of every prefix, as a ``uint64`` array (see ``sequence_hashes``)."""
    local = local_hash_array(local_hashes)
    out = np.empty(local.size, dtype=np.uint64)
    chain_hashes(local, _SEED, out)
    return out


def sequence_hashes(local_hashes: LocalHashes) -> list[int]:
    """The router's chained hash of each prefix, from the prompt's local block hashes.

    Args:
        local_hashes: u64 local hashes in block order: a list, or an integer ndarray (signed values are
            taken as their u64 bit pattern).

    Returns:
        One u64 per block; the first equals the first local hash.

    Raises:
        InvalidHashInput: a listed hash outside u64 or not an integer, or an ndarray that is not a 1-d
            integer array.
    """
    hashes: list[int] = sequence_hashes_array(local_hashes).tolist()
    return hashes
