"""``Heap``: the applier gives a burst's freed buffers back to the system once it is idle again.

Why: in a burst (engines restarting, a dump, a fleet storing faster than one applier applies) events
queue in the applier's sockets. libzmq and pyzmq allocate each message with ``malloc``, much of it in
the arena of the ZMQ I/O thread, and glibc keeps an arena's freed pages for the next allocation rather
than return them. After a burst of 1.6 M blocks from 16 vLLM publishers (``bench_ingest.py --wire``,
1 shard), the applier held 130-140 MB of such pages, more than its engine map (96 MB), for the rest of
its life: about 140 of the 321 bytes per index entry the service's memory grew by. ``malloc_trim(0)``
gives back every free page of every arena (``madvise(MADV_DONTNEED)``), not only the top of the main heap.

When: the first time a poll waits its whole tick with no message after the applier received something,
so never inside a burst (the pages would be faulted in again by its next messages). Giving back 130 MB
took 16 ms, and a trim with nothing to give back under 1 ms (it walks the free lists): a message arriving
meanwhile waits that long, once per idle spell. An applier that never idles keeps its buffers, which a
steady stream reuses.

Only where the C library has ``malloc_trim`` (glibc); elsewhere :meth:`idle` does nothing.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

__all__ = ["Heap"]


def _malloc_trim() -> Callable[[int], int] | None:
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


class Heap:
    """Tell it when the applier received something (:meth:`busy`) and when a poll found nothing (:meth:`idle`)."""

    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self._received = False
        self.trims = 0
        self.trim_seconds = 0.0
        """Time spent in ``malloc_trim``, for tests and diagnostics."""

    def busy(self) -> None:
        self._received = True

    def idle(self) -> None:
        """A poll found nothing: give back what the last busy spell freed, once."""
        if not self._received or self._trim is None:
            return
        self._received = False
        started = time.perf_counter()
        self._trim(0)
        self.trim_seconds += time.perf_counter() - started
        self.trims += 1
