"""``Router``: one routing decision from an index, the slot manager's load, the cost and the selector.

Per request: hash the prompt (or take its local hashes), ask the index for each candidate's overlap
per tier, drop the candidates over a busy threshold, cost the rest (``cost.py``), pick one
(``selection.py``) and, when the caller books the request, add it to the slot manager so the next
decision sees the load. With ``explain=True`` the selection carries every candidate's terms, which is
what Dynamo's selection service does not return and operators ask for (``spec/interfaces.md`` §2).

A decision sits on every request's critical path, so it runs on arrays: each worker has a dense slot
(the slot manager's ``numbering``); the index answers overlaps as a ``(tiers, slots)`` array (``overlaps``
on the shared-memory engine and its reader; ``overlaps_from_tiers`` over the dict answer of
``RadixIndex`` / ``ApproxIndex``); the slot manager's counters are slot-indexed arrays and its
active-block overlap for every worker comes from one pass over the prompt; the cost terms, busy
filter and choice are one compiled call (``_kernels.py``). Python objects are built for the chosen
worker, and for every candidate only under ``explain=True``. The prompt stays a ``uint64`` array from
hashing to the index. The first implementation, one dict and dataclass per candidate, is kept as the
oracle (``reference.py``): the same choices, the same random draws, the same explanations.

The router owns no index: the event-driven index is shared with the event plane, and in approximate
mode (``use_kv_events=False``) the caller passes an :class:`~kvrouter.index.ApproxIndex`, into which
every decision is written, as the reference writes synthetic stores (``spec/dynamo-semantics.md`` §3.2).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, InvalidHashInput, NoWorkerAvailable
from ..events.model import StorageTier, WorkerKey
from ..hashing import block_hashes_array, local_hash_array
from ..index import ApproxIndex
from ..index.dense import WorkerSlots, overlaps_from_tiers
from ..index.reader import DecisionWalk, IndexReader
from . import _kernels as kernels, _twister
from .config import RouterConfig
from .cost import Cost, Overlap
from .selection import probabilities
from .slots import SlotManager

__all__ = ["ArrayOverlapSource", "DecisionRecord", "OverlapSource", "Router", "Selection", "WorkerExplanation"]

SWEEP_INTERVAL_SECS: Final = 60.0
"""How often stale requests are swept out of the slot manager: Dynamo's one-minute sweep (§5)."""


NTIERS: Final = len(StorageTier)


class OverlapSource(Protocol):
    """What the router needs of an index: overlap per tier for one query."""

    def find_matches_by_tier(self, local_hashes: Sequence[int]) -> dict[StorageTier, dict[WorkerKey, int]]: ...


@runtime_checkable
class ArrayOverlapSource(Protocol):
    """An index that answers overlaps straight into slot-indexed arrays (the engine and its reader)."""

    def overlaps(self, local: npt.NDArray[np.uint64], slots: WorkerSlots, ntiers: int) -> npt.NDArray[np.int64]: ...


@dataclass(frozen=True, slots=True)
class WorkerExplanation:
    """One candidate's part in a decision."""

    worker: WorkerKey
    overlap: Overlap
    cost: Cost
    probability: float
    """Its chance of being picked (0 when busy)."""
    selected: bool
    busy: bool
    """Over a busy threshold, so not a candidate."""


@dataclass(slots=True)
class DecisionRecord:
    """A decision's every term as arrays, kept to be explained later (``select(record=True)``): the copies
    cost a few microseconds, where building the explanation's objects costs tens. Not frozen, as ``Cost``
    (a frozen ``__init__`` costs a microsecond more); treat it as read only.

    ``terms`` is the kernel's ``(COLUMNS, candidates)`` output, ``overlaps`` the candidates' ``(tiers,
    candidates)`` overlaps, ``head`` the chosen position."""

    keys: Sequence[WorkerKey]
    terms: npt.NDArray[np.float64]
    overlaps: npt.NDArray[np.int64]
    head: int
    temperature: float

    @property
    def nbytes(self) -> int:
        return int(self.terms.nbytes + self.overlaps.nbytes) + 64 * len(self.keys)

    def explain(self) -> tuple[WorkerExplanation, ...]:
        """Every candidate's explanation, as ``select(explain=True)`` would have given it then."""
        return explanation(self.keys, self.overlaps, self.terms, self.head, self.temperature)


class Selection:
    """The chosen worker, its device overlap, its predicted blocks beyond that (booked as cached: their
    prefill is another request's) and cost, and (when asked) every candidate's explanation or a record to
    explain later. Read only.

    ``cost`` is the chosen worker's :class:`Cost`, or the decision kernel's column of its terms
    (``_kernels.C_*`` order), made a ``Cost`` when first read: building it took a microsecond, a tenth of
    a decision at 16 workers, and a caller that only routes (the simulator, the proxy) never reads it."""

    __slots__ = (
        "_cost",
        "_terms",
        "explanation",
        "isl_tokens",
        "overlap_blocks",
        "predicted_blocks",
        "record",
        "worker",
    )

    def __init__(
        self,
        worker: WorkerKey,
        overlap_blocks: int,
        cost: Cost | Sequence[float],
        isl_tokens: int,
        explanation: tuple[WorkerExplanation, ...] | None = None,
        record: DecisionRecord | None = None,
        predicted_blocks: int = 0,
    ) -> None:
        self.worker = worker
        self.overlap_blocks = overlap_blocks
        self.predicted_blocks = predicted_blocks
        self._cost: Cost | None = cost if isinstance(cost, Cost) else None
        self._terms: Sequence[float] | None = None if isinstance(cost, Cost) else cost
        self.isl_tokens = isl_tokens
        self.explanation = explanation
        self.record = record

    @property
    def cost(self) -> Cost:
        if self._cost is None:
            assert self._terms is not None
            self._cost = _cost(self._terms)
        return self._cost

    def __repr__(self) -> str:
        return f"Selection(worker={self.worker!r}, overlap_blocks={self.overlap_blocks}, cost={self.cost!r})"


class Router:
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
        slots: SlotManager | None = None,
    ) -> None:
        self.config = config or RouterConfig()
        self.block_size = block_size
        self._twister = _twister.state(random.Random(seed))
        """The tie-break / sampling generator's state, drawn from by the decision kernel (``_twister.py``)."""
        self._clock = clock
        self._next_sweep = clock() + SWEEP_INTERVAL_SECS
        self.slots = slots or SlotManager(
            block_size=block_size,
            track_active_blocks=self.config.router_track_active_blocks,
            track_prefill_tokens=self.config.router_track_prefill_tokens,
            assume_kv_reuse=self.config.router_assume_kv_reuse,
            clock=clock,
        )
        self._now = self.slots.clock
        """The slot manager's clock, read once here: its property's frame cost a microsecond a decision once
        evicted."""
        self._params = _params(self.config, block_size, self.slots)
        self._approximate = not self.config.use_kv_events
        """Decisions are written into the index (``use_kv_events=False``); the config is read once, as
        ``_params`` reads it."""
        self._last_workers: tuple[WorkerKey, ...] | None = None
        """The last candidate tuple seen, kept with its deduplicated keys and slots: a caller passing the
        same tuple each time (the fleet) pays for the keys -> slots conversion once."""
        self._last_keys: list[WorkerKey] = []
        self._candidates = np.empty(0, dtype=np.int64)
        self._no_capacity = np.empty(0, dtype=np.float64)
        self._seqs = np.empty(64, dtype=np.uint64)
        """The last prompt's sequence hashes, written by the decision kernel (grown to the longest prompt)."""
        self._overlaps = np.zeros((NTIERS, 0), dtype=np.int64)
        self._written = np.empty(0, dtype=np.int64)
        """The index's answer, written by the decision kernel, and the slots whose columns it wrote, zeroed by
        the next decision (both sized to the numbering)."""
        self._out = np.empty((kernels.COLUMNS, 0), dtype=np.float64)
        self._ties = np.empty(0, dtype=np.int64)
        """The kernel's outputs, sized to the candidates."""
        self._columns = self._out.T
        """``_out`` by candidate, so a candidate's terms are a row (its ``tolist`` is quicker than a column's)."""
        self._bound = np.zeros(kernels.BOUND_WORDS, dtype=np.int64)
        """The decision kernel's view of the arrays above and the slot manager's, by address (``B_*``)."""
        self._stamp = (-1, -1)
        """The numbering's version and the slot manager's generation ``_bound`` was made at."""
        self._decide: kernels.Decider = kernels.decide
        self._decide_on_shards: kernels.OnShards = kernels.decide_on_shards
        """The kernels, made their compiled entry points by the first decision's ``_rebind`` (``entry_points``:
        a microsecond less a call; the arrays passed are made to their types here)."""
        self._walked: object = None
        self._walk: DecisionWalk | None = None
        """The last index seen and its ``decision_walk()`` (None: it has none, it answers dicts or arrays)."""
        self._untrusted: frozenset[WorkerKey] = frozenset()
        self._trust = np.ones(0, dtype=np.float64)
        """Per slot, the overlap credit's factor: ``untrusted_overlap_weight`` for the untrusted, else 1; left
        empty (and the kernel reads no factor) while no worker is untrusted or the weight is 1."""

    @property
    def rng(self) -> random.Random:
        """A copy of the generator the decisions draw from, as it is now: the oracle's ``random.Random``
        given the same seed and the same decisions is in this state."""
        return _twister.generator(self._twister)

    @property
    def untrusted(self) -> frozenset[WorkerKey]:
        return self._untrusted

    def set_untrusted(self, workers: Iterable[WorkerKey]) -> None:
        """The workers whose overlap credit ``untrusted_overlap_weight`` multiplies from now on (the service
        marks those whose trust state is not ``exact``); every other worker's credit is whole."""
        untrusted = frozenset(workers)
        if untrusted != self._untrusted:
            self._untrusted = untrusted
            self._fill_trust()

    def _fill_trust(self) -> None:
        weight = self.config.untrusted_overlap_weight
        if not self._untrusted or weight == 1.0:
            self._trust = np.ones(0, dtype=np.float64)
        else:
            numbering = self.slots.numbering
            slots = numbering.slots(list(self._untrusted))
            self._trust = np.ones(len(numbering), dtype=np.float64)
            self._trust[slots] = weight
        self._bind(kernels.B_TRUST, self._trust)

    def select(
        self,
        index: OverlapSource,
        workers: Iterable[WorkerKey],
        *,
        local_hashes: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
        tokens: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
        isl_tokens: int | None = None,
        lora_name: str | None = None,
        capacities: Mapping[WorkerKey, int] | None = None,
        request_id: str | None = None,
        explain: bool = False,
        record: bool = False,
    ) -> Selection:
        """Choose a worker for one request.

        Args:
            index: where overlaps come from (an ``ApproxIndex`` when ``use_kv_events`` is off).
            workers: the candidates; pass the same tuple each time to have its slots looked up once.
            local_hashes: the request's local block hashes (a list or a ``uint64`` array); or give
                ``tokens`` and they are computed.
            tokens: the request's token ids (with ``lora_name``), when ``local_hashes`` is not given: a
                list, an ``array('I')`` or an integer array, hashed once into an array.
            isl_tokens: prompt length; defaults to ``len(tokens)``, or full blocks of ``local_hashes``.
            capacities: KV blocks per worker, for ``active_decode_blocks_threshold``.
            request_id: book the request on the chosen worker (select-and-reserve); None only chooses.
            explain: attach every candidate's :class:`WorkerExplanation`.
            record: attach a :class:`DecisionRecord` (every candidate's terms as arrays), to be explained
                later if asked.

        Raises:
            NoWorkerAvailable: no candidates, or all over a busy threshold.
            ConfigError: approximate mode with an index that cannot record decisions.
        """
        if local_hashes is None:
            if tokens is None:
                raise InvalidHashInput("select needs local_hashes or tokens")
            local = block_hashes_array(tokens, self.block_size, lora_name=lora_name)
            isl = len(tokens) if isl_tokens is None else isl_tokens
        else:
            local = (  # hot path: a uint64 array as it is, without local_hash_array's frame (µs once evicted)
                local_hashes  # type: ignore[assignment]  # its dtype is checked here, where mypy cannot see it
                if type(local_hashes) is np.ndarray
                and local_hashes.dtype is _U64
                and local_hashes.ndim == 1
                and local_hashes.flags.c_contiguous
                else local_hash_array(local_hashes)
            )
            isl = len(local) * self.block_size if isl_tokens is None else isl_tokens
        slots = self.slots
        now = self._now()
        if now >= self._next_sweep:
            slots.sweep()
            self._next_sweep = now + SWEEP_INTERVAL_SECS
        if workers is not self._last_workers:
            self._take(workers)
        keys = self._last_keys
        if not keys:
            raise NoWorkerAvailable("no candidate workers")
        n = len(local)
        if len(self._seqs) < n:
            self._seqs = np.empty(max(n, 2 * len(self._seqs)), dtype=np.uint64)
            self._bind(kernels.B_SEQS, self._seqs)
        numbering = slots.numbering
        if numbering.version != self._stamp[0] or slots.generation != self._stamp[1]:
            self._rebind()
        capacity = None
        if capacities and self.config.active_decode_blocks_threshold is not None:
            capacity = np.fromiter((capacities.get(w) or 0 for w in keys), dtype=np.float64, count=len(keys))
            self._bind(kernels.B_CAPACITIES, capacity)  # for this call only
        age = now - slots.work_epoch
        terms = explain or record  # the kernel writes every candidate's terms, not only the winner's
        if index is not self._walked:  # the engine or its reader: the walk inside the decision, looked up once
            walk = getattr(index, "decision_walk", None)
            self._walk = None if walk is None else walk()
            self._walked = index
            if self._walk is not None:
                self._bind(kernels.B_CTX, self._walk.ctx)  # kept alive by _walk
        walk = self._walk
        try:
            if walk is not None and n:
                overlaps = self._overlaps
                decide = self._decide_on_shards
                failed = kernels.REFUSED
                lock = walk.lock
                lock.acquire()  # hot path: the walk and the decision in one call, no frame of the reader's, no `with`
                try:
                    if not walk.given_up:
                        failed, head, device, column = decide(local, self._bound, isl, age, terms)
                finally:
                    lock.release()
                again = False
                if failed:  # another numbering's maps, a closed reader or a late shard: the reader's own path
                    (_, head, device, column), again = walk.overlaps_and(
                        self._on_walk, local, numbering, NTIERS, overlaps, (isl, age, terms)
                    )  # again: a shard answered late, so decide on the whole, mended answer
            else:
                overlaps = self._overlaps_of(index, local, numbering)
                again = True
            if again:
                head, device, column = self._decide(local, overlaps, self._bound, isl, age, terms)
        finally:
            if capacity is not None:
                self._bind(kernels.B_CAPACITIES, self._no_capacity)
        out = self._out
        if head < 0:  # at temperature 0 the kernel drew the reservoir pass's numbers and chose
            if head == kernels.NO_WORKER:
                raise NoWorkerAvailable(f"all {len(keys)} candidate workers are over a busy threshold")
            u = _twister.uniform(self._twister)
            head = kernels.sample(out, self.config.router_temperature, u, self._ties, np.empty(len(keys)))
            device = overlaps.item(0, self._candidates.item(head))
            column = tuple(self._columns[head].tolist())
        chosen = keys[head]
        predicted = int(column[kernels.C_PREDICTED])
        if request_id is not None:  # a predicted block is as good as cached: its prefill is another's
            slots.add_request(request_id, chosen, self._seqs[:n], isl, device + predicted)
        if self._approximate:
            if not isinstance(index, ApproxIndex):
                raise ConfigError("use_kv_events=False needs an ApproxIndex to record decisions in")
            index.record_routing(chosen, local.tolist())
        kept = explained = None
        if terms:
            temperature = self.config.router_temperature
            held = overlaps[:, self._candidates]
            kept = DecisionRecord(keys, out.copy(), held, head, temperature) if record else None
            explained = explanation(keys, held, out, head, temperature) if explain else None
        selection = _new(Selection)  # its fields set here: an __init__ frame cost a microsecond once evicted
        selection.worker = chosen
        selection.overlap_blocks = device
        selection.predicted_blocks = predicted
        selection._cost = None
        selection._terms = column
        selection.isl_tokens = isl
        selection.explanation = explained
        selection.record = kept
        return selection

    def _on_walk(
        self,
        ctx: npt.NDArray[np.int64],
        local: npt.NDArray[np.uint64],
        ntiers: int,
        out: npt.NDArray[np.int64],
        isl: float,
        age: float,
        terms: bool,
    ) -> tuple[int, int, int, kernels.Column]:
        """The decision as ``IndexReader.overlaps_and`` calls its kernel: ``ctx`` (the walk's reader's) and ``out``
        (``_overlaps``) are bound already (``B_CTX``, ``B_OVERLAPS``)."""
        return self._decide_on_shards(local, self._bound, isl, age, terms)

    def _take(self, workers: Iterable[WorkerKey]) -> None:
        """Make ``workers`` the candidates: deduplicated in order, slotted (assigned on first sight), bound.
        A tuple is remembered, so passing the same one again skips all of this."""
        keys = list(dict.fromkeys(workers))
        self._last_workers = workers if isinstance(workers, tuple) else None
        self._last_keys = keys
        self._candidates = self.slots.numbering.slots(keys)
        self._bind(kernels.B_CANDIDATES, self._candidates)
        if len(self._ties) != len(keys):
            self._out = np.empty((kernels.COLUMNS, len(keys)), dtype=np.float64)
            self._columns = self._out.T
            self._ties = np.empty(len(keys), dtype=np.int64)
            self._bind(kernels.B_OUT, self._out)
            self._bind(kernels.B_TIES, self._ties)

    def _rebind(self) -> None:
        """After the numbering grew or the slot manager replaced an array: size the per-slot arrays for every
        slot, and bind everything anew."""
        slots = self.slots
        slots.ready()
        self._decide, self._decide_on_shards = kernels.entry_points()
        if self._overlaps.shape[1] != len(slots.numbering):
            self._overlaps = np.zeros((NTIERS, len(slots.numbering)), dtype=np.int64)
            self._written = np.empty(len(slots.numbering), dtype=np.int64)
        self._fill_trust()  # sized to the numbering too
        for entry, array in (
            (kernels.B_SEQS, self._seqs),
            (kernels.B_CANDIDATES, self._candidates),
            (kernels.B_LOADS, slots.loads),
            (kernels.B_WORK, slots.work),
            (kernels.B_HOLDERS, slots.holders),
            (kernels.B_SCRATCH, slots.scratch),
            (kernels.B_CAPACITIES, self._no_capacity),
            (kernels.B_PARAMS, self._params),
            (kernels.B_OUT, self._out),
            (kernels.B_TIES, self._ties),
            (kernels.B_TRUST, self._trust),
            (kernels.B_WRITTEN, self._written),
            (kernels.B_TWISTER, self._twister),
            (kernels.B_OVERLAPS, self._overlaps),
            (kernels.B_SEEN, slots.seen),
        ):
            self._bind(entry, array)
        self._bound[kernels.WRITTEN_COUNT] = -1  # not known: the next decision zeroes all of the overlaps
        self._bound[kernels.B_VERSION] = slots.numbering.version
        self._stamp = (slots.numbering.version, slots.generation)

    def _bind(self, entry: int, array: npt.NDArray[Any]) -> None:
        """Point ``_bound``'s entry at ``array`` (C-contiguous, the dtype the kernel reads it as)."""
        bound = self._bound
        bound[entry] = array.ctypes.data
        bound[entry + 1] = array.shape[0]
        bound[entry + 2] = array.shape[1] if array.ndim == 2 else 0

    def _overlaps_of(
        self, index: OverlapSource, local: npt.NDArray[np.uint64], numbering: WorkerSlots
    ) -> npt.NDArray[np.int64]:
        """``(tiers, slots)`` overlaps: straight from an array index, else from its dict answer."""
        overlaps = getattr(index, "overlaps", None)  # an ArrayOverlapSource (a Protocol isinstance costs µs)
        if overlaps is not None:  # C-contiguous int64: the kernel's entry point reads any layout as contiguous
            return np.ascontiguousarray(overlaps(local, numbering, NTIERS), dtype=np.int64)
        # The engine and its reader take the array as it is; the Python indexes walk ints.
        query: Any = local if isinstance(index, IndexReader) or _is_engine(index) else local.tolist()
        return overlaps_from_tiers(index.find_matches_by_tier(query), numbering, NTIERS)


def explanation(
    keys: Sequence[WorkerKey],
    overlaps: npt.NDArray[np.int64],
    out: npt.NDArray[np.float64],
    head: int,
    temperature: float,
) -> tuple[WorkerExplanation, ...]:
    """Every candidate's explanation from the kernel's output ``out`` and the candidates' ``(tiers,
    candidates)`` ``overlaps``; ``head`` the chosen position."""
    busy = out[kernels.C_BUSY] != 0.0
    eligible = np.flatnonzero(~busy).tolist()
    totals = out[kernels.C_TOTAL, eligible].tolist()
    chance = [0.0] * len(keys)
    for position, p in zip(eligible, probabilities(totals, temperature), strict=True):
        chance[position] = p
    columns = out.T.tolist()
    return tuple(
        WorkerExplanation(
            keys[i], _overlap(overlaps, i, columns[i]), _cost(columns[i]), chance[i], i == head, bool(busy[i])
        )
        for i in range(len(keys))
    )


_U64: Final = np.dtype(np.uint64)
_new: Final = object.__new__


def _is_engine(index: object) -> bool:
    """Whether ``index`` is the shared-memory ``Engine`` (imported late: the engine pulls in the plane)."""
    from ..engine import Engine

    return isinstance(index, Engine)


def _params(config: RouterConfig, block_size: int, slots: SlotManager) -> npt.NDArray[np.float64]:
    """The kernel's scalar vector for ``config``; the per-request entries are filled in by ``select``."""
    params = np.zeros(kernels.NPARAMS, dtype=np.float64)
    params[kernels.P_TRACK_BLOCKS] = slots.track_active_blocks  # the slot manager's, as the oracle asks it
    params[kernels.P_WORK_WINDOW] = slots.work_window_secs
    params[kernels.P_BLOCK] = block_size
    params[kernels.P_CREDIT] = config.overlap_score_credit
    params[kernels.P_DECAY] = config.overlap_score_credit_decay
    params[kernels.P_HOST] = config.host_cache_hit_weight
    params[kernels.P_DISK] = config.disk_cache_hit_weight
    params[kernels.P_SHARED] = config.shared_credit
    params[kernels.P_SCALE] = config.prefill_load_scale
    params[kernels.P_REQUEST_WEIGHT] = config.decode_active_request_weight
    params[kernels.P_LMETRIC] = config.router_selection_policy == "lmetric"
    params[kernels.P_TRACK_PREFILL] = config.router_track_prefill_tokens
    decode_limit = config.active_decode_blocks_threshold
    prefill_limit = config.active_prefill_tokens_threshold
    params[kernels.P_DECODE_LIMIT] = math.nan if decode_limit is None else decode_limit
    params[kernels.P_PREFILL_LIMIT] = math.nan if prefill_limit is None else prefill_limit
    params[kernels.P_TEMPERATURE] = config.router_temperature
    params[kernels.P_WORK_WEIGHT] = config.prefill_work_weight
    params[kernels.P_PREDICTED] = config.predicted_credit
    params[kernels.P_CREDIT_GAIN] = config.credit_load_gain
    return params


def _overlap(overlaps: npt.NDArray[np.int64], slot: int, terms: Sequence[float]) -> Overlap:
    device, host, disk, shared = overlaps[:, slot].tolist()
    return Overlap(device, host, disk, shared, int(terms[kernels.C_PREDICTED]))


def _cost(terms: Sequence[float]) -> Cost:
    raw, credit, adjusted, prefill_cost, decode, request_cost, total, _, work_factor, _, _, predicted_credit = terms
    return Cost(raw, credit, adjusted, prefill_cost, int(decode), request_cost, total, work_factor, predicted_credit)
