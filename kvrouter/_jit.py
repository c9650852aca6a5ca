"""The ways kvrouter compiles a function with numba, declared once for every kernel module.

- :func:`kernel`: ``njit(cache=True, nogil=True)``. Cached on disk, so a later start loads the machine code
  instead of compiling it again (a first run compiles for about a minute); ``nogil``, so a kernel called
  from a thread (the growth helpers, a front's executor) runs beside the interpreter.
- :func:`inlined`: the same, inlined into its caller. For helpers that take arrays: called as a function,
  numba increfs and decrefs each array argument (two atomic operations) on every call, which in a loop
  over blocks or msgpack values costs more than the helper's work.
- :func:`holds_gil`: cached, keeping the GIL, for the kernels that call the CPython API (the reader's
  answer dicts).

Each returns ``fn``'s own signature to the type checker, so mypy still checks every caller. Rejected:
``njit(...)`` written out in each kernel module, as before this module: four copies of the same lines,
which had drifted apart in what they said.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from numba import njit

__all__ = ["holds_gil", "inlined", "kernel"]

_F = TypeVar("_F", bound=Callable[..., Any])


def kernel(fn: _F) -> _F:
    """``njit(cache=True, nogil=True)``."""
    return cast(_F, njit(cache=True, nogil=True)(fn))


def inlined(fn: _F) -> _F:
    """``njit(cache=True, nogil=True, inline="always")``: for array-taking helpers."""
    return cast(_F, njit(cache=True, nogil=True, inline="always")(fn))


def holds_gil(fn: _F) -> _F:
    """``njit(cache=True)``: a kernel that calls the CPython API keeps the GIL."""
    return cast(_F, njit(cache=True)(fn))
