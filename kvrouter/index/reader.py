"""``IndexReader``: overlap queries over every shard, from any process, without a lock or a message.

A reader maps the control segment and each shard's current segment read-only, turns the query's local
hashes into sequence hashes once, and runs the compiled walk over each shard that has live keys,
merging the per-bit scores into worker keys through the shard's worker rows. It never writes shared
memory and never blocks a writer (``_kernels.py``); when a shard's epoch moves (growth, restart) it
remaps before the next walk, and until then reads the old, frozen, consistent table.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from ..events.model import StorageTier, WorkerKey
from ..hashing import local_hash_array
from . import _kernels as kernels
from .layout import H_LIVE, STATUS_RECOVERING, Control, Segment

__all__ = ["IndexReader"]

log = logging.getLogger(__name__)

REMAP_ATTEMPTS: Final = 8
"""Tries to open a shard's newest segment while its writer may be replacing it again in between."""


class IndexReader:
    """Answers ``find_matches`` / ``find_matches_by_tier`` like ``RadixIndex``, from shared memory."""

    def __init__(self, control_name: str) -> None:
        self.control = Control.attach(control_name)
        shards = self.control.shards
        self._segments: list[Segment | None] = [None] * shards
        self._epochs = [0] * shards
        self._torn: set[int] = set()

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
            table = self._table(shard)
            if table is None or table[H_LIVE] == 0:
                continue
            found = kernels.query(table, self.control.worker_rows(shard), local, ntiers)
            if len(found) and found[0, 0] < 0:
                if shard not in self._torn:
                    log.warning("shard unreadable shard=%d reason=slot-left-mid-write", shard)
                self._torn.add(shard)
                continue
            self._torn.discard(shard)
            for tier, worker_id, dp_rank, depth in found.tolist():
                results[tier][(worker_id, dp_rank)] = depth
        return results

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
