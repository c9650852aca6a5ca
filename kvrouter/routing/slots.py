"""``SlotManager``: the load each (worker_id, dp_rank) carries from the requests routed to it.

Dynamo's ``ActiveSequences`` (``spec/dynamo-semantics.md`` §5), whose numbers feed the cost's prefill
and decode terms (§4.2). Per worker it keeps a refcount per sequence hash of its active requests, so a
prefix shared by many prompts is one set of blocks, plus the sum of their not-yet-prefilled tokens
and a request count; per request it keeps what it added, so :meth:`SlotManager.free` takes back
exactly that. Dynamo's prompt trie answers prefix overlap in one walk; here the overlap walks the
request's hashes until the first one the worker's refcounts lack, O(overlap) dict probes per worker,
which is the same answer without a second structure to keep consistent.

Nothing runs in the background: the router calls :meth:`SlotManager.sweep` on its own schedule
(Dynamo checks every minute). Requests sit in a dict in insertion order and the clock never goes
backwards, so the oldest requests are always at the front and a sweep stops at the first young one:
O(expired) rather than O(active).

Left out of Dynamo's tracker: output-block growth (``router_track_output_blocks``), the active
sequence stride, and the ``aic`` prefill decay model. Not thread-safe; one owner calls it.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from ..errors import DuplicateRequest
from ..events.model import WorkerKey

__all__ = ["SlotManager"]

log = logging.getLogger(__name__)

DEFAULT_EXPIRY_SECS: Final = 300.0
"""Dynamo's stale-request expiry, ``DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS`` (§5). Pinned by
``tests/routing/test_slots.py::test_sweep_drops_requests_at_expiry``."""
DEFAULT_WORK_WINDOW_SECS: Final = 60.0
"""Time constant of :meth:`SlotManager.recent_prefill_tokens`: booked prefill counts ``exp(-age / 60 s)``.
Long against one request's life (seconds), so it remembers work already done, not only work in flight;
short against how fast a fleet's traffic mix moves. 60, 120 and 300 s balanced alike (docs/routing-benchmark.md)."""
FRESH_ID_BASE: Final = 1 << 64
"""First stand-in hash under ``assume_kv_reuse=False``: above every u64 sequence hash, so a stand-in
can never equal a real hash."""


@dataclass(slots=True)
class _Request:
    """What one active request added to its worker, kept so that freeing it takes back exactly that."""

    worker: WorkerKey
    hashes: tuple[int, ...]
    """The hashes counted in the worker's refcounts (stand-ins when KV reuse is not assumed)."""
    prefill_tokens: int
    """Tokens still to prefill; 0 once the first token is out."""
    started_at: float


@dataclass(slots=True)
class _WorkerLoad:
    """One worker's totals over its active requests; dropped when the last request leaves."""

    blocks: Counter[int] = field(default_factory=Counter)
    """Sequence hash -> number of active requests (occurrences) holding it."""
    prefill_tokens: int = 0
    requests: int = 0


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
            when off, each request's hashes are replaced by fresh stand-ins, so nothing is shared and
            no new request overlaps an active one.
        expiry_secs: age at which :meth:`sweep` drops a request that was never freed.
        work_window_secs: time constant of :meth:`recent_prefill_tokens`'s exponential decay.
        clock: seconds, never going backwards; ``time.monotonic`` unless a test injects one.

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
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size!r}")
        if not expiry_secs > 0:  # `not >` also rejects NaN
            raise ValueError(f"expiry_secs must be > 0 seconds, got {expiry_secs!r}")
        if not work_window_secs > 0:
            raise ValueError(f"work_window_secs must be > 0 seconds, got {work_window_secs!r}")
        self._block_size = block_size
        self._track_active_blocks = track_active_blocks
        self._track_prefill_tokens = track_prefill_tokens
        self._assume_kv_reuse = assume_kv_reuse
        self._expiry_secs = expiry_secs
        self._work_window_secs = work_window_secs
        self._clock = clock
        self._fresh_ids = itertools.count(FRESH_ID_BASE)
        """Stand-in hashes under ``assume_kv_reuse=False``; per manager, so no state is shared."""
        self._requests: dict[str, _Request] = {}
        """Active requests, oldest first (insertion order, with a clock that never goes backwards)."""
        self._loads: dict[WorkerKey, _WorkerLoad] = {}
        """Only workers with at least one active request."""
        self._work: dict[WorkerKey, tuple[float, float]] = {}
        """(decayed booked prefill tokens, when last updated) per worker ever booked prefill; kept when
        the worker's last request leaves, since the work it did still counts."""

    def add_request(
        self,
        request_id: str,
        worker: WorkerKey,
        sequence_hashes: Sequence[int],
        isl_tokens: int,
        overlap_blocks: int,
    ) -> None:
        """Count a request just routed to ``worker`` (Dynamo's ``AddRequest``).

        Args:
            request_id: unique among active requests.
            worker: the (worker_id, dp_rank) chosen.
            sequence_hashes: the request's chained sequence hashes, one per full block.
            isl_tokens: prompt length in tokens.
            overlap_blocks: leading blocks the worker already caches; their tokens need no prefill.

        Raises:
            DuplicateRequest: ``request_id`` is already active; nothing is changed.
        """
        if (active := self._requests.get(request_id)) is not None:
            worker_id, dp_rank = active.worker
            raise DuplicateRequest(f"request {request_id!r} is already active on worker {worker_id} dp {dp_rank}")
        if not self._track_active_blocks:
            hashes: tuple[int, ...] = ()
        elif self._assume_kv_reuse:
            hashes = tuple(sequence_hashes)
        else:
            hashes = tuple(itertools.islice(self._fresh_ids, len(sequence_hashes)))
        prefill_tokens = self._new_prefill_tokens(isl_tokens, overlap_blocks)
        self._requests[request_id] = _Request(worker, hashes, prefill_tokens, self._clock())
        load = self._loads.setdefault(worker, _WorkerLoad())
        load.blocks.update(hashes)
        load.prefill_tokens += prefill_tokens
        load.requests += 1
        if prefill_tokens:
            now = self._clock()
            self._work[worker] = (self._decayed(worker, now) + prefill_tokens, now)

    def mark_prefill_completed(self, request_id: str) -> None:
        """The request's first token is out: its prompt tokens stop counting as queued prefill.

        Idempotent; an unknown (or already freed) id is a no-op, since completion and cancel races
        are normal.
        """
        request = self._requests.get(request_id)
        if request is None or not request.prefill_tokens:
            return
        self._loads[request.worker].prefill_tokens -= request.prefill_tokens
        request.prefill_tokens = 0

    def free(self, request_id: str) -> None:
        """The request completed or was cancelled: take back everything it added.

        Idempotent; an unknown (or already freed or swept) id is a no-op.
        """
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        load = self._loads[request.worker]
        for seq_hash in request.hashes:
            remaining = load.blocks[seq_hash] - 1
            if remaining:
                load.blocks[seq_hash] = remaining
            else:
                del load.blocks[seq_hash]
        load.prefill_tokens -= request.prefill_tokens
        load.requests -= 1
        if not load.requests:
            del self._loads[request.worker]

    def sweep(self) -> list[str]:
        """Drop the requests that are ``expiry_secs`` old or older, as if freed.

        They were lost: a completion or cancel that never reached the router would otherwise pin
        their load on the worker forever. Logs one warning when it drops anything.

        Returns:
            The dropped request ids, oldest first.
        """
        cutoff = self._clock() - self._expiry_secs
        expired: list[str] = []
        for request_id, request in self._requests.items():
            if request.started_at > cutoff:
                break
            expired.append(request_id)
        for request_id in expired:
            self.free(request_id)
        if expired:
            log.warning(
                "stale requests expired count=%d expiry_secs=%s first=%s", len(expired), self._expiry_secs, expired[0]
            )
        return expired

    def active_prefill_tokens(self, worker: WorkerKey) -> int:
        """Prompt tokens of the worker's requests that have not produced a first token."""
        load = self._loads.get(worker)
        return 0 if load is None else load.prefill_tokens

    def recent_prefill_tokens(self, worker: WorkerKey) -> float:
        """Prefill tokens booked on the worker (each request's tokens beyond its overlap, as counted at
        :meth:`add_request`), each decayed by ``exp(-age / work_window_secs)``; freeing a request does
        not take its work back. 0 when prefill tokens are not tracked."""
        return self._decayed(worker, self._clock())

    def active_blocks(self, worker: WorkerKey) -> int:
        """Distinct sequence hashes over the worker's active requests: a shared prefix counts once."""
        load = self._loads.get(worker)
        return 0 if load is None else len(load.blocks)

    def active_requests(self, worker: WorkerKey) -> int:
        """Requests routed to the worker and neither freed nor swept."""
        load = self._loads.get(worker)
        return 0 if load is None else load.requests

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
        load = self._loads.get(worker)
        if load is None:
            return len(sequence_hashes)
        overlap = 0
        if self._assume_kv_reuse:
            held = load.blocks
            for seq_hash in sequence_hashes:  # hot path: once per candidate worker per request
                if seq_hash not in held:
                    break
                overlap += 1
        return len(load.blocks) + len(sequence_hashes) - overlap

    def potential_prefill_tokens(self, worker: WorkerKey, isl_tokens: int, overlap_blocks: int) -> int:
        """The worker's queued prefill tokens if this request were added: its tokens beyond the
        ``overlap_blocks`` the worker caches (§5). 0 when prefill tokens are not tracked, as in Dynamo,
        where the request adds nothing and the active figure is 0 too."""
        return self.active_prefill_tokens(worker) + self._new_prefill_tokens(isl_tokens, overlap_blocks)

    def workers(self) -> set[WorkerKey]:
        """Workers with at least one active request."""
        return set(self._loads)

    def _decayed(self, worker: WorkerKey, now: float) -> float:
        entry = self._work.get(worker)
        if entry is None:
            return 0.0
        tokens, at = entry
        return tokens * math.exp(-max(0.0, now - at) / self._work_window_secs)

    def _new_prefill_tokens(self, isl_tokens: int, overlap_blocks: int) -> int:
        """Tokens a request still has to prefill on a worker caching ``overlap_blocks`` of it; never
        negative (Dynamo logs and returns 0 when the cached tokens exceed the prompt)."""
        if not self._track_prefill_tokens:
            return 0
        return max(0, isl_tokens - overlap_blocks * self._block_size)
