"""Where every word of the shared-memory index lives: segment names, the control segment, shard tables.

``docs/shm-engine.md`` draws the layout; this module is its single source: the kernels, the writer and
the readers all index segments through these constants, and nothing else knows an offset.

Segments are files in ``/dev/shm`` opened with ``os.open`` and mapped with ``mmap``, never through
``multiprocessing.shared_memory``: in Python 3.11 its resource tracker unlinks a segment when any
process that merely attached it exits (``spec/shm-engine.md`` §4.5). Here only the owner unlinks.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "MAX_INDEX_BLOCKS",
    "STATUS_RECOVERING",
    "STATUS_STARTING",
    "STATUS_STOPPED",
    "STATUS_UP",
    "Control",
    "Segment",
    "control_name",
    "lock_path",
    "shard_name",
    "stats_name",
    "unlink_segment",
]

SHM_DIR: Final = "/dev/shm"
PREFIX: Final = "kvrouter-"
"""Every segment, lock and socket kvrouter makes starts with this, so a sweep can find leftovers."""

TIERS: Final = 4
"""Masks per slot: device, host, disk, shared (``StorageTier`` order)."""
WORD_BITS: Final = 64

# -- shard segment ------------------------------------------------------------------------------
SHARD_MAGIC: Final = 0x6B76_7273_6861_7264  # "kvrshard"
HEADER_WORDS: Final = 16
"""Header words of the shard and control segments: two cache lines (the shard's uses nine words), so the
first slot or shard block still starts on a line of its own."""
H_MAGIC, H_CAPACITY, H_NWORDS, H_USED, H_EPOCH, H_TOMBS, H_LIVE, H_DIRTY, H_TIERS = range(9)
"""Shard header words: magic, slot capacity, mask words per tier, used slots (live + tombstones),
epoch, tombstones, live keys, the writer's dirty-slot bitmap while the table is being copied into its
successor (an address in the writer's own process, 0 otherwise: no reader looks at it; ``growth.Growth``),
and the tiers the slots have masks for (``H_TIERS``: 1 to ``TIERS``, see ``row_words``)."""
SLOT_KEY, SLOT_VERSION, SLOT_MASKS = 0, 1, 2
"""Within a slot row: the key, the seqlock version, then ``tiers * nwords`` mask words."""
ZERO_KEY: Final = 0x9E37_79B9_7F4A_7C15
"""Stored instead of a sequence hash of 0, since key 0 marks an empty slot (odds 2**-64 either way)."""
MIN_CAPACITY: Final = 1024
MAX_LOAD: Final = 0.5
"""Grow when used slots pass this share of capacity: linear probing stays short (``spec`` §3.1)."""
GROWING_LOAD: Final = 0.75
"""The load a table or map may reach while its successor is being built beside it (``growth.Growth``):
probes a little longer for a fraction of a second, instead of a writer waiting for the copy. Past it the
writer does wait (a burst of new keys faster than the copy)."""
MAP_MAX_LOAD: Final = 0.7
"""``MAX_LOAD`` of the applier's private maps (the engine map, refs). Only their writer probes them, once
per block of an event, where a table slot is probed by every query's walk; and the engine map has a row
per (worker, block) entry, the table a slot per distinct block, so it is most of the index's memory (in
process at 64 workers, 160 of 274 bytes a block at a load of 0.5). Longer probes cost the writer about
as much as the fewer, smaller growths save it (``docs/shm-engine.md``, "Memory")."""
MAP_GROWING_LOAD: Final = 0.85
"""``GROWING_LOAD`` of the private maps."""

MAX_INDEX_BLOCKS: Final = 1 << 23
"""The default index cap, in (worker, block) entries over all shards and tiers (``--max-index-blocks``).

An entry costs at most one table slot (24 bytes with up to 64 workers per shard caching on the device
alone, ``row_words(1, 1)``; 48 with all four tiers; plus the writer's 8-byte match stamp) and one
engine-map row (40 bytes, ``_kernels.MAP_ROW_WORDS``). Tables run at a load of 0.25 to 0.5, the engine
map at 0.35 to 0.7: on the device alone about 160 bytes an entry, 240 just after both doubled. 8 M
entries is then about 1.3 GiB, 1.9 at worst (less in a fleet with common prefixes: the slot is shared by
every worker holding the block), and holds the device caches of 256 engines of 30 k blocks (an 8 B model
on one 80 GB GPU at 16 tokens a block), or 64 such engines with a host tier four times
their device. An eviction adds a transient 16 bytes per engine-map row (its heap)."""
# -- control segment ----------------------------------------------------------------------------
CONTROL_MAGIC: Final = 0x6B76_7263_7472_6C00  # "kvrctrl"
LAYOUT_VERSION: Final = 5
"""2: worker rows grew to 16 words (event-plane cursor, gap counters, trust state); shards got a rows generation.
3: worker rows grew to 20 words: cached blocks in the host, disk and shared tiers beside the device count.
4: the index cap: worker rows grew to 22 words (entries evicted, by reason), shard blocks to 32 (entries,
budget, evictions by reason, events about evicted blocks, matched blocks stamped).
5: headers of 16 words; a shard table keeps masks only for the tiers in use (``H_TIERS``, ``row_words``)."""
C_MAGIC, C_VERSION, C_SHARDS, C_ROWS = range(4)
"""Control header words: magic, layout version, shard count, worker rows per shard."""
SHARD_BLOCK_WORDS: Final = 32
S_EPOCH, S_STATUS, S_PID, S_NWORDS, S_EVENTS, S_ERRORS = range(6)
ERROR_KINDS: Final = ("bad_event", "parent_not_found", "block_not_found", "invalid_block_sequence")
"""Per-shard error counters, in this order from word ``S_ERRORS``."""
S_LAST_EVENT: Final = S_ERRORS + len(ERROR_KINDS)
S_FLUSHED: Final = S_LAST_EVENT + 1
S_RESTARTS: Final = S_FLUSHED + 1
S_ROWS_GEN: Final = S_RESTARTS + 1
"""Bumped (to odd, then even) around every change of which worker a row names; a reader that sees it
move during a query re-reads, so a walk's bits are never attributed to a row's next owner."""
S_LAG: Final = S_ROWS_GEN + 1
"""The index lag in µs: how long after its engine stamped a batch the applier had it in the table,
smoothed over batches (each moves it an eighth of the way; 0 until a stamped batch came). Engine
stamps are the engine host's clock: across hosts the figure includes their clock offset (never below 1)."""
LAG_SMOOTHING: Final = 8
S_ENTRIES: Final = S_LAG + 1
"""(worker, block) entries in the shard's table, every tier: the sum of its rows' cached counts."""
S_BUDGET: Final = S_ENTRIES + 1
"""The shard's share of ``--max-index-blocks`` (0: no cap); past it the applier evicts (``ShardWriter``)."""
S_NAME: Final = 16
NAME_BYTES: Final = 64
S_EVICTED: Final = S_NAME + NAME_BYTES // 8
"""Entries evicted by the cap, by reason (``EVICT_REASONS``), from this word: never reset, not even by a
restart, so ``/metrics`` can show them as counters."""
EVICT_REASONS: Final = ("untrusted", "lru")
"""Why the cap evicted an entry: its worker was not ``exact``, or it was the least recently stored."""
S_AFTER_EVICTION: Final = S_EVICTED + len(EVICT_REASONS)
"""Events naming a block the cap had evicted from their worker (a Removed of it, a Stored under it): the
index's doing, not the engine's, so they are counted here and not as ``block_not_found`` /
``parent_not_found``."""
S_TOUCHED: Final = S_AFTER_EVICTION + 1
"""Blocks the front reported matched by its decisions and the applier found in the table (``touch``): the
"matched" half of the cap's least-recently-used order."""
WORKER_ROWS: Final = 4096
"""Worker rows per shard: row b describes mask bit b. 4096 leaves room for any fleet one router serves."""
(
    W_WORKER_ID,
    W_DP_RANK,
    W_IN_USE,
    W_CACHED,
    W_LAST_ID,
    W_LAST_EVENT_NS,
    W_GAPS_DETECTED,
    W_GAPS_RECOVERED,
    W_GAPS_LOST,
    W_STATE,
    W_STALE,
    W_DROPPED_BLOCKS,
    W_SKIPPED_EVENTS,
    W_BAD_FRAMES,
    W_RESTARTS,
    W_EVENTS,
    W_CACHED_HOST,
    W_CACHED_DISK,
    W_CACHED_SHARED,
    W_SEEN,
    W_EVICTED_UNTRUSTED,
    W_EVICTED_LRU,
) = range(22)
"""Worker row words: identity and cached device blocks (the writer), then the event plane's view of the
worker: the last sequence number or event id applied (``NO_ID`` before the first), when its last message
arrived, gaps detected / recovered / lost, the trust state (``WORKER_*``), the stale flag, blocks dropped
for a wrong block size, events skipped (another attention group), undecodable frames, engine restarts
seen, and events applied; then cached blocks in the host, disk and shared tiers (the writer). The other
tiers' counts come after the rest, not beside ``W_CACHED``, so every word of layout 2 kept its place;
word 19, ``W_SEEN``, is what the plane saw that contradicts the registration (:func:`seen_word`; zero
while nothing did), for the service's misconfiguration checks; words 20-21, the worker's entries the index
cap evicted, by reason (``EVICT_REASONS``)."""
W_EVICTED_BY_REASON: Final = (W_EVICTED_UNTRUSTED, W_EVICTED_LRU)
W_CACHED_BY_TIER: Final = (W_CACHED, W_CACHED_HOST, W_CACHED_DISK, W_CACHED_SHARED)
"""Each tier's cached-blocks word, in ``StorageTier`` order (device, host, disk, shared)."""
WORKER_ROW_WORDS: Final = 22
SEEN_FORMAT_SHIFT: Final = 32
SEEN_RANK_SHIFT: Final = 40


def seen_word(word: int, *, block_size: int = 0, format_code: int = 0, rank: int | None = None) -> int:
    """``W_SEEN`` with one more fact set: bits 0-31 the block size of blocks dropped for not being the
    registered one; bits 32-39 one plus the index in ``plane.registry.FORMATS`` of a format that decodes
    frames the registered one refused; bits 40-55 one plus a dp rank whose batches came on this rank's
    port. Rules: zero means "not seen"; a fact is overwritten by the latest sighting."""
    if block_size:
        word = (word & ~0xFFFF_FFFF) | (block_size & 0xFFFF_FFFF)
    if format_code:
        word = (word & ~(0xFF << SEEN_FORMAT_SHIFT)) | ((format_code & 0xFF) << SEEN_FORMAT_SHIFT)
    if rank is not None:
        word = (word & ~(0xFFFF << SEEN_RANK_SHIFT)) | (((rank + 1) & 0xFFFF) << SEEN_RANK_SHIFT)
    return word


def unpack_seen(word: int) -> tuple[int, int, int | None]:
    """(block size seen or 0, format code or 0, dp rank seen or None) of a ``W_SEEN`` word."""
    rank = (word >> SEEN_RANK_SHIFT) & 0xFFFF
    return word & 0xFFFF_FFFF, (word >> SEEN_FORMAT_SHIFT) & 0xFF, rank - 1 if rank else None


NO_ID: Final = (1 << 64) - 1
"""``W_LAST_ID`` before any message was applied."""

WORKER_UNKNOWN: Final = 0
"""Registered, nothing heard yet."""
WORKER_EXACT: Final = 1
"""Every event since the worker's (re)start accounted for: the index holds what the engine holds."""
WORKER_PARTIAL: Final = 2
"""Some history was lost (a gap not recovered, a join without replay): the index may miss blocks."""
WORKER_RESTORING: Final = 3
"""A restore or a gap recovery is in flight; live events are buffered meanwhile."""
WORKER_STATES: Final = {
    WORKER_UNKNOWN: "unknown",
    WORKER_EXACT: "exact",
    WORKER_PARTIAL: "partial",
    WORKER_RESTORING: "restoring",
}

STATUS_STARTING: Final = 0
STATUS_UP: Final = 1
STATUS_RECOVERING: Final = 2
STATUS_STOPPED: Final = 3


def control_name(owner_pid: int) -> str:
    return f"{PREFIX}{owner_pid}-ctl"


def stats_name(owner_pid: int) -> str:
    """The stats segment ``kvrouter up``'s front publishes beside its engine's (``stats/segment.py``)."""
    return f"{PREFIX}{owner_pid}-stats"


def shard_name(owner_pid: int, shard: int, epoch: int) -> str:
    return f"{PREFIX}{owner_pid}-s{shard}-e{epoch}"


def lock_path(owner_pid: int, shard: int) -> str:
    return f"{SHM_DIR}/{PREFIX}{owner_pid}-s{shard}.lock"


def unlink_segment(name: str) -> None:
    """Remove ``/dev/shm/<name>``; a name already gone is fine (the owner may be cleaning up twice)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"{SHM_DIR}/{name}")


def row_words(nwords: int, tiers: int) -> int:
    """A slot's words: key, version, and ``nwords`` mask words for each of the table's first ``tiers`` tiers.

    Why not always ``TIERS``: most fleets cache on the device only, and the three masks no event ever sets
    were most of a slot (at 256 workers a shard, 144 bytes where 48 hold anything), so most of every
    probe's cache lines and of the table's memory. A table starts with the device tier alone, and its
    writer widens it (a copy, like a growth) the first time a worker stores in a slower tier; a reader
    takes a tier past ``tiers`` as empty."""
    return SLOT_MASKS + tiers * nwords


def shard_words(capacity: int, nwords: int, tiers: int) -> int:
    return HEADER_WORDS + capacity * row_words(nwords, tiers)


@dataclass(eq=False)
class Segment:
    """One mapped segment: its name, the mapping, and a u64 view of all of it."""

    name: str
    mapping: mmap.mmap
    words: npt.NDArray[np.uint64]

    @classmethod
    def create(cls, name: str, n_words: int, *, populate: bool = True) -> Segment:
        """A new zeroed segment; fails if the name exists (a stale owner must be swept first).

        Its pages are populated at creation (``MAP_POPULATE``): a table is written at random, and taking
        a page fault on each first touch, inside the writer's hot loop, halved the apply rate. A growth's
        helper passes ``populate=False`` and populates in steps (``growth.populate_in_steps``).
        """
        fd = os.open(f"{SHM_DIR}/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, n_words * 8)
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            mapping = mmap.mmap(fd, n_words * 8, flags=flags)
        finally:
            os.close(fd)
        return cls(name, mapping, np.frombuffer(mapping, dtype=np.uint64))

    @classmethod
    def attach(cls, name: str, *, writable: bool) -> Segment:
        """Map an existing segment; read-only mappings are ``PROT_READ``: a reader cannot write by mistake."""
        fd = os.open(f"{SHM_DIR}/{name}", os.O_RDWR if writable else os.O_RDONLY)
        try:
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            mapping = mmap.mmap(fd, 0, access=access)
        finally:
            os.close(fd)
        return cls(name, mapping, np.frombuffer(mapping, dtype=np.uint64))

    def close(self) -> None:
        """Unmap. Our numpy view is dropped first; if another view of it is still alive somewhere (a
        caller's local variable), the mapping is left to close when that view is collected."""
        del self.words
        with contextlib.suppress(BufferError):
            self.mapping.close()


class Control:
    """The control segment: shard epochs, segment names, statuses, counters and worker rows.

    Each shard's block and rows are written only by that shard's applier (the supervisor writes status and
    restarts while no applier runs for the shard); everyone else reads.
    """

    def __init__(self, segment: Segment) -> None:
        words = segment.words
        if int(words[C_MAGIC]) != CONTROL_MAGIC or int(words[C_VERSION]) != LAYOUT_VERSION:
            raise ValueError(f"{segment.name} is not a kvrouter control segment of layout {LAYOUT_VERSION}")
        self.segment = segment
        self.name = segment.name
        self.shards = int(words[C_SHARDS])
        self.rows = int(words[C_ROWS])
        self._blocks = words[HEADER_WORDS : HEADER_WORDS + self.shards * SHARD_BLOCK_WORDS].reshape(
            self.shards, SHARD_BLOCK_WORDS
        )
        start = HEADER_WORDS + self.shards * SHARD_BLOCK_WORDS
        self._workers = words[start : start + self.shards * self.rows * WORKER_ROW_WORDS].reshape(
            self.shards, self.rows, WORKER_ROW_WORDS
        )

    @classmethod
    def create(cls, name: str, shards: int) -> Control:
        total = HEADER_WORDS + shards * (SHARD_BLOCK_WORDS + WORKER_ROWS * WORKER_ROW_WORDS)
        segment = Segment.create(name, total)
        segment.words[C_SHARDS] = shards
        segment.words[C_ROWS] = WORKER_ROWS
        segment.words[C_VERSION] = LAYOUT_VERSION
        segment.words[C_MAGIC] = CONTROL_MAGIC
        return cls(segment)

    @classmethod
    def attach(cls, name: str, *, writable: bool = False) -> Control:
        return cls(Segment.attach(name, writable=writable))

    # -- per-shard words ----------------------------------------------------------------------
    def block(self, shard: int) -> npt.NDArray[np.uint64]:
        """The shard's block of words (writable only through a writable attachment)."""
        block: npt.NDArray[np.uint64] = self._blocks[shard]
        return block

    def worker_rows(self, shard: int) -> npt.NDArray[np.uint64]:
        """The shard's worker rows, ``[rows, WORKER_ROW_WORDS]``; row b describes mask bit b."""
        rows: npt.NDArray[np.uint64] = self._workers[shard]
        return rows

    def epoch(self, shard: int) -> int:
        return int(self._blocks[shard, S_EPOCH])

    def status(self, shard: int) -> int:
        return int(self._blocks[shard, S_STATUS])

    def set_status(self, shard: int, status: int) -> None:
        self._blocks[shard, S_STATUS] = status

    def pid(self, shard: int) -> int:
        return int(self._blocks[shard, S_PID])

    def set_pid(self, shard: int, pid: int) -> None:
        self._blocks[shard, S_PID] = pid

    def flushed(self, shard: int) -> int:
        return int(self._blocks[shard, S_FLUSHED])

    def set_flushed(self, shard: int, token: int) -> None:
        self._blocks[shard, S_FLUSHED] = token

    def restarts(self, shard: int) -> int:
        return int(self._blocks[shard, S_RESTARTS])

    def add_restart(self, shard: int) -> None:
        self._blocks[shard, S_RESTARTS] += 1

    def segment_name(self, shard: int) -> str:
        raw = self._blocks[shard, S_NAME : S_NAME + NAME_BYTES // 8].tobytes()
        return raw.rstrip(b"\0").decode("ascii")

    def publish_segment(self, shard: int, name: str, epoch: int, nwords: int) -> None:
        """Point readers at a new shard segment: name and mask width first, the epoch last, so a reader
        that sees the new epoch finds the new name."""
        raw = name.encode("ascii").ljust(NAME_BYTES, b"\0")
        if len(raw) > NAME_BYTES:
            raise ValueError(f"segment name {name!r} is longer than {NAME_BYTES} bytes")
        self._blocks[shard, S_NAME : S_NAME + NAME_BYTES // 8] = np.frombuffer(raw, dtype=np.uint64)
        self._blocks[shard, S_NWORDS] = nwords
        self._blocks[shard, S_EPOCH] = epoch

    def count_events(self, shard: int, events: int, now_ns: int, sent_at: float = 0.0) -> None:
        """``events`` applied at ``now_ns``; ``sent_at`` is their batch's engine stamp [s] (0: none)."""
        block = self._blocks[shard]
        block[S_EVENTS] += events
        block[S_LAST_EVENT] = now_ns
        if sent_at > 0.0:
            lag = max(1, int(now_ns / 1e3 - sent_at * 1e6))
            before = int(block[S_LAG])
            block[S_LAG] = lag if before == 0 else max(1, before + (lag - before) // LAG_SMOOTHING)

    def count_error(self, shard: int, kind: str) -> None:
        self._blocks[shard, S_ERRORS + ERROR_KINDS.index(kind)] += 1

    def stats(self, shard: int) -> dict[str, int]:
        block = self._blocks[shard]
        counters = {kind: int(block[S_ERRORS + i]) for i, kind in enumerate(ERROR_KINDS)}
        return {
            "events_applied": int(block[S_EVENTS]),
            **counters,
            "last_event_ns": int(block[S_LAST_EVENT]),
            "lag_us": int(block[S_LAG]),
        }

    def cap(self, shard: int) -> tuple[int, int, dict[str, int], int]:
        """The index cap as the shard's applier applies it: (entries, budget or 0, evictions by reason,
        events about evicted blocks)."""
        block = self._blocks[shard]
        evicted = {reason: int(block[S_EVICTED + i]) for i, reason in enumerate(EVICT_REASONS)}
        return int(block[S_ENTRIES]), int(block[S_BUDGET]), evicted, int(block[S_AFTER_EVICTION])

    def touched(self, shard: int) -> int:
        """Matched blocks the shard's applier stamped (``S_TOUCHED``)."""
        return int(self._blocks[shard, S_TOUCHED])

    def workers(self, shard: int) -> dict[int, tuple[int, int, int]]:
        """Rows in use: mask bit → (worker_id, dp_rank, cached device blocks)."""
        rows = self._workers[shard]
        used = np.flatnonzero(rows[:, W_IN_USE])
        return {int(b): (int(rows[b, W_WORKER_ID]), int(rows[b, W_DP_RANK]), int(rows[b, W_CACHED])) for b in used}

    def cached_by_tier(self, shard: int) -> dict[int, tuple[int, int, int, int]]:
        """Rows in use: mask bit → cached blocks per tier (device, host, disk, shared)."""
        rows = self._workers[shard]
        used = np.flatnonzero(rows[:, W_IN_USE])
        device, host, disk, shared = W_CACHED_BY_TIER
        return {
            int(b): (int(rows[b, device]), int(rows[b, host]), int(rows[b, disk]), int(rows[b, shared])) for b in used
        }

    def close(self) -> None:
        del self._blocks, self._workers
        self.segment.close()

    def unlink(self) -> None:
        unlink_segment(self.name)
