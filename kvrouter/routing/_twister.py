"""Python's ``random.Random`` draws, in compiled code, on its state as an array.

The router must draw exactly what the oracle draws (``selection.choose`` on a ``random.Random``), so that
equal seeds give equal choices, and the equivalence tests compare the generators' states. Drawing in
Python cost a decision 0.8 µs warm and 2 µs after other work had evicted the caches (a
``getrandbits`` call, a bound ``random`` per tie and the numpy reads around them): a fifth of a
16-worker decision. Here the decision kernel draws in the same call that chose.

The rules: the state is ``random.Random.getstate()[1]`` as ``uint64`` words, 624 words of the Mersenne
Twister (MT19937) and the index of the next one (624: twist first), so ``setstate`` takes it back
unchanged. ``uniform`` is CPython's ``random()`` (two words, 53 bits); a ``getrandbits(k)`` for ``k`` a
multiple of 32 is ``k / 32`` words. Rejected: numba's own ``np.random`` (another generator and a
per-thread state the oracle cannot share), and keeping the draws in Python behind a cheaper call (the
call itself, cold, was most of the cost).
"""

from __future__ import annotations

import random
from typing import Final

import numpy as np
import numpy.typing as npt

from .._jit import inlined, kernel

__all__ = ["STATE_WORDS", "advance", "generator", "state", "uniform"]

N: Final = 624
"""Words of the twister's state."""
STATE_WORDS: Final = N + 1
"""The state array: the words, then the index of the next word to temper."""
_M: Final = 397
_MATRIX_A = np.uint64(0x9908B0DF)
_UPPER = np.uint64(0x80000000)
_LOWER = np.uint64(0x7FFFFFFF)
_ONE = np.uint64(1)
_ZERO = np.uint64(0)
_B = np.uint64(0x9D2C5680)
_C = np.uint64(0xEFC60000)


def state(rng: random.Random) -> npt.NDArray[np.uint64]:
    """``rng``'s state as the array the draws below advance."""
    return np.array(rng.getstate()[1], dtype=np.uint64)


def generator(words: npt.NDArray[np.uint64]) -> random.Random:
    """A ``random.Random`` in the state ``words`` holds (a copy: drawing from it leaves ``words`` as it is)."""
    rng = random.Random()
    rng.setstate((random.Random.VERSION, tuple(words.tolist()), None))
    return rng


@kernel
def _twist(mt: npt.NDArray[np.uint64]) -> None:
    """The next 624 words, in place (each update reads words already updated, as CPython's loop does)."""
    for k in range(N):
        y = (mt[k] & _UPPER) | (mt[(k + 1) % N] & _LOWER)
        mt[k] = mt[(k + _M) % N] ^ (y >> _ONE) ^ (_MATRIX_A if y & _ONE else _ZERO)


@inlined
def _word(mt: npt.NDArray[np.uint64]) -> np.uint64:
    """CPython's ``genrand_uint32``: the next tempered 32-bit word."""
    i = mt[N]
    if i >= N:
        _twist(mt)
        i = _ZERO
    y: np.uint64 = mt[i]
    mt[N] = i + _ONE
    y ^= y >> np.uint64(11)
    y ^= (y << np.uint64(7)) & _B
    y ^= (y << np.uint64(15)) & _C
    y ^= y >> np.uint64(18)
    return y


@kernel
def uniform(mt: npt.NDArray[np.uint64]) -> float:
    """``random.Random.random()``: 27 and 26 bits of two words, in [0, 1)."""
    a = _word(mt) >> np.uint64(5)
    b = _word(mt) >> np.uint64(6)
    return (float(a) * 67108864.0 + float(b)) * (1.0 / 9007199254740992.0)


@kernel
def advance(mt: npt.NDArray[np.uint64], words: int) -> None:
    """Skip ``words`` words: ``getrandbits(32 * words)``, or ``words / 2`` calls of ``random()``."""
    for _ in range(words):
        _word(mt)
