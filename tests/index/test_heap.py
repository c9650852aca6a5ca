"""``Heap``: what a busy spell freed goes back to the system at the next idle poll, once, or every
``TRIM_EVERY_S`` to an applier that never idles."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvrouter.index.heap import TRIM_EVERY_S, Heap

BUFFERS = 10_000
BUFFER_BYTES = 8 << 10
"""Above pymalloc's 512 bytes and below glibc's mmap threshold: each one a ``malloc`` in an arena, as a
ZMQ message of a burst is."""
KEEP_EVERY = 16


def _pss_mb() -> float:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no Pss in smaps_rollup")


def _burst(kept: list[bytes]) -> None:
    """Allocate like a burst on another thread, keeping a few buffers spread over the arena, so that
    freeing the others cannot shrink it from the top."""
    buffers = [bytes(BUFFER_BYTES) for _ in range(BUFFERS)]
    kept.extend(buffers[::KEEP_EVERY])


@pytest.mark.skipif(Heap(0.0)._trim is None, reason="the C library has no malloc_trim")
def test_an_idle_poll_after_a_burst_gives_the_freed_buffers_back_once():
    heap = Heap(0.0)
    heap.idle(0.1)
    assert heap.trims == 0  # nothing received: nothing to give back
    kept: list[bytes] = []
    thread = threading.Thread(target=_burst, args=(kept,))
    thread.start()
    thread.join()
    held = _pss_mb()
    heap.busy()
    heap.idle(0.2)
    freed = BUFFERS * BUFFER_BYTES * (1 - 1 / KEEP_EVERY) / 2**20
    assert heap.trims == 1
    assert held - _pss_mb() > freed / 2, (held, _pss_mb(), freed)
    heap.idle(0.3)
    assert heap.trims == 1  # a second idle poll in a row finds nothing new
    assert len(kept) == BUFFERS // KEEP_EVERY


@pytest.mark.skipif(Heap(0.0)._trim is None, reason="the C library has no malloc_trim")
def test_an_applier_that_never_idles_trims_every_interval_while_it_receives():
    heap = Heap(0.0)
    heap.busy()
    heap.tick(TRIM_EVERY_S / 2)
    assert heap.trims == 0  # too soon
    heap.tick(TRIM_EVERY_S)
    assert heap.trims == 1
    heap.busy()
    heap.tick(TRIM_EVERY_S * 1.5)
    assert heap.trims == 1  # the interval counts from the last trim
    heap.tick(TRIM_EVERY_S * 2)
    assert heap.trims == 2
    heap.tick(TRIM_EVERY_S * 4)
    assert heap.trims == 2  # nothing received since: nothing to give back
    heap.busy()
    heap.idle(TRIM_EVERY_S * 4.1)  # an idle poll trims at once and restarts the interval
    heap.busy()
    heap.tick(TRIM_EVERY_S * 5)
    assert heap.trims == 3
