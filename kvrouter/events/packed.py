"""Events packed as arrays: the run layout the compiled decoders write and the table kernels read.

A run of ``n`` events is five arrays, with no object per event or block: ``kinds[i]`` (below),
``tiers[i]`` (``StorageTier.rank``), ``parents[i]`` (the engine hash a store hangs under, read only
for ``STORED_UNDER``), ``offsets[i]:offsets[i + 1]`` the event's slice of ``engine`` (its engine
hashes), and ``local``, the stores' local hashes concatenated in event order (a removal or a clear
has none). Declared here, below both the codecs and the index, so neither imports the other for it.
"""

from __future__ import annotations

from typing import Final

__all__ = ["CLEARED", "REMOVED", "STORED", "STORED_UNDER"]

REMOVED: Final = 0
"""A removal of ``engine`` hashes."""
STORED: Final = 1
"""A store at the root."""
STORED_UNDER: Final = 2
"""A store under ``parents[i]``."""
CLEARED: Final = 3
"""Everything the holder held in the tier is gone; the table kernels' runs never hold one."""
