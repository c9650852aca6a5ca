"""The oracle of the decision path: the router and slot manager as they were before the fast path.

``ReferenceRouter`` and ``ReferenceSlotManager`` are the first ``Router`` and ``SlotManager``, kept verbatim
(only renamed): one dict and one dataclass per candidate worker, obviously correct and slow. The fast
``Router`` (``router.py``) and the array-backed ``SlotManager`` (``slots.py``) must choose the same worker,
consume the random source the same way and explain the same terms; ``tests/routing/test_equivalence.py``
drives both with the same random streams, and ``tools/bench_decide.py`` times one against the other. This
is what ``index/reference.py``'s ``RadixIndex`` is to the shared-memory engine. Nothing here is on a hot
path; change it only when the reference's semantics change.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..errors import ConfigError, DuplicateRequest, InvalidHashInput, NoWorkerAvailable
from ..events.model import StorageTier, WorkerKey
from ..hashing import block_hashes, sequence_hashes
from ..index import ApproxIndex
from .config import RouterConfig
from .cost import Load, Overlap, credit_scale, predicted_weight, worker_cost
from .router import SWEEP_INTERVAL_SECS, OverlapSource, Selection, WorkerExplanation
from .selection import choose, probabilities
from .slots import (
    DEFAULT_EXPIRY_SECS,
    DEFAULT_WORK_WINDOW_SECS,
    FRESH_ID_BASE,
    LOAD_WINDOW_SECS,
    WORK_REBASE_WINDOWS,
    SlotManager,
)

__all__ = ["ReferenceRouter", "ReferenceSlotManager"]

log = logging.getLogger(__name__)


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


class ReferenceSlotManager:
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
        clock: seconds, never going backwards; ``time.monotonic`` unless a test injects one.

    Raises:
        ValueError: ``block_size`` < 1 or ``expiry_secs`` not > 0.
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
        self._work_window_secs = work_window_secs
        self._block_size = block_size
        self._track_active_blocks = track_active_blocks
        self._track_prefill_tokens = track_prefill_tokens
        self._assume_kv_reuse = assume_kv_reuse
        self._expiry_secs = expiry_secs
        self._clock = clock
        self._fresh_ids = itertools.count(FRESH_ID_BASE)
        """Stand-in hashes under ``assume_kv_reuse=False``; per manager, so no state is shared."""
        self._requests: dict[str, _Request] = {}
        """Active requests, oldest first (insertion order, with a clock that never goes backwards)."""
        self._loads: dict[WorkerKey, _WorkerLoad] = {}
        """Only workers with at least one active request."""
        self._work: dict[WorkerKey, float] = {}
        """Booked prefill tokens per worker ever booked prefill, each scaled by ``exp((booked at -
        epoch) / window)``; kept when the worker's last request leaves, since the work it did still
        counts. Its decayed value at ``now`` is this times ``exp(-(now - epoch) / window)``: one ``exp`` a
        decision instead of one per worker (``SlotManager`` keeps the same numbers, float for float)."""
        self._epoch = 0.0
        self._seen = 0.0
        self._seen_since = -math.inf
        """The load the decisions see (``SlotManager.seen``'s two words)."""

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
            window = self._work_window_secs
            if (now - self._epoch) / window > WORK_REBASE_WINDOWS:  # before exp((now - epoch) / window) grows huge
                shrink = math.exp(-(now - self._epoch) / window)
                self._work = {w: scaled * shrink for w, scaled in self._work.items()}
                self._seen_since -= now - self._epoch
                self._epoch = now
            self._work[worker] = self._work.get(worker, 0.0) + prefill_tokens * math.exp((now - self._epoch) / window)

    def seen_load(self, queued_share: float) -> float:
        """Fold one decision's queued share into the load the decisions see (``SlotManager.seen_load``)."""
        age = self._clock() - self._epoch
        fade = math.exp(-max(0.0, age - self._seen_since) / LOAD_WINDOW_SECS)
        self._seen = self._seen * fade + queued_share * (1.0 - fade)
        self._seen_since = age
        return self._seen

    def recent_prefill_tokens(self, worker: WorkerKey) -> float:
        """Prefill tokens booked on the worker, each decayed by ``exp(-age / work_window_secs)``."""
        return self._decayed(worker, self._clock())

    def _decayed(self, worker: WorkerKey, now: float) -> float:
        return self._work.get(worker, 0.0) * math.exp(-max(0.0, now - self._epoch) / self._work_window_secs)

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

    def active_prefill_tokens(self, worker: WorkerKey) -> int:
        """Prompt tokens of the worker's requests that have not produced a first token."""
        load = self._loads.get(worker)
        return 0 if load is None else load.prefill_tokens

    def active_blocks(self, worker: WorkerKey) -> int:
        """Distinct sequence hashes over the worker's active requests: a shared prefix counts once."""
        load = self._loads.get(worker)
        return 0 if load is None else len(load.blocks)

    def active_requests(self, worker: WorkerKey) -> int:
        """Requests routed to the worker and neither freed nor swept."""
        load = self._loads.get(worker)
        return 0 if load is None else load.requests

    def drop_worker(self, worker: WorkerKey) -> list[str]:
        """Free every request booked on ``worker`` (``SlotManager.drop_worker``)."""
        dropped = [rid for rid, request in self._requests.items() if request.worker == worker]
        for request_id in dropped:
            self.free(request_id)
        return dropped

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
        return len(load.blocks) + len(sequence_hashes) - self.held_blocks(worker, sequence_hashes)

    def held_blocks(self, worker: WorkerKey, sequence_hashes: Sequence[int]) -> int:
        """Leading blocks of the prompt the worker's active requests hold (0 when blocks are not tracked or
        not shared)."""
        load = self._loads.get(worker)
        if load is None or not self._track_active_blocks or not self._assume_kv_reuse:
            return 0
        overlap = 0
        held = load.blocks
        for seq_hash in sequence_hashes:  # hot path: once per candidate worker per request
            if seq_hash not in held:
                break
            overlap += 1
        return overlap

    def potential_prefill_tokens(self, worker: WorkerKey, isl_tokens: int, overlap_blocks: int) -> int:
        """The worker's queued prefill tokens if this request were added: its tokens beyond the
        ``overlap_blocks`` the worker caches (§5). 0 when prefill tokens are not tracked, as in Dynamo,
        where the request adds nothing and the active figure is 0 too."""
        return self.active_prefill_tokens(worker) + self._new_prefill_tokens(isl_tokens, overlap_blocks)

    def workers(self) -> set[WorkerKey]:
        """Workers with at least one active request."""
        return set(self._loads)

    def _new_prefill_tokens(self, isl_tokens: int, overlap_blocks: int) -> int:
        """Tokens a request still has to prefill on a worker caching ``overlap_blocks`` of it; never
        negative (Dynamo logs and returns 0 when the cached tokens exceed the prompt)."""
        if not self._track_prefill_tokens:
            return 0
        return max(0, isl_tokens - overlap_blocks * self._block_size)


class ReferenceRouter:
    """Chooses a worker per request and tracks the load of the requests it booked.

    Args:
        config: the weights and switches.
        block_size: tokens per KV block of the model served.
        seed: seeds the tie-break / sampling RNG; None draws a fresh seed.
        clock: seconds, monotonic; drives the slot manager's stale sweep, run from ``select`` once a
            minute (requests older than 300 s are dropped).
        slots: a slot manager shared with whoever drives the request lifecycle (the simulator); by
            default the router makes its own from ``config``.
    """

    def __init__(
        self,
        config: RouterConfig | None = None,
        *,
        block_size: int,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        slots: ReferenceSlotManager | SlotManager | None = None,
    ) -> None:
        self.config = config or RouterConfig()
        self.block_size = block_size
        self.rng = random.Random(seed)
        self._clock = clock
        self._next_sweep = clock() + SWEEP_INTERVAL_SECS
        self._untrusted: frozenset[WorkerKey] = frozenset()
        self.slots: ReferenceSlotManager | SlotManager = slots or ReferenceSlotManager(
            block_size=block_size,
            track_active_blocks=self.config.router_track_active_blocks,
            track_prefill_tokens=self.config.router_track_prefill_tokens,
            assume_kv_reuse=self.config.router_assume_kv_reuse,
            clock=clock,
        )

    def select(
        self,
        index: OverlapSource,
        workers: Iterable[WorkerKey],
        *,
        local_hashes: Sequence[int] | None = None,
        tokens: Sequence[int] | None = None,
        isl_tokens: int | None = None,
        lora_name: str | None = None,
        capacities: Mapping[WorkerKey, int] | None = None,
        request_id: str | None = None,
        explain: bool = False,
    ) -> Selection:
        """Choose a worker for one request.

        Args:
            index: where overlaps come from (an ``ApproxIndex`` when ``use_kv_events`` is off).
            workers: the candidates.
            local_hashes: the request's local block hashes; or give ``tokens`` and they are computed.
            tokens: the request's token ids (with ``lora_name``), when ``local_hashes`` is not given.
            isl_tokens: prompt length; defaults to ``len(tokens)``, or full blocks of ``local_hashes``.
            capacities: KV blocks per worker, for ``active_decode_blocks_threshold``.
            request_id: book the request on the chosen worker (select-and-reserve); None only chooses.
            explain: attach every candidate's :class:`WorkerExplanation`.

        Raises:
            NoWorkerAvailable: no candidates, or all over a busy threshold.
            ConfigError: approximate mode with an index that cannot record decisions.
        """
        if local_hashes is None:
            if tokens is None:
                raise InvalidHashInput("select needs local_hashes or tokens")
            local_hashes = block_hashes(tokens, self.block_size, lora_name=lora_name)
            isl = len(tokens) if isl_tokens is None else isl_tokens
        else:
            isl = len(local_hashes) * self.block_size if isl_tokens is None else isl_tokens
        if self._clock() >= self._next_sweep:
            self.slots.sweep()
            self._next_sweep = self._clock() + SWEEP_INTERVAL_SECS
        candidates = list(dict.fromkeys(workers))
        if not candidates:
            raise NoWorkerAvailable("no candidate workers")
        seq_hashes = sequence_hashes(local_hashes)
        by_tier = index.find_matches_by_tier(local_hashes)
        overlaps = {w: self._overlap(by_tier, w, seq_hashes) for w in candidates}
        loads = {w: self._load(w, seq_hashes) for w in candidates}
        busy = {w for w in candidates if self._busy(w, capacities)}
        eligible = [w for w in candidates if w not in busy]
        if not eligible:
            raise NoWorkerAvailable(f"all {len(candidates)} candidate workers are over a busy threshold")
        least_prefill = min(loads[w].active_prefill_tokens for w in eligible)
        mean_recent = sum(loads[w].recent_prefill_tokens for w in eligible) / len(eligible)
        share = 0.0
        if self.config.predicted_credit or self.config.credit_load_gain:
            share = sum(1 for w in eligible if loads[w].active_prefill_tokens > 0) / len(eligible)
        seen = self.slots.seen_load(share) if self.config.predicted_credit else 0.0
        predicted_w = predicted_weight(self.config, seen)
        device_scale = credit_scale(self.config, share)
        costs = {
            w: worker_cost(
                self.config,
                isl_tokens=isl,
                block_size=self.block_size,
                overlap=overlaps[w],
                load=loads[w],
                min_active_prefill_tokens=least_prefill,
                mean_recent_prefill_tokens=mean_recent,
                trusted=w not in self._untrusted,
                predicted_w=predicted_w,
                device_scale=device_scale,
            )
            for w in candidates
        }
        totals = [costs[w].total for w in eligible]
        chosen = eligible[choose(totals, self.config.router_temperature, self.rng)]
        overlap = overlaps[chosen]
        if request_id is not None:
            self.slots.add_request(request_id, chosen, seq_hashes, isl, overlap.device + overlap.predicted)
        if not self.config.use_kv_events:
            if not isinstance(index, ApproxIndex):
                raise ConfigError("use_kv_events=False needs an ApproxIndex to record decisions in")
            index.record_routing(chosen, local_hashes)
        explanation = None
        if explain:
            chance = dict(zip(eligible, probabilities(totals, self.config.router_temperature), strict=True))
            explanation = tuple(
                WorkerExplanation(w, overlaps[w], costs[w], chance.get(w, 0.0), w == chosen, w in busy)
                for w in candidates
            )
        return Selection(chosen, overlap.device, costs[chosen], isl, explanation, predicted_blocks=overlap.predicted)

    def set_untrusted(self, workers: Iterable[WorkerKey]) -> None:
        """The workers whose overlap credit ``untrusted_overlap_weight`` multiplies (``Router.set_untrusted``)."""
        self._untrusted = frozenset(workers)

    def _overlap(
        self, by_tier: Mapping[StorageTier, Mapping[WorkerKey, int]], worker: WorkerKey, seq_hashes: Sequence[int]
    ) -> Overlap:
        """The index's tiers, and the predicted blocks: the active requests' leading run beyond the device's
        (only when the predicted tier is on)."""
        overlap = Overlap.from_tiers(by_tier, worker)
        if not self.config.predicted_credit:
            return overlap
        held = self.slots.held_blocks(worker, seq_hashes)
        return replace(overlap, predicted=max(0, held - overlap.device))

    def _load(self, worker: WorkerKey, seq_hashes: Sequence[int]) -> Load:
        return Load(
            active_prefill_tokens=self.slots.active_prefill_tokens(worker),
            potential_decode_blocks=self.slots.potential_decode_blocks(worker, seq_hashes),
            active_requests=self.slots.active_requests(worker),
            recent_prefill_tokens=self.slots.recent_prefill_tokens(worker) if self.config.prefill_work_weight else 0.0,
        )

    def _busy(self, worker: WorkerKey, capacities: Mapping[WorkerKey, int] | None) -> bool:
        decode_limit = self.config.active_decode_blocks_threshold
        capacity = capacities.get(worker) if capacities else None
        if decode_limit is not None and capacity and self.slots.active_blocks(worker) > decode_limit * capacity:
            return True
        prefill_limit = self.config.active_prefill_tokens_threshold
        return prefill_limit is not None and self.slots.active_prefill_tokens(worker) > prefill_limit
