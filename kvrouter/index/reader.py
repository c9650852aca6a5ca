"""``IndexReader``: overlap queries over every shard, from any process, without a lock or a message.

A reader maps the control segment and each shard's current segment read-only, turns the query's local
hashes into sequence hashes once, and runs the compiled walk over each shard that has live keys,
merging the per-bit scores into worker keys through the shard's worker rows. It never writes shared
memory and never blocks a writer (``_kernels.py``); when a shard's epoch moves (growth, restart) it
remaps and walks again, so a walk's bits are always named through the rows of the table's own writer.

A slot (or the rows generation) left odd for ``kernels.STUCK_SPINS`` reads brings the walk back here,
where the reader asks whether the shard's writer still lives: its pid in the control block, checked
with ``kill(pid, 0)`` and ``/proc/<pid>/stat`` (a killed applier is a zombie until reaped). A dead writer's
shard is given up at once and reported recovering; a live writer, preempted in the middle of a store,
is waited for (yielding the CPU to it), up to ``kernels.MAX_STUCK_READS`` reads in all. The rejected
alternative, spinning in the kernel until that bound, cost every query half a second after an applier
died mid-write. A reader in another pid namespace cannot see the applier and treats it as dead: it
reports the shard recovering for that query rather than waiting.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from ..events.model import StorageTier, WorkerKey
from ..hashing import local_hash_array
from . import _kernels as kernels
from .layout import H_LIVE, STATUS_RECOVERING, STATUS_STOPPED, Control, Segment

__all__ = ["IndexReader"]

log = logging.getLogger(__name__)

REMAP_ATTEMPTS: Final = 8
"""Tries to open a shard's newest segment while its writer may be replacing it again in between."""
PATIENT_QUERIES: Final = kernels.MAX_STUCK_READS // kernels.STUCK_SPINS
"""Compiled queries one shard gets, each spinning ``STUCK_SPINS`` reads, while its live writer is stuck
mid-write (or its table keeps being replaced) before the reader gives the shard up for this query."""


class IndexReader:
    """Answers ``find_matches`` / ``find_matches_by_tier`` like ``RadixIndex``, from shared memory."""

    def __init__(self, control_name: str) -> None:
        self.control = Control.attach(control_name)
        shards = self.control.shards
        self._segments: list[Segment | None] = [None] * shards
        self._epochs = [0] * shards
        self._blocks = [self.control.block(k) for k in range(shards)]
        self._rows = [self.control.worker_rows(k).reshape(-1) for k in range(shards)]
        self._torn: set[int] = set()
        self.writer_checks = 0
        """How often a walk met a slot left mid-write and the reader asked whether the shard's writer lives."""

    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> dict[WorkerKey, int]:
        """Per worker, the leading query blocks it holds on device. ``early_exit`` never changes the answer."""
        return self._query(local_hashes, 1)[0]

    def find_matches_by_tier(self, local_hashes: Sequence[int]) -> dict[StorageTier, dict[WorkerKey, int]]:
        """Per tier, per worker, the leading query blocks held in that tier or a faster one."""
        return dict(zip(StorageTier, self._query(local_hashes, len(StorageTier)), strict=True))

    def recovering(self) -> set[int]:
        """Shards whose status says recovering, or whose last walk gave up on a slot left mid-write."""
        marked = {k for k in range(self.control.shards) if self.control.status(k) == STATUS_RECOVERING}
        return marked | self._torn

    def _query(self, local_hashes: Sequence[int], ntiers: int) -> list[dict[WorkerKey, int]]:
        results: list[dict[WorkerKey, int]] = [{} for _ in range(ntiers)]
        if len(local_hashes) == 0:
            return results
        local = local_hash_array(local_hashes)
        for shard in range(self.control.shards):  # hot path: one compiled query per shard with live keys
            found = self._query_shard(shard, local, ntiers)
            if found is not None:
                for tier, worker_id, dp_rank, depth in found.tolist():
                    results[tier][(worker_id, dp_rank)] = depth
        return results

    def _query_shard(self, shard: int, local: npt.NDArray[np.uint64], ntiers: int) -> npt.NDArray[np.int64] | None:
        """The compiled query of one shard, asked again after a remap or while its live writer is mid-write;
        None when the shard has nothing to say (no table, no live key) or is given up for this query."""
        for _ in range(PATIENT_QUERIES):
            table = self._table(shard)
            if table is None or table[H_LIVE] == 0:
                return None
            found = kernels.query(table, self._blocks[shard], self._rows[shard], local, ntiers)
            code = int(found[0, 0]) if len(found) else 0
            if code >= 0:
                self._torn.discard(shard)
                return found
            if code == kernels.STALE_TABLE:
                continue  # the writer published a new table since ``_table`` looked: remap, ask again
            self.writer_checks += 1
            if not self._writer_alive(shard):
                self._give_up(shard, "writer-dead")
                return None
            os.sched_yield()  # on a small machine the preempted writer may need this core
        self._give_up(shard, "writer-stuck")
        return None

    def _give_up(self, shard: int, reason: str) -> None:
        if shard not in self._torn:
            log.warning("shard unreadable shard=%d reason=%s", shard, reason)
        self._torn.add(shard)
        return None

    def _writer_alive(self, shard: int) -> bool:
        """Whether the shard's applier, as its control block names it, is a live process."""
        pid = self.control.pid(shard)
        if pid <= 0 or self.control.status(shard) == STATUS_STOPPED:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # alive, owned by someone else
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")  # killed, not yet reaped
        return True

    def _table(self, shard: int) -> npt.NDArray[np.uint64] | None:
        """The shard's newest table, remapped when its epoch moved; None before it has one."""
        for _ in range(REMAP_ATTEMPTS):
            epoch = self.control.epoch(shard)
            current = self._segments[shard]
            if epoch == self._epochs[shard]:
                return None if current is None else current.words
            try:
                segment = Segment.attach(self.control.segment_name(shard), writable=False)
            except FileNotFoundError:
                continue  # replaced again between reading the name and opening it
            if current is not None:
                current.close()
            self._segments[shard], self._epochs[shard] = segment, epoch
        log.warning("shard segment kept moving shard=%d attempts=%d", shard, REMAP_ATTEMPTS)
        current = self._segments[shard]
        return None if current is None else current.words

    def close(self) -> None:
        for segment in self._segments:
            if segment is not None:
                segment.close()
        self._segments = [None] * self.control.shards
        self.control.close()
