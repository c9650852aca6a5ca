"""``SlotManager``: the load each (worker_id, dp_rank) carries from the requests routed to it.

Dynamo's ``ActiveSequences`` (``spec/dynamo-semantics.md`` §5), whose numbers feed the cost's prefill
and decode terms (§4.2). Per worker it keeps a refcount per sequence hash of its active requests, so a
prefix shared by many prompts is one set of blocks, plus the sum of their not-yet-prefilled tokens
and a request count; per request it keeps what it added, so :meth:`SlotManager.free` takes back
exactly that.

Laid out for a decision over thousands of workers: every worker gets a dense slot (``numbering``, a
:class:`~kvrouter.index.dense.WorkerSlots` the router shares with the index), the per-worker totals
(prefill tokens, requests, distinct active blocks) are rows of one ``int64`` array indexed by slot
(``loads``), and the refcounts live in compiled tables (``_active.py``): per (sequence hash, slot) the
number of active requests holding it, per hash the bitset of slots holding it. Booking and freeing are
one compiled call over the request's hashes; the active-block overlap of a new prompt for every worker
at once is one compiled walk (:meth:`SlotManager.active_overlaps`, and inside the router's decision
kernel), linear in the matched blocks and the workers matching, nothing for the workers that hold none
of the prompt. The rejected first version kept a ``Counter`` per slot and a dict of big-int bitsets: 13
µs for a 64-block prompt's walk at 16 workers, and as much again to book it.

Nothing runs in the background: the router calls :meth:`SlotManager.sweep` on its own schedule
(Dynamo checks every minute). Requests sit in a dict in insertion order and the clock never goes
backwards, so the oldest requests are always at the front and a sweep stops at the first young one:
O(expired) rather than O(active).

Left out of Dynamo's tracker: output-block growth (``router_track_output_blocks``), the active
sequence stride, and the ``aic`` prefill decay model. Not thread-safe; one owner calls it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from ..errors import DuplicateRequest
from ..events.model import WorkerKey
from ..hashing import local_hash_array
from ..index.dense import WorkerSlots
from . import _active as active

__all__ = ["Booked", "SlotManager"]

log = logging.getLogger(__name__)

DEFAULT_EXPIRY_SECS: Final = 300.0
"""Dynamo's stale-request expiry, ``DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS`` (§5). Pinned by
``tests/routing/test_slots.py::test_sweep_drops_requests_at_expiry``."""
FRESH_ID_BASE: Final = 1 << 64
"""First stand-in hash under ``assume_kv_reuse=False`` in ``ReferenceSlotManager``: above every u64
sequence hash, so a stand-in can never equal a real hash. (``SlotManager`` only counts such blocks: each
is distinct by construction.)"""
DEFAULT_WORK_WINDOW_SECS: Final = 60.0
"""Time constant of :meth:`SlotManager.recent_prefill_tokens`: booked prefill counts ``exp(-age / 60 s)``.
Long against one request's life (seconds), so it remembers work already done, not only work in flight;
short against how fast a fleet's traffic mix moves. 30-300 s gave the same balance (docs/routing-benchmark.md)."""
WORK_REBASE_WINDOWS: Final = 512.0
"""Booked work is kept scaled by ``exp((booked at - epoch) / window)`` (``SlotManager.work``); when a
booking comes this many windows after the epoch (8.5 h at 60 s), every figure is brought back to a new
epoch first, so the scale stays below ``exp(512)`` (1e222, far from float64's 1.8e308) and a worker's
decayed work, scale times ``exp(-age / window)``, never meets an overflow."""
LOAD_WINDOW_SECS: Final = 4.0
"""Time constant of the load the decisions see (:meth:`SlotManager.seen_load`). Long against one burst (its
requests arrive within a few hundred milliseconds), short against how fast a fleet's load moves; 2-6 s hold
the predicted tier's goals alike (``docs/routing-benchmark.md``, "Choosing the weight")."""
AVERAGE, SINCE = 0, 1
"""Words of ``SlotManager.seen``: the average, and the clock minus ``work_epoch`` of the last decision (-inf
before the first, whose share then stands alone)."""
PREFILL, REQUESTS, BLOCKS = 0, 1, 2
"""Rows of ``SlotManager.loads``."""
LEADING, TOUCHED, ALIVE = 0, 1, 2
"""Rows of ``SlotManager.scratch``: the walk's answer per slot (kept all 0 between walks), the slots it
wrote, its working list."""
NO_HASHES: Final = np.empty(0, dtype=np.uint64)


@dataclass(slots=True)
class _Request:
    """What one active request added to its worker, kept so that freeing it takes back exactly that."""

    slot: int
    hashes: npt.NDArray[np.uint64]
    """The sequence hashes counted in the worker's refcounts (empty unless active blocks are tracked and
    KV reuse is assumed)."""
    blocks: int
    """Blocks of its own under ``assume_kv_reuse=False`` (0 otherwise: shared blocks are counted from
    ``hashes``)."""
    prefill_tokens: int
    """Tokens still to prefill; 0 once the first token is out."""
    started_at: float


@dataclass(frozen=True, slots=True)
class Booked:
    """What one active request holds on its worker, as :meth:`SlotManager.booked` tells it (the replica
    sync publishes it, and sends it to a late joiner)."""

    worker: WorkerKey
    hashes: npt.NDArray[np.uint64]
    """Its sequence hashes in the refcounts (empty unless blocks are tracked and KV reuse is assumed)."""
    blocks: int
    """Blocks of its own under ``assume_kv_reuse=False`` (0 otherwise)."""
    prefill_tokens: int
    """Tokens it still has to prefill; 0 once its first token is out."""


class SlotManager:
    """Active blocks, prefill tokens and request counts per worker, and the potential load of a new
    request on each.

    Args:
        block_size: tokens per KV block, the router's block size.
        track_active_blocks: count the blocks of active requests (``router_track_active_blocks``);
            when off, no hashes are kept and every block figure is 0.
        track_prefill_tokens: count queued prefill tokens (``router_track_prefill_tokens``); when off,
            every prefill figure is 0.
        assume_kv_reuse: active requests sharing a prefix share its blocks (``router_assume_kv_reuse``);
            when off, each request's blocks are its own, so nothing is shared and no new request
            overlaps an active one.
        expiry_secs: age at which :meth:`sweep` drops a request that was never freed.
        work_window_secs: time constant of :meth:`recent_prefill_tokens`'s exponential decay.
        clock: seconds, never going backwards; ``time.monotonic`` unless a test injects one.
        numbering: the dense worker slots to index the arrays by; a fresh one by default. The router
            hands the same numbering to the index, so both answer in the same columns.

    Raises:
        ValueError: ``block_size`` < 1, or ``expiry_secs`` or ``work_window_secs`` not > 0.
    """

    def __init__(
        self,
        *,
        block_size: int,
        track_active_blocks: bool = True,
        track_prefill_tokens: bool = True,
        assume_kv_reuse: bool = True,
        expiry_secs: float = DEFAULT_EXPIRY_SECS,
        work_window_secs: float = DEFAULT_WORK_WINDOW_SECS,
        clock: Callable[[], float] = time.monotonic,
        numbering: WorkerSlots | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size!r}")
        if not expiry_secs > 0:  # `not >` also rejects NaN
            raise ValueError(f"expiry_secs must be > 0 seconds, got {expiry_secs!r}")
        if not work_window_secs > 0:
            raise ValueError(f"work_window_secs must be > 0 seconds, got {work_window_secs!r}")
        self.work_window_secs = work_window_secs
        self._block_size = block_size
        self._track_active_blocks = track_active_blocks
        self._track_prefill_tokens = track_prefill_tokens
        self._assume_kv_reuse = assume_kv_reuse
        self._expiry_secs = expiry_secs
        self._clock = clock
        self.numbering = numbering if numbering is not None else WorkerSlots()
        """Worker -> dense slot, shared with the router (and through it the index)."""
        self._requests: dict[str, _Request] = {}
        """Active requests, oldest first (insertion order, with a clock that never goes backwards)."""
        self.pairs = active.pair_table()
        """(sequence hash, slot) -> active requests of the slot holding it (``_active.py``)."""
        self.holders = active.holder_table()
        """Sequence hash -> bitset of the slots holding it (``_active.py``)."""
        self._used = np.zeros(2, dtype=np.int64)
        """Rows in use in ``pairs`` and ``holders``."""
        self.loads = np.zeros((3, 0), dtype=np.int64)
        """Per slot: ``PREFILL`` prompt tokens of its requests that have not produced a first token;
        ``REQUESTS`` routed to it and neither freed nor swept; ``BLOCKS`` distinct blocks over its active
        requests (a shared prefix counts once)."""
        self.work = np.zeros(0, dtype=np.float64)
        """Per slot, uncached prefill tokens booked on it, each scaled by ``exp((booked at - work_epoch) /
        window)`` (kept after its requests leave: the work it did still counts). At ``now`` the slot's
        decayed work is this times ``exp(-(now - work_epoch) / window)``: the decision computes one
        ``exp``, not one per candidate (13 µs at 1,024 candidates). ``ReferenceSlotManager`` keeps the
        same figures, float for float."""
        self.work_epoch = 0.0
        self.seen = np.array([0.0, -math.inf])
        """The load the decisions see (``AVERAGE``, ``SINCE``), written by every decision with the predicted tier
        on (:meth:`seen_load`, or the decision kernel, float for float). Never replaced: the kernel holds its
        address."""
        self.scratch = np.zeros((3, 0), dtype=np.int64)
        """The active-block walk's per-slot buffers (``LEADING``, ``TOUCHED``, ``ALIVE``)."""
        self.generation = 0
        """Moves whenever one of the arrays above is replaced by a larger one: the router's decision kernel
        holds their addresses, and rebinds them when this moved."""
        self._ensure(len(self.numbering))

    @property
    def track_active_blocks(self) -> bool:
        """Whether block figures are counted (when not, every one is 0)."""
        return self._track_active_blocks

    def _ensure(self, slots: int) -> None:
        """Grow the per-slot arrays (doubling, zero-filled) to hold at least ``slots`` slots."""
        size = self.loads.shape[1]
        if slots <= size:
            return
        size = max(slots, 2 * size, 16)
        for name in ("loads", "work", "scratch"):
            old = getattr(self, name)
            new = np.zeros((*old.shape[:-1], size), dtype=old.dtype)
            new[..., : old.shape[-1]] = old
            setattr(self, name, new)
        self.holders = active.widen(self.holders, size)
        self.generation += 1

    def ready(self) -> None:
        """Size every per-slot array and table for every slot of ``numbering`` (the router calls this
        before reading them: the numbering grows when a new worker is first seen)."""
        if self.loads.shape[1] < len(self.numbering):
            self._ensure(len(self.numbering))

    @property
    def prefill_tokens(self) -> npt.NDArray[np.int64]:
        """Per slot, prompt tokens of its requests that have not produced a first token (read only)."""
        row: npt.NDArray[np.int64] = self.loads[PREFILL]
        return row

    @property
    def requests(self) -> npt.NDArray[np.int64]:
        """Per slot, requests routed to it and neither freed nor swept (read only)."""
        row: npt.NDArray[np.int64] = self.loads[REQUESTS]
        return row

    @property
    def blocks(self) -> npt.NDArray[np.int64]:
        """Per slot, distinct blocks over its active requests (read only)."""
        row: npt.NDArray[np.int64] = self.loads[BLOCKS]
        return row

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    def add_request(
        self,
        request_id: str,
        worker: WorkerKey,
        sequence_hashes: Sequence[int] | npt.NDArray[np.uint64],
        isl_tokens: int,
        overlap_blocks: int,
    ) -> None:
        """Count a request just routed to ``worker`` (Dynamo's ``AddRequest``).

        Args:
            request_id: unique among active requests.
            worker: the (worker_id, dp_rank) chosen.
            sequence_hashes: the request's chained sequence hashes, one per full block (a list or a
                ``uint64`` array).
            isl_tokens: prompt length in tokens.
            overlap_blocks: leading blocks the worker already caches; their tokens need no prefill.

        Raises:
            DuplicateRequest: ``request_id`` is already active; nothing is changed.
        """
        if (booked := self._requests.get(request_id)) is not None:
            worker_id, dp_rank = self.numbering.key(booked.slot)
            raise DuplicateRequest(f"request {request_id!r} is already active on worker {worker_id} dp {dp_rank}")
        slot = self.numbering.slot(worker)
        self._ensure(slot + 1)
        hashes = NO_HASHES
        added = own = 0
        if self._track_active_blocks and self._assume_kv_reuse and len(sequence_hashes):
            hashes = (
                sequence_hashes.astype(np.uint64)  # a copy: the caller's buffer may be reused
                if isinstance(sequence_hashes, np.ndarray)
                else local_hash_array(sequence_hashes)
            )
            used = self._used
            pairs, holders = self.pairs, self.holders
            self.pairs = active.room(pairs, int(used[0]), len(hashes), pairs=True)
            self.holders = active.room(holders, int(used[1]), len(hashes), pairs=False)
            if self.pairs is not pairs or self.holders is not holders:
                self.generation += 1
            added = active.add(self.pairs, self.holders, used, hashes, slot)
        elif self._track_active_blocks:
            added = own = len(sequence_hashes)
        prefill_tokens = self._new_prefill_tokens(isl_tokens, overlap_blocks)
        now = self._clock()
        self._requests[request_id] = _Request(slot, hashes, own, prefill_tokens, now)
        loads = self.loads
        loads[BLOCKS, slot] += added
        loads[PREFILL, slot] += prefill_tokens
        loads[REQUESTS, slot] += 1
        if prefill_tokens:
            window = self.work_window_secs
            if (now - self.work_epoch) / window > WORK_REBASE_WINDOWS:
                self.work *= math.exp(-(now - self.work_epoch) / window)
                self.seen[SINCE] -= now - self.work_epoch
                self.work_epoch = now
            work = self.work
            work[slot] = float(work[slot]) + prefill_tokens * math.exp((now - self.work_epoch) / window)

    def seen_load(self, queued_share: float) -> float:
        """Fold one decision's ``queued_share`` (its eligible candidates with prefill queued) into the load the
        decisions see, and return that load: the shares averaged as ``exp(-age / LOAD_WINDOW_SECS)``, each held
        over the time since the decision before. So the queue a request finds after a quiet spell weighs in
        full, and the queue a burst's later requests find, made of the burst's own earlier ones, hardly at
        all. The predicted tier's weight follows it (``cost.predicted_weight``)."""
        seen = self.seen
        before, since = seen.tolist()
        age = self._clock() - self.work_epoch
        fade = math.exp(-max(0.0, age - since) / LOAD_WINDOW_SECS)
        average: float = before * fade + queued_share * (1.0 - fade)
        seen[AVERAGE] = average
        seen[SINCE] = age
        return average

    def _decayed(self, slot: int, now: float) -> float:
        """The slot's booked prefill decayed to ``now`` (``math.exp``, as the decision kernel computes it)."""
        return float(self.work[slot]) * math.exp(-max(0.0, now - self.work_epoch) / self.work_window_secs)

    def recent_prefill_tokens(self, worker: WorkerKey) -> float:
        """Prefill tokens booked on the worker (each request's tokens beyond its overlap, as counted at
        :meth:`add_request`), each decayed by ``exp(-age / work_window_secs)``; freeing a request does not
        take its work back. 0 when prefill tokens are not tracked."""
        slot = self.numbering.get(worker)
        if slot is None or slot >= len(self.work):
            return 0.0
        return self._decayed(slot, self._clock())

    def mark_prefill_completed(self, request_id: str) -> None:
        """The request's first token is out: its prompt tokens stop counting as queued prefill.

        Idempotent; an unknown (or already freed) id is a no-op, since completion and cancel races
        are normal.
        """
        request = self._requests.get(request_id)
        if request is None or not request.prefill_tokens:
            return
        self.loads[PREFILL, request.slot] -= request.prefill_tokens
        request.prefill_tokens = 0

    def free(self, request_id: str) -> None:
        """The request completed or was cancelled: take back everything it added.

        Idempotent; an unknown (or already freed or swept) id is a no-op.
        """
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        slot = request.slot
        released = request.blocks
        if len(request.hashes):
            released += active.remove(self.pairs, self.holders, self._used, request.hashes, slot)
        loads = self.loads
        loads[BLOCKS, slot] -= released
        loads[PREFILL, slot] -= request.prefill_tokens
        loads[REQUESTS, slot] -= 1

    def drop_worker(self, worker: WorkerKey) -> list[str]:
        """Free every request booked on ``worker``: it restarted or left, and its requests went with it (their
        blocks, the predicted tier's among them, must not be credited to the engine that replaced it).

        Returns:
            The dropped request ids, oldest first.
        """
        slot = self.numbering.get(worker)
        dropped = [] if slot is None else [rid for rid, request in self._requests.items() if request.slot == slot]
        for request_id in dropped:
            self.free(request_id)
        return dropped

    def booked(self, request_id: str) -> Booked | None:
        """What the active request holds, or None when it is not active (never added, freed or swept)."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        return Booked(self.numbering.key(request.slot), request.hashes, request.blocks, request.prefill_tokens)

    def request_ids(self) -> list[str]:
        """The active requests' ids, oldest first."""
        return list(self._requests)

    @property
    def expiry_secs(self) -> float:
        """Age at which :meth:`sweep` drops a request."""
        return self._expiry_secs

    def sweep(self) -> list[str]:
        """Drop the requests that are ``expiry_secs`` old or older, as if freed.

        They were lost: a completion or cancel that never reached the router would otherwise pin
        their load on the worker forever. Logs one warning when it drops anything.

        Returns:
            The dropped request ids, oldest first.
        """
        now = self._clock()
        expired: list[str] = []
        for request_id, request in self._requests.items():
            # the age itself, not ``started_at > now - expiry``, whose rounding disagrees (300.2 - 300 < 0.2)
            if now - request.started_at < self._expiry_secs:
                break
            expired.append(request_id)
        for request_id in expired:
            self.free(request_id)
        if expired:
            log.warning(
                "stale requests expired count=%d expiry_secs=%s first=%s", len(expired), self._expiry_secs, expired[0]
            )
        return expired

    def _counter(self, row: int, worker: WorkerKey) -> int:
        slot = self.numbering.get(worker)
        return 0 if slot is None or slot >= self.loads.shape[1] else int(self.loads[row, slot])

    def active_prefill_tokens(self, worker: WorkerKey) -> int:
        """Prompt tokens of the worker's requests that have not produced a first token."""
        return self._counter(PREFILL, worker)

    def active_blocks(self, worker: WorkerKey) -> int:
        """Distinct sequence hashes over the worker's active requests: a shared prefix counts once."""
        return self._counter(BLOCKS, worker)

    def active_requests(self, worker: WorkerKey) -> int:
        """Requests routed to the worker and neither freed nor swept."""
        return self._counter(REQUESTS, worker)

    def potential_decode_blocks(self, worker: WorkerKey, sequence_hashes: Sequence[int]) -> int:
        """The worker's active blocks if this request were added: its blocks beyond the leading ones the
        worker's active requests already hold (§5). Only a leading run counts, as a block is reusable
        only with its whole prefix; later matches after a miss add blocks like any other.

        Args:
            worker: the candidate (worker_id, dp_rank).
            sequence_hashes: the request's chained sequence hashes, one per full block.

        Returns:
            0 when active blocks are not tracked.
        """
        if not self._track_active_blocks:
            return 0
        return self.active_blocks(worker) + len(sequence_hashes) - self.held_blocks(worker, sequence_hashes)

    def held_blocks(self, worker: WorkerKey, sequence_hashes: Sequence[int]) -> int:
        """Leading blocks of the prompt the worker's active requests hold (0 when blocks are not tracked or
        not shared): the run :meth:`potential_decode_blocks` takes off, and what the predicted tier credits
        beyond the device overlap."""
        slot = self.numbering.get(worker)
        if slot is None or not len(sequence_hashes) or not self._track_active_blocks:
            return 0
        return int(active.held_run(self.pairs, local_hash_array(sequence_hashes), slot))

    def active_overlaps(self, sequence_hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64] | None:
        """Per slot, the leading blocks of a prompt that the slot's active requests already hold: the
        ``overlap`` of :meth:`potential_decode_blocks` for every worker in one pass (the walk the router's
        decision kernel makes inside itself).

        Args:
            sequence_hashes: the prompt's sequence hashes.

        Returns:
            An array over every slot of ``numbering``, or None when no worker holds the first block
            (every overlap is 0), or blocks are not tracked or not shared.
        """
        if not self._used[1] or not len(sequence_hashes):
            return None
        self.ready()
        out = np.zeros(len(self.numbering), dtype=np.int64)
        scratch = self.scratch
        if not active.leading(self.holders, local_hash_array(sequence_hashes), out, scratch[TOUCHED], scratch[ALIVE]):
            return None
        return out

    def potential_prefill_tokens(self, worker: WorkerKey, isl_tokens: int, overlap_blocks: int) -> int:
        """The worker's queued prefill tokens if this request were added: its tokens beyond the
        ``overlap_blocks`` the worker caches (§5). 0 when prefill tokens are not tracked, as in Dynamo,
        where the request adds nothing and the active figure is 0 too."""
        return self.active_prefill_tokens(worker) + self._new_prefill_tokens(isl_tokens, overlap_blocks)

    def workers(self) -> set[WorkerKey]:
        """Workers with at least one active request."""
        key = self.numbering.key
        return {key(int(slot)) for slot in np.flatnonzero(self.loads[REQUESTS])}

    def _new_prefill_tokens(self, isl_tokens: int, overlap_blocks: int) -> int:
        """Tokens a request still has to prefill on a worker caching ``overlap_blocks`` of it; never
        negative (Dynamo logs and returns 0 when the cached tokens exceed the prompt)."""
        if not self._track_prefill_tokens:
            return 0
        return max(0, isl_tokens - overlap_blocks * self._block_size)
