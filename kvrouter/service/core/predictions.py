"""``Predictions``: how the predicted tier's bets end, per worker (confirmed, contradicted or expired).

A reservation whose worker was credited blocks in flight (``Selection.predicted_blocks`` > 0: the prompt's
blocks its other requests were computing, not yet in its events) is a prediction. The router bet that the
worker would hold the prompt that deep. The bet is settled when the reservation ends:

- **confirmed**: freed with the index showing the worker holds the prompt at least as deep as predicted;
- **contradicted**: freed with the index showing less (the engine never published those blocks, or
  removed them), or the worker restarted or was unregistered with it booked;
- **expired**: dropped at its expiry without being freed (a completion that never came).

Settled at the end, not at the first token: a block's event leaves the engine when its prefill computed
it and races the first token to the router, while by the request's end it has had the whole decode, and
an engine cannot evict a block a running request uses. Only this service's own reservations are counted;
a peer settles its own. The counts are ``ServiceCounters.predictions`` (``PREDICTION_FIELDS``), the
accuracy of the predictions themselves beside the index's (``accuracy.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt

from ...errors import EngineError
from ...events.model import StorageTier, WorkerKey
from .counters import PREDICTION_FIELDS, ServiceCounters

__all__ = ["Predictions"]

MADE: Final = PREDICTION_FIELDS.index("made")
CONFIRMED: Final = PREDICTION_FIELDS.index("confirmed")
CONTRADICTED: Final = PREDICTION_FIELDS.index("contradicted")
EXPIRED: Final = PREDICTION_FIELDS.index("expired")


class TierIndex(Protocol):
    """What settling a bet reads: the index's overlap per tier (the engine, another front's view, any index)."""

    def find_matches_by_tier(self, local_hashes: Any) -> dict[StorageTier, dict[WorkerKey, int]]: ...


@dataclass(frozen=True, slots=True)
class _Open:
    worker: WorkerKey
    local: npt.NDArray[np.uint64]
    """The prompt's local block hashes."""
    depth: int
    """Leading blocks the worker was expected to hold: its device overlap plus the predicted blocks."""


class Predictions:
    """The open predictions of this service's reservations; see the module docstring. Event loop only."""

    def __init__(self, counters: ServiceCounters, index: TierIndex) -> None:
        self.counters = counters
        self.index = index
        self._open: dict[str, _Open] = {}

    def __len__(self) -> int:
        return len(self._open)

    def made(self, selection_id: str, worker: WorkerKey, local: npt.NDArray[np.uint64], depth: int) -> None:
        """A reservation on ``worker`` was booked expecting it to hold ``depth`` leading blocks of ``local``."""
        self._open[selection_id] = _Open(worker, local, depth)
        self._count(worker, MADE)

    def freed(self, selection_id: str) -> None:
        """The reservation ended: confirmed if the index holds the prompt as deep, else contradicted."""
        bet = self._open.pop(selection_id, None)
        if bet is None:
            return
        try:
            held = self.index.find_matches_by_tier(bet.local).get(StorageTier.DEVICE, {}).get(bet.worker, 0)
        except EngineError:  # the index is stopping: the bet stays made and unsettled, the free goes on
            return
        self._count(bet.worker, CONFIRMED if held >= bet.depth else CONTRADICTED)

    def expired(self, selection_id: str) -> None:
        """The reservation was dropped at its expiry."""
        bet = self._open.pop(selection_id, None)
        if bet is not None:
            self._count(bet.worker, EXPIRED)

    def dropped(self, selection_ids: Iterable[str]) -> None:
        """Their worker restarted or left with them booked: what was predicted there went with it."""
        for selection_id in selection_ids:
            bet = self._open.pop(selection_id, None)
            if bet is not None:
                self._count(bet.worker, CONTRADICTED)

    def _count(self, worker: WorkerKey, outcome: int) -> None:
        counts = self.counters.predictions.get(worker)
        if counts is None:
            counts = self.counters.predictions[worker] = [0] * len(PREDICTION_FIELDS)
        counts[outcome] += 1
