"""``WorkerSlots``: a dense number per (worker_id, dp_rank), so per-worker state can live in arrays.

A decision looks at every candidate's overlap and load; with thousands of workers, a dict and an object
per worker per request is where the time goes. Numbering workers densely lets the index answer into a
``(tiers, slots)`` array and the slot manager keep its counters in arrays indexed the same way, so one
compiled pass serves every candidate. Slots are handed out on first sight and never reused: a worker that
leaves keeps its number (its counters go back to zero), so an array indexed by slot never needs
renumbering. The cost is one slot per worker ever seen, a few bytes each.

``version`` moves whenever a slot is added, so whoever derives a table from the numbering (a shard's
mask bit -> slot map) knows when to rebuild it. It is drawn from one process-wide counter, so no two
numberings ever show the same version: a table stamped with a version names its numbering too (the
reader's context, which a compiled decision checks without asking Python which numbering it follows).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

import numpy as np
import numpy.typing as npt

from ..events.model import StorageTier, WorkerKey

__all__ = ["WorkerSlots", "overlaps_from_tiers"]

_VERSIONS = itertools.count(1)
"""Every numbering's versions, process-wide (0 is none: what a table following no numbering shows)."""


class WorkerSlots:
    """The numbering: ``slot(key)`` gives (and on first sight assigns) a worker's dense slot."""

    def __init__(self, workers: Iterable[WorkerKey] = ()) -> None:
        self._slots: dict[WorkerKey, int] = {}
        self._keys: list[WorkerKey] = []
        self._ids = np.empty(0, dtype=np.uint64)
        self._ranks = np.empty(0, dtype=np.uint64)
        self.version = next(_VERSIONS)
        """Moves (to a number no numbering had) whenever a slot is added."""
        for worker in workers:
            self.slot(worker)

    def slot(self, worker: WorkerKey) -> int:
        slot = self._slots.get(worker)
        if slot is None:
            slot = self._slots[worker] = len(self._keys)
            self._keys.append(worker)
            self.version = next(_VERSIONS)
        return slot

    def slots(self, workers: Iterable[WorkerKey]) -> npt.NDArray[np.int64]:
        """The slots of ``workers``, in order, as an array (assigning new ones)."""
        return np.fromiter((self.slot(w) for w in workers), dtype=np.int64)

    def get(self, worker: WorkerKey) -> int | None:
        """The worker's slot, or None if it never had one (nothing is assigned)."""
        return self._slots.get(worker)

    def key(self, slot: int) -> WorkerKey:
        return self._keys[slot]

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, worker: object) -> bool:
        return worker in self._slots

    @property
    def ids(self) -> npt.NDArray[np.uint64]:
        """Worker id per slot."""
        self._refresh()
        return self._ids

    @property
    def ranks(self) -> npt.NDArray[np.uint64]:
        """Dp rank per slot."""
        self._refresh()
        return self._ranks

    def _refresh(self) -> None:
        if len(self._ids) != len(self._keys):
            self._ids = np.fromiter((k[0] for k in self._keys), dtype=np.uint64, count=len(self._keys))
            self._ranks = np.fromiter((k[1] for k in self._keys), dtype=np.uint64, count=len(self._keys))


def overlaps_from_tiers(
    by_tier: Mapping[StorageTier, Mapping[WorkerKey, int]], slots: WorkerSlots, ntiers: int = len(StorageTier)
) -> npt.NDArray[np.int64]:
    """An index's ``find_matches_by_tier`` answer as a ``(ntiers, len(slots))`` array, for indexes that
    answer in dicts (``RadixIndex``, ``ApproxIndex``); workers without a slot are skipped."""
    out = np.zeros((ntiers, len(slots)), dtype=np.int64)
    for tier in list(StorageTier)[:ntiers]:
        row = out[tier.rank]
        for worker, depth in by_tier.get(tier, {}).items():
            slot = slots.get(worker)
            if slot is not None:
                row[slot] = depth
    return out
