"""The batch path's decoder of kvrouter batches (``kvrouter.py``, ``docs/wire-format.md``): ``runs.py`` says
why and what it leaves to the Python decoder, whose reading it copies field for field."""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from ..._jit import kernel
from ..model import TIER_NAMES
from ..packed import CLEARED, REMOVED, STORED, STORED_UNDER
from ._msgpack import NIL, Bytes, copy_words, header, name_index, packed_bin, read_int, read_number, skip
from ._runs_common import C_LAST, DONE, GAVE_UP, NEED_ROOM, finish

__all__ = ["KVROUTER_NAMES", "decode_kvrouter_runs"]

K_VERSION, K_TS, K_WORKER, K_RANK, K_EVENTS = 0, 1, 2, 3, 4
KVROUTER_KEYS: Final = ("v", "ts", "worker_id", "dp_rank", "events")
"""The keys of a kvrouter batch this pass reads, by their ``K_*`` code (``codecs/kvrouter.py``)."""
KVROUTER_TAGS: Final = ("S", "R", "C")
K_STORED, K_REMOVED, K_CLEARED = len(KVROUTER_KEYS), len(KVROUTER_KEYS) + 1, len(KVROUTER_KEYS) + 2
K_TIERS_AT: Final = len(KVROUTER_KEYS) + len(KVROUTER_TAGS)
KVROUTER_NAMES: Final = (*KVROUTER_KEYS, *KVROUTER_TAGS, *TIER_NAMES)


@kernel
def decode_kvrouter_runs(
    buf: Bytes,
    bounds: npt.NDArray[np.int64],
    first: int,
    expected: np.uint64,
    names: Bytes,
    name_bounds: npt.NDArray[np.int64],
    tier_ranks: npt.NDArray[np.int64],
    worker_id: np.uint64,
    rank: int,
    kinds: npt.NDArray[np.uint8],
    tiers: npt.NDArray[np.uint8],
    parents: npt.NDArray[np.uint64],
    offsets: npt.NDArray[np.int64],
    engine: npt.NDArray[np.uint64],
    local: npt.NDArray[np.uint64],
    stamps: npt.NDArray[np.float64],
    fields: npt.NDArray[np.int64],
    word: npt.NDArray[np.uint64],
    real: npt.NDArray[np.float64],
    counts: npt.NDArray[np.int64],
) -> int:
    """:func:`decode_engine_runs` for kvrouter batches (``{v, ts, worker_id, dp_rank, events}``, hashes as packed
    bins), whose events carry ids: every event of the run must be the next id from ``expected`` on, and
    ``counts[C_LAST]`` gets the last id taken. A batch of no event is left to the stream, which ignores it."""
    n_events = 0
    n_blocks = 0
    n_local = 0
    offsets[0] = 0
    status = DONE
    m = first
    last = expected - np.uint64(1)
    while m < bounds.size - 1:
        msg = buf[bounds[m] : bounds[m + 1]]
        events, blocks, nlocal, before = n_events, n_blocks, n_local, last
        status = GAVE_UP
        kind, count, head = header(msg, 0)
        if kind != 2:
            break
        pos = head
        fields[: len(KVROUTER_KEYS)] = -1
        for _ in range(count):
            code = name_index(msg, pos, names, name_bounds, 0, len(KVROUTER_KEYS))
            if code == -2:
                pos = -1
                break
            pos = skip(msg, pos)
            if pos < 0 or (code >= 0 and fields[code] >= 0):
                pos = -1
                break
            if code >= 0:
                fields[code] = pos
            pos = skip(msg, pos)
            if pos < 0:
                break
        if pos != msg.size or fields[K_VERSION] < 0 or fields[K_WORKER] < 0 or fields[K_RANK] < 0:
            break
        if fields[K_EVENTS] < 0:
            break
        after, value, negative = read_int(msg, fields[K_VERSION])
        if after < 0 or negative or value != np.uint64(1):
            break
        after, value, negative = read_int(msg, fields[K_WORKER])
        if after < 0 or negative or value != worker_id:
            break
        after, value, negative = read_int(msg, fields[K_RANK])
        if after < 0 or negative or value != np.uint64(rank):
            break
        stamp = 0.0
        at = fields[K_TS]
        if at >= 0 and msg[at] != NIL:
            after, stamp = read_number(msg, at, word, real)
            if after < 0:
                break
        kind, n, head = header(msg, fields[K_EVENTS])
        if kind != 1 or n == 0:
            break
        pos = fields[K_EVENTS] + head
        ok = True
        for _ in range(n):  # hot path: one event
            kind, items, head = header(msg, pos)
            if kind != 1 or items < 3:
                ok = False
                break
            at = pos + head
            tag = name_index(msg, at, names, name_bounds, K_STORED, K_CLEARED + 1)
            at = skip(msg, at)
            if tag < 0 or at < 0:
                ok = False
                break
            after, value, negative = read_int(msg, at)
            if after < 0 or negative or value != last + np.uint64(1):
                ok = False
                break
            last = value
            which = name_index(msg, after, names, name_bounds, K_TIERS_AT, name_bounds.size - 1)
            if which < 0:
                ok = False
                break
            tier = tier_ranks[which - K_TIERS_AT]
            at = skip(msg, after)
            if n_events >= kinds.size:
                status = NEED_ROOM
                ok = False
                break
            if tag == K_CLEARED:
                kinds[n_events] = CLEARED
            elif tag == K_REMOVED:
                if items < 4:
                    ok = False
                    break
                start, nhashes = packed_bin(msg, at, 8)
                if start < 0 or nhashes == 0:
                    ok = False
                    break
                if n_blocks + nhashes > engine.size:
                    status = NEED_ROOM
                    ok = False
                    break
                copy_words(msg, start, nhashes, engine, n_blocks)
                n_blocks += nhashes
                kinds[n_events] = REMOVED
            else:
                if items < 7:
                    ok = False
                    break
                parent = np.uint64(0)
                under = msg[at] != NIL
                if under:
                    after, parent, negative = read_int(msg, at)
                    if after < 0 or negative:
                        ok = False
                        break
                at = skip(msg, at)
                start, nhashes = packed_bin(msg, at, 8)
                at = skip(msg, at) if start >= 0 else -1
                from_local, nlocal = packed_bin(msg, at, 8) if at >= 0 else (-1, 0)
                at = skip(msg, at) if from_local >= 0 else -1
                if at < 0 or nhashes == 0 or nlocal != nhashes:
                    ok = False
                    break
                if msg[at] != NIL:  # the tokens, for recordings only: checked, not read
                    tokens_at, ntokens = packed_bin(msg, at, 4)
                    if tokens_at < 0 or ntokens % nhashes:
                        ok = False
                        break
                if n_blocks + nhashes > engine.size or n_local + nhashes > local.size:
                    status = NEED_ROOM
                    ok = False
                    break
                copy_words(msg, start, nhashes, engine, n_blocks)
                copy_words(msg, from_local, nhashes, local, n_local)
                n_blocks += nhashes
                n_local += nhashes
                kinds[n_events] = STORED_UNDER if under else STORED
                parents[n_events] = parent
            tiers[n_events] = tier
            n_events += 1
            offsets[n_events] = n_blocks
            pos = skip(msg, pos)
            if pos < 0:
                ok = False
                break
        if not ok:
            n_events, n_blocks, n_local, last = events, blocks, nlocal, before
            break
        stamps[m] = stamp
        status = DONE
        m += 1
    finish(counts, m, n_events, n_blocks, n_local, 0, kinds, tiers)
    counts[C_LAST] = np.int64(last)
    return status
