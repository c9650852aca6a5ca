"""What both of the batch path's decoders report (``runs.py``): how a call ended, and how far it got."""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from ..._jit import kernel
from ..packed import CLEARED

__all__ = [
    "COUNT_WORDS",
    "C_BLOCKS",
    "C_EVENTS",
    "C_LAST",
    "C_LOCAL",
    "C_MIXED",
    "C_NEXT",
    "C_SKIPPED",
    "DONE",
    "GAVE_UP",
    "NEED_ROOM",
    "finish",
]

DONE: Final = 0
"""Every message from ``first`` on is in the run."""
GAVE_UP: Final = 1
"""Message ``counts[C_NEXT]`` is not one this pass decodes: the Python decoder takes it."""
NEED_ROOM: Final = 2
"""The run arrays are full at message ``counts[C_NEXT]``: apply what is there, then call again from it."""

C_NEXT, C_EVENTS, C_BLOCKS, C_LOCAL, C_SKIPPED, C_LAST, C_MIXED = 0, 1, 2, 3, 4, 5, 6
"""Words of ``counts``: the first message not in the run, then the run's events, engine hashes, local
hashes, the engine events skipped (another attention group, as ``RawBatch.skipped_events``), the last
event id taken (kvrouter batches, whose events carry ids), and 1 when the run holds a clear or more than one
tier (0: the table kernels can take it whole, in one call)."""
COUNT_WORDS: Final = C_MIXED + 1
"""The length of ``counts``."""


@kernel
def finish(
    counts: npt.NDArray[np.int64],
    m: int,
    events: int,
    blocks: int,
    local: int,
    skipped: int,
    kinds: npt.NDArray[np.uint8],
    tiers: npt.NDArray[np.uint8],
) -> None:
    """Write ``counts`` for a run of ``events`` events ending before message ``m``."""
    counts[C_NEXT] = m
    counts[C_EVENTS] = events
    counts[C_BLOCKS] = blocks
    counts[C_LOCAL] = local
    counts[C_SKIPPED] = skipped
    mixed = 0
    for i in range(events):
        if kinds[i] == CLEARED or tiers[i] != tiers[0]:
            mixed = 1
            break
    counts[C_MIXED] = mixed
