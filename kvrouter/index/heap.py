"""``Heap``: the applier gives a burst's freed buffers back to the system once it is idle again.

Why: in a burst (engines restarting, a dump, a fleet storing faster than one applier applies) events
queue in the applier's sockets. libzmq and pyzmq allocate each message with ``malloc``, much of it in
the arena of the ZMQ I/O thread, and glibc keeps an arena's freed pages for the next allocation rather
than return them. After a burst of 1.6 M blocks from 16 vLLM publishers (``bench_ingest.py --wire``,
1 shard), the applier held 130-140 MB of such pages, more than its engine map (96 MB), for the rest of
its life: about 140 of the 321 bytes per index entry the service's memory grew by. ``malloc_trim(0)``
gives back every free page of every arena (``madvise(MADV_DONTNEED)``), not only the top of the main heap.

When: the first time a poll waits its whole tick with no message after the applier received something,
so not inside a burst (the pages would be faulted in again by its next messages); and, for an applier
that never idles (a steady stream of events less than a tick apart after the burst), every
``TRIM_EVERY_S`` while it receives. Giving back 130 MB took 16 ms, and a trim with nothing to give back
under 1 ms (it walks the free lists): a message arriving meanwhile waits that long, at most once per idle
spell or ``TRIM_EVERY_S``.

Only where the C library has ``malloc_trim`` (glibc); elsewhere the calls do nothing.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Final

__all__ = ["TRIM_EVERY_S", "Heap"]

TRIM_EVERY_S: Final = 10.0
"""The longest a busy applier keeps freed buffers: a burst's leftovers go back within this while a steady
stream goes on, for a trim's few milliseconds at most this often."""


def _malloc_trim() -> Callable[[int], int] | None:
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


class Heap:
    """Tell it when the applier received something (:meth:`busy`), when a poll found nothing (:meth:`idle`),
    and the time at each of its ticks (:meth:`tick`)."""

    def __init__(self, now: float) -> None:
        self._trim = _malloc_trim()
        self._received = False
        self._last = now
        self.trims = 0
        self.trim_seconds = 0.0
        """Time spent in ``malloc_trim``, for tests and diagnostics."""

    def busy(self) -> None:
        self._received = True

    def idle(self, now: float) -> None:
        """A poll found nothing: give back what the last busy spell freed, once."""
        if self._received:
            self._give_back(now)

    def tick(self, now: float) -> None:
        """An applier that received something since its last trim, ``TRIM_EVERY_S`` ago or more, trims now."""
        if self._received and now - self._last >= TRIM_EVERY_S:
            self._give_back(now)

    def _give_back(self, now: float) -> None:
        self._received = False
        self._last = now
        if self._trim is None:
            return
        started = time.perf_counter()
        self._trim(0)
        self.trim_seconds += time.perf_counter() - started
        self.trims += 1
