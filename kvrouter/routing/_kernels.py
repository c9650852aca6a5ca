"""The decision's compiled core: every candidate's cost terms, the busy filter and the selection, in one call.

With the overlaps and the loads already in slot-indexed arrays, what is left of a decision is a few
arithmetic terms per candidate and an argmin or a softmax draw. As numpy expressions that is twenty-odd
array operations of about a microsecond each, whatever the number of workers; compiled, it is one call
of a few hundred nanoseconds plus a few nanoseconds per candidate. The rules of ``index/_kernels.py``
hold here: arrays in, scalars or preallocated arrays out, no Python objects, no allocation in a loop.

The arithmetic is the oracle's (``cost.worker_cost``, ``selection.choose`` / ``probabilities``), operation
for operation and in the same order, so the totals are bit-identical and ties fall the same way: numba
neither reassociates nor fuses floating-point operations unless ``fastmath`` asks it to, and the sums
are sequential as Python 3.11's ``sum`` of floats is. The draws are the oracle's ``random.Random``'s,
made on its state in an array (``_twister.py``): at temperature 0 the decision makes the reservoir
pass's draws itself (``cost_and_choose`` says which would matter); above 0 the caller draws the uniform
once it knows someone is eligible and passes it to :func:`sample`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from numba import types
from numba.np.numpy_support import carray

from .._jit import inlined, kernel
from ..hashing._xxh3 import chain_hashes
from ..hashing.blocks import XXH3_SEED
from ..index._kernels import CTX_MAPPED, _counts_at, _floats_at, _overlap_shards, _words_at  # the reader's own
from . import _active, _twister
from .cost import PREDICTED_IDLE_SHARE
from .slots import AVERAGE, LOAD_WINDOW_SECS, SINCE

__all__ = [
    "BOUND_WORDS",
    "COLUMNS",
    "NPARAMS",
    "cost_and_choose",
    "decide",
    "decide_on_shards",
    "entry_points",
    "sample",
]

# params: one float64 vector, so the call unboxes one array instead of a dozen scalars
P_ISL: Final = 0
P_BLOCK: Final = 1
P_NBLOCKS: Final = 2
P_CREDIT: Final = 3
P_DECAY: Final = 4
P_HOST: Final = 5
P_DISK: Final = 6
P_SHARED: Final = 7
P_SCALE: Final = 8
P_REQUEST_WEIGHT: Final = 9
P_LMETRIC: Final = 10
P_TRACK_PREFILL: Final = 11
P_TRACK_BLOCKS: Final = 12
P_DECODE_LIMIT: Final = 13
"""NaN when off."""
P_PREFILL_LIMIT: Final = 14
"""NaN when off."""
P_TEMPERATURE: Final = 15
P_WORK_WEIGHT: Final = 16
"""``prefill_work_weight``; 0 leaves every total as it is."""
P_WORK_AGE: Final = 17
P_WORK_WINDOW: Final = 18
"""The slot manager's clock minus its work epoch, and its decay time constant: every slot's booked
prefill decays by one factor, ``exp(-age / window)``."""
P_PREDICTED: Final = 19
"""``predicted_credit``; 0 leaves the predicted tier out."""
P_CREDIT_GAIN: Final = 20
"""``credit_load_gain``; 0 leaves the device credit as configured."""
NPARAMS: Final = 21

# rows of `out`, one per term (the names are historical: `C_` for a candidate's column of terms)
C_RAW: Final = 0
C_CREDIT: Final = 1
C_ADJUSTED: Final = 2
C_PREFILL_COST: Final = 3
C_DECODE_BLOCKS: Final = 4
C_REQUEST_COST: Final = 5
C_TOTAL: Final = 6
C_BUSY: Final = 7
C_WORK_FACTOR: Final = 8
C_DECAY: Final = 9
"""Scratch: each candidate's overlap credit decay (``overlap_score_credit_decay``), written before the
costing pass when the decay is on. Apart from it because the decay's divisions inside the costing loop
keep LLVM from vectorising it, even under a condition that holds for the whole loop."""
C_PREDICTED: Final = 10
"""Predicted blocks: leading prompt blocks the candidate's active requests hold beyond its device overlap."""
C_PREDICTED_CREDIT: Final = 11
"""The part of ``C_CREDIT`` the predicted tier gives."""
COLUMNS: Final = 12

Column = tuple[float, float, float, float, float, float, float, float, float, float, float, float]
"""One candidate's ``COLUMNS`` terms, in ``C_*`` order."""

_SEED: Final = np.uint64(XXH3_SEED)

NO_WORKER: Final = -1
"""``head`` when every candidate is busy."""
REFUSED: Final = -1
""":func:`decide_on_shards`' failed shards when it walked nothing: the reader's bit -> slot maps follow
another numbering than the router's, or none (the reader closed)."""
SAMPLE: Final = -2
"""``head`` above temperature 0 when some candidate is eligible: draw, then call :func:`sample`."""

# The router's arrays by address (``bound``, an ``int64`` array of three words per array: address, rows,
# columns or 0 for a vector), as the reader's context names the index's (``index/_kernels.py``). Numba's
# dispatcher types and unboxes every array argument, 1.4 µs a call for the dozen a decision reads; one
# context array costs a tenth of that. The router rebinds an entry whenever it, or its slot manager,
# replaces that array, before the next call (``router.py``), so no address outlives its array.
B_SEQS, B_CANDIDATES, B_LOADS, B_WORK, B_HOLDERS, B_SCRATCH, B_CAPACITIES, B_PARAMS, B_OUT, B_TIES = range(0, 30, 3)
B_TRUST: Final = 30
B_WRITTEN: Final = 33
B_TWISTER: Final = 36
"""The router's random state (``_twister.STATE_WORDS`` words)."""
B_VERSION: Final = 39
"""One word: the version of the router's numbering (``WorkerSlots.version``), the slots ``overlaps`` is by."""
B_CTX: Final = 40
"""The context of the reader the router walks (``IndexReader.decision_walk``), for :func:`decide_on_shards`."""
B_OVERLAPS: Final = 43
"""The router's ``(tiers, slots)`` overlaps, which :func:`decide_on_shards` walks into."""
B_SEEN: Final = 46
"""The slot manager's ``seen`` (``slots.AVERAGE``, ``SINCE``): the load the decisions see, which each decision
with the predicted tier on folds its queued share into."""
BOUND_WORDS: Final = 49
WRITTEN_COUNT: Final = B_WRITTEN + 2
"""``B_WRITTEN`` names a vector, so its third word holds instead how many of its entries the last
:func:`decide_on_shards` noted: the slots whose columns of ``overlaps`` it wrote, which the next call
zeroes again before its walk; -1 when not known (all of ``overlaps`` is zeroed then). At 1,024 workers
zeroing the whole ``(4, slots)`` array was 32 KB of stores per decision, for the 16 columns a walk
writes."""


@inlined
def _decide(
    local: npt.NDArray[np.uint64],
    isl: float,
    age: float,
    seqs: npt.NDArray[np.uint64],
    candidates: npt.NDArray[np.int64],
    overlaps: npt.NDArray[np.int64],
    loads: npt.NDArray[np.int64],
    work: npt.NDArray[np.float64],
    holders: npt.NDArray[np.uint64],
    scratch: npt.NDArray[np.int64],
    capacities: npt.NDArray[np.float64],
    params: npt.NDArray[np.float64],
    out: npt.NDArray[np.float64],
    ties: npt.NDArray[np.int64],
    trust: npt.NDArray[np.float64],
    seen: npt.NDArray[np.float64],
    explain: bool,
) -> tuple[int, int, int]:
    """A whole decision after the index walk, in one call: the prompt's sequence hashes into ``seqs[:n]``
    (for the booking), every slot's leading blocks held by its active requests (``_active.leading``, when
    blocks are tracked), then :func:`cost_and_choose`. ``loads`` and ``work`` are the slot manager's
    (prefill, requests, blocks per slot; booked work, scaled to its epoch), ``scratch`` its walk buffers,
    whose first row is all 0 before and after the call. ``isl`` and ``age`` (the slot manager's clock
    minus its work epoch) go into ``params``: as arguments, since a scalar costs the call less than a
    store into an array from Python."""
    n = local.size
    params[P_ISL] = isl
    params[P_NBLOCKS] = n
    params[P_WORK_AGE] = age
    chain_hashes(local, _SEED, seqs[:n])
    leading = scratch[0]
    touched = 0
    if params[P_TRACK_BLOCKS] != 0.0:
        touched = _active.leading(holders, seqs[:n], leading, scratch[1], scratch[2])
    result = cost_and_choose(
        candidates,
        overlaps,
        loads[0],
        loads[1],
        loads[2],
        leading,
        capacities,
        work,
        params,
        out,
        ties,
        trust,
        seen,
        explain,
    )
    for j in range(touched):
        leading[scratch[1, j]] = 0
    return result


@inlined
def _vector(bound: npt.NDArray[np.int64], at: int) -> npt.NDArray[np.int64]:
    return carray(_counts_at(bound[at]), (bound[at + 1],))


@inlined
def _matrix(bound: npt.NDArray[np.int64], at: int) -> npt.NDArray[np.int64]:
    return carray(_counts_at(bound[at]), (bound[at + 1], bound[at + 2]))


@inlined
def _column(out: npt.NDArray[np.float64], i: int) -> Column:
    """Candidate ``i``'s column of ``out``."""
    return (
        out[0, i],
        out[1, i],
        out[2, i],
        out[3, i],
        out[4, i],
        out[5, i],
        out[6, i],
        out[7, i],
        out[8, i],
        out[9, i],
        out[10, i],
        out[11, i],
    )


NO_COLUMN: Final = (0.0,) * COLUMNS
"""The terms returned with no candidate chosen (``head`` < 0, failed shards): not read."""


@kernel
def decide(
    local: npt.NDArray[np.uint64],
    overlaps: npt.NDArray[np.int64],
    bound: npt.NDArray[np.int64],
    isl: float,
    age: float,
    explain: bool,
) -> tuple[int, int, Column]:
    """:func:`_decide` on the router's arrays named by ``bound`` (``B_*``), then at temperature 0 the oracle's
    reservoir pass over the ties, drawing from the router's state. Returns ``(head, device, terms)``: the
    chosen position (or ``NO_WORKER`` / ``SAMPLE``, as :func:`cost_and_choose`) and, for a position, the
    device overlap of its candidate and its column of ``out`` (read from Python, a numpy scalar costs more
    than the rest of the return, and the column's ``tolist`` twice its boxing here)."""
    seqs = carray(_words_at(bound[B_SEQS]), (bound[B_SEQS + 1],))
    candidates = _vector(bound, B_CANDIDATES)
    loads = _matrix(bound, B_LOADS)
    work = carray(_floats_at(bound[B_WORK]), (bound[B_WORK + 1],))
    holders = carray(_words_at(bound[B_HOLDERS]), (bound[B_HOLDERS + 1], bound[B_HOLDERS + 2]))
    scratch = _matrix(bound, B_SCRATCH)
    capacities = carray(_floats_at(bound[B_CAPACITIES]), (bound[B_CAPACITIES + 1],))
    params = carray(_floats_at(bound[B_PARAMS]), (bound[B_PARAMS + 1],))
    out = carray(_floats_at(bound[B_OUT]), (bound[B_OUT + 1], bound[B_OUT + 2]))
    ties = _vector(bound, B_TIES)
    trust = carray(_floats_at(bound[B_TRUST]), (bound[B_TRUST + 1],))
    seen = carray(_floats_at(bound[B_SEEN]), (bound[B_SEEN + 1],))
    head, skip, count = _decide(
        local,
        isl,
        age,
        seqs,
        candidates,
        overlaps,
        loads,
        work,
        holders,
        scratch,
        capacities,
        params,
        out,
        ties,
        trust,
        seen,
        explain,
    )
    if head < 0:
        return head, 0, NO_COLUMN
    twister = carray(_words_at(bound[B_TWISTER]), (_twister.STATE_WORDS,))
    _twister.advance(twister, 2 * skip)  # draws that cannot matter: two words each, as getrandbits(64) takes
    for j in range(count):
        if _twister.uniform(twister) * (j + 2) < 1.0:
            head = ties[j]
    return head, overlaps[0, candidates[head]], _column(out, head)


@kernel
def decide_on_shards(
    local: npt.NDArray[np.uint64],
    bound: npt.NDArray[np.int64],
    isl: float,
    age: float,
    explain: bool,
) -> tuple[int, int, int, Column]:
    """The shared-memory index's walk over every shard (``index/_kernels.overlap_shards``, on the reader's
    context ``B_CTX``) into the router's ``B_OVERLAPS``, then :func:`decide`: a whole decision in one call
    (the router's, under the reader's lock, or through ``IndexReader.overlaps_and``). The overlaps keep the
    last decision's answer until the next call zeroes the columns it wrote (``WRITTEN_COUNT``). Returns
    ``(failed shards, head, device, terms)``; with failed shards nothing is decided: the caller decides
    once the reader mended the answer (with walks that note nothing, so the next call zeroes all of the
    overlaps). ``REFUSED`` failed shards when the reader's maps are not by the router's numbering
    (``B_VERSION``): nothing was walked, the caller goes through the reader. The context and the overlaps
    are bound, not passed: each array argument costs the call about 35 ns to unbox."""
    ctx = _vector(bound, B_CTX)
    overlaps = _matrix(bound, B_OVERLAPS)
    if ctx[CTX_MAPPED] != bound[B_VERSION]:
        return REFUSED, 0, 0, NO_COLUMN
    written = _vector(bound, B_WRITTEN)
    noted = bound[WRITTEN_COUNT]
    if noted < 0:
        overlaps[:] = 0
    for j in range(noted):
        for tier in range(overlaps.shape[0]):
            overlaps[tier, written[j]] = 0
    failed, noted = _overlap_shards(ctx, local, overlaps.shape[0], overlaps, written)
    if failed:
        bound[WRITTEN_COUNT] = -1
        return failed, 0, 0, NO_COLUMN
    bound[WRITTEN_COUNT] = noted
    head, device, terms = decide(local, overlaps, bound, isl, age, explain)
    return 0, head, device, terms


_INTS = types.Array(types.int64, 1, "C")
_WORDS = types.Array(types.uint64, 1, "C")
_OVERLAPS = types.Array(types.int64, 2, "C")
DECIDE_ARGS: Final = (_WORDS, _OVERLAPS, _INTS, types.float64, types.float64, types.boolean)
"""What :func:`decide` takes: ``local``, ``overlaps``, ``bound`` C-contiguous, ``isl``, ``age``, ``explain``."""
ON_SHARDS_ARGS: Final = (_WORDS, _INTS, types.float64, types.float64, types.boolean)
"""What :func:`decide_on_shards` takes: as :func:`decide`, without ``overlaps``."""

Decider = Callable[
    [npt.NDArray[np.uint64], npt.NDArray[np.int64], npt.NDArray[np.int64], float, float, bool], tuple[int, int, Column]
]
""":func:`decide`'s type."""
OnShards = Callable[[npt.NDArray[np.uint64], npt.NDArray[np.int64], float, float, bool], tuple[int, int, int, Column]]
""":func:`decide_on_shards`' type."""


@functools.cache
def entry_points() -> tuple[Decider, OnShards]:
    """:func:`decide` and :func:`decide_on_shards` compiled for exactly the argument types above (loaded from
    numba's cache when there), as callables that skip the dispatcher.

    Why: numba's dispatcher types every argument and looks the signature up on each call, about a
    microsecond for six arguments, a tenth of a 16-worker decision. The entry point only unboxes. The cost:
    it trusts its caller more than the dispatcher does. Unboxing refuses an array whose items have
    another size, but reads a strided view as if it were contiguous, and ``uint64`` as ``int64``, where the
    dispatcher would have compiled another version. The router passes only arrays it made to these
    types (``local`` through ``local_hash_array``, an array index's answer through
    ``np.ascontiguousarray``), so it calls these; tests and tools call the dispatchers. Compiled on first
    use, not at import: a cold numba cache takes seconds per kernel."""
    dispatchers: tuple[Any, Any] = (decide, decide_on_shards)  # numba's, typed as their functions (``_jit``)
    return dispatchers[0].compile(DECIDE_ARGS), dispatchers[1].compile(ON_SHARDS_ARGS)


Weights = tuple[
    float, float, float, float, float, float, float, float, float,
    float, float, float, float, float, float, float, float,
]  # fmt: skip
"""The per-decision scalars the terms read, out of ``params``, and the decision's load-dependent two: the credit
per predicted block and the device credit's scale (``_weights``)."""


@inlined
def _weights(params: npt.NDArray[np.float64], queued_share: float, seen_load: float) -> Weights:
    isl = params[P_ISL]
    block = params[P_BLOCK]
    return (
        isl,
        block,
        max(1.0, math.ceil(isl / block)),
        params[P_TRACK_PREFILL],
        params[P_DECAY],
        params[P_CREDIT],
        params[P_HOST],
        params[P_DISK],
        params[P_SHARED],
        params[P_SCALE],
        params[P_TRACK_BLOCKS],
        params[P_NBLOCKS],
        params[P_REQUEST_WEIGHT],
        params[P_LMETRIC],
        params[P_WORK_WEIGHT],
        _predicted_weight(params[P_PREDICTED], seen_load),
        1.0 + params[P_CREDIT_GAIN] * queued_share,
    )


@inlined
def _queued_share(
    candidates: npt.NDArray[np.int64],
    prefill: npt.NDArray[np.int64],
    limited: bool,
    out: npt.NDArray[np.float64],
    eligible: int,
) -> float:
    """The share of eligible candidates with prefill queued (``cost.py``'s load share)."""
    queued = 0
    for i in range(candidates.size):
        if prefill[candidates[i]] > 0 and not (limited and out[C_BUSY, i] != 0.0):
            queued += 1
    return queued / eligible


@inlined
def _predicted_weight(weight: float, seen_load: float) -> float:
    """``cost.predicted_weight``."""
    if weight == 0.0:
        return 0.0
    low = min(1.0, weight)
    return low + (weight - low) * max(0.0, seen_load - PREDICTED_IDLE_SHARE) / (1.0 - PREDICTED_IDLE_SHARE)


@inlined
def _seen_load(seen: npt.NDArray[np.float64], queued_share: float, age: float) -> float:
    """``SlotManager.seen_load``: fold this decision's queued share into ``seen`` at ``age``; the new average."""
    fade = math.exp(-max(0.0, age - seen[SINCE]) / LOAD_WINDOW_SECS)
    average: float = seen[AVERAGE] * fade + queued_share * (1.0 - fade)
    seen[AVERAGE] = average
    seen[SINCE] = age
    return average


@inlined
def _decay(active: int, least: int, weights: Weights) -> float:
    """The overlap credit's decay for a candidate with ``active`` queued prefill tokens, ``least`` being the
    lowest over the eligible candidates (``cost.worker_cost``'s arithmetic)."""
    block, request_blocks, decay_w = weights[1], weights[2], weights[4]
    queued = max(0, active - least)
    return 1.0 / (1.0 + decay_w * queued / block / request_blocks)


Terms = tuple[float, float, float, float, float, float, float, float, float, float]
"""One candidate's terms as :func:`_terms` gives them: the ``C_*`` rows but the busy flag and the decay."""


@inlined
def _terms(
    overlap: tuple[int, int, int, int],
    loads: tuple[int, int, int, int],
    trust: float,
    decay: float,
    factor_of: float,
    mean_recent: float,
    weights: Weights,
) -> Terms:
    """One candidate's terms, ``cost.worker_cost``'s arithmetic in its order: ``(raw, credit, adjusted,
    prefill cost, decode blocks, request cost, total, work factor, predicted blocks, predicted credit)``.
    ``overlap`` is the slot's per tier, ``loads`` its queued prefill, requests, active blocks and leading
    active blocks (beyond the device overlap, the predicted tier's blocks), ``trust`` its credit factor
    (``untrusted_overlap_weight`` for a worker marked untrusted, else 1), ``decay`` its credit's decay
    (:func:`_decay`, 1 when off), ``factor_of`` its decayed recent work; ``mean_recent`` the mean recent
    work over the eligible candidates; ``weights`` end with the decision's credit per predicted block and
    device credit scale. The
    one place the arithmetic lives: the pass over every candidate and the fill of the chosen ones' columns
    both call it, through :func:`_slot_terms`."""
    isl, block, _, track_prefill, _, credit_w, host_w, disk_w, shared_w, scale = weights[:10]
    track_blocks, nblocks, request_w, lmetric, work_weight, predicted_w, credit_scale = weights[10:]
    device, host, disk, shared = overlap
    active, requests, blocks, leading = loads
    raw = (active + isl) / block if track_prefill != 0.0 else 0.0
    credit = 0.0  # what the sum below gives for a worker holding nothing, every weight being finite and >= 0
    if device != 0 or host != 0 or disk != 0 or shared != 0:  # most workers of a large fleet hold nothing
        credit = (
            credit_w * credit_scale * decay * device
            + host_w * max(0, host - device)
            + disk_w * max(0, disk - host)
            + shared_w * max(0, shared - disk)
        )
    if trust != 1.0:
        credit *= trust
    predicted = 0  # the active requests' run beyond the events', when the tier is on
    if predicted_w != 0.0 and leading > device:
        predicted = leading - device
    predicted_credit = predicted_w * predicted
    credit += predicted_credit
    adjusted = raw - credit
    if not adjusted > 0.0:
        adjusted = 0.0
    prefill_cost = scale * adjusted
    decode = 0.0
    if track_blocks != 0.0:
        decode = blocks + nblocks - leading
    request_cost = request_w * requests
    total = adjusted * (decode + 1.0) if lmetric != 0.0 else prefill_cost + decode + request_cost
    factor = 1.0
    if work_weight != 0.0 and mean_recent > 0.0:
        factor = max(0.0, 1.0 + work_weight * ((factor_of - mean_recent) / (mean_recent + isl)))
        total *= factor
    return raw, credit, adjusted, prefill_cost, decode, request_cost, total, factor, float(predicted), predicted_credit


@inlined
def _fill(out: npt.NDArray[np.float64], i: int, terms: Terms) -> None:
    raw, credit, adjusted, prefill_cost, decode, request_cost, total, factor, predicted, predicted_credit = terms
    out[C_RAW, i] = raw
    out[C_CREDIT, i] = credit
    out[C_ADJUSTED, i] = adjusted
    out[C_PREFILL_COST, i] = prefill_cost
    out[C_DECODE_BLOCKS, i] = decode
    out[C_REQUEST_COST, i] = request_cost
    out[C_TOTAL, i] = total
    out[C_WORK_FACTOR, i] = factor
    out[C_PREDICTED, i] = predicted
    out[C_PREDICTED_CREDIT, i] = predicted_credit


SlotState = tuple[
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.float64],
    bool,
    npt.NDArray[np.float64],
    float,
    float,
    Weights,
]
"""What :func:`_slot_terms` reads: ``overlaps``, the slot manager's ``prefill``, ``requests``, ``blocks``,
``leading``, ``trust`` and whether to weigh by it, ``work`` and its decay now, the mean recent work and
the weights."""


@inlined
def _slot_terms(slot: np.uint64, decay: float, state: SlotState) -> Terms:
    """:func:`_terms` of the candidate in ``slot``, its loads read from the slot manager's arrays. Inlined, its
    array arguments cost nothing: the compiled decision holds no more atomic (reference count)
    instructions than with the loads written out at each call."""
    overlaps, prefill, requests, blocks, leading, trust, weigh, work, decay_now, mean_recent, weights = state
    return _terms(
        (overlaps[0, slot], overlaps[1, slot], overlaps[2, slot], overlaps[3, slot]),
        (prefill[slot], requests[slot], blocks[slot], leading[slot]),
        trust[slot] if weigh else 1.0,
        decay,
        work[slot] * decay_now,
        mean_recent,
        weights,
    )


@inlined
def _in_a_run(candidates: npt.NDArray[np.int64]) -> bool:
    """Whether the candidates' slots are ``candidates[0]``, ``candidates[0] + 1``, ... (a fleet numbered as it
    was seen is): one compare per candidate, where each load through ``candidates`` costs a gather."""
    first = candidates[0]
    run = True
    for i in range(candidates.size):
        run &= candidates[i] == first + i
    return run


@kernel
def cost_and_choose(
    candidates: npt.NDArray[np.int64],
    overlaps: npt.NDArray[np.int64],
    prefill: npt.NDArray[np.int64],
    requests: npt.NDArray[np.int64],
    blocks: npt.NDArray[np.int64],
    leading: npt.NDArray[np.int64],
    capacities: npt.NDArray[np.float64],
    work: npt.NDArray[np.float64],
    params: npt.NDArray[np.float64],
    out: npt.NDArray[np.float64],
    ties: npt.NDArray[np.int64],
    trust: npt.NDArray[np.float64],
    seen: npt.NDArray[np.float64],
    explain: bool,
) -> tuple[int, int, int]:  # hot path: two passes over the candidates, then the chosen and its ties
    """Cost every candidate into ``out`` and choose.

    Args:
        candidates: slot per candidate, in the caller's order.
        overlaps: ``(4, slots)`` cumulative overlap per tier per slot.
        prefill, requests, blocks: the slot manager's counters per slot.
        leading: per slot, leading prompt blocks held by its active requests.
        capacities: per candidate, KV blocks (0: unknown); empty when the decode threshold is off.
        work: per slot, the booked uncached prefill scaled to the slot manager's epoch; times
            ``exp(-P_WORK_AGE / P_WORK_WINDOW)``, the recent work of the work factor (``cost.py``).
        params: the ``P_*`` scalars.
        out: ``(COLUMNS, len(candidates))``, written: a row per term, so a decision over thousands of
            candidates writes contiguous rows, not a cache line per candidate. Every candidate gets its
            ``C_TOTAL``, and its ``C_BUSY`` when a busy threshold is set or every term is written; the
            other terms only ``head`` and ``ties[:count]`` at temperature 0 unless ``explain`` (what the
            caller reads): at 1,024 candidates the stores of every term were half the decision.
        ties: ``len(candidates)`` scratch; at temperature 0, ``ties[:count]`` are the candidates (positions)
            tied with ``head`` after it, in order.
        trust: per slot, the credit factor (1 unless the slot's worker is marked untrusted); empty when
            no candidate's credit is weighted down.
        seen: the slot manager's seen load (``slots.AVERAGE``, ``SINCE``); with the predicted tier on, the
            decision folds its queued share into it at ``P_WORK_AGE`` (``SlotManager.seen_load``'s arithmetic).
        explain: write every candidate's terms (also done above temperature 0, where ``sample`` reads
            every total and the caller's choice is not known here).

    Returns:
        ``(head, skip, count)``. At temperature 0: ``head`` the position of the first cheapest eligible
        candidate; the oracle's reservoir pass draws ``skip`` numbers that cannot matter, then one per
        ``ties[j]`` (replace the pick when ``u * (j + 2) < 1``). Above 0, ``SAMPLE``: the oracle draws its
        uniform only once it knows some candidate is eligible, so the caller draws now and calls
        :func:`sample`. ``head`` is ``NO_WORKER`` when all are busy (and nothing is to be drawn).
    """
    k = candidates.size
    decode_limit = params[P_DECODE_LIMIT]
    prefill_limit = params[P_PREFILL_LIMIT]
    has_capacity = capacities.size > 0 and not math.isnan(decode_limit)
    limited = has_capacity or not math.isnan(prefill_limit)
    every = explain or params[P_TEMPERATURE] != 0.0
    decay_now = 0.0
    if params[P_WORK_WEIGHT] != 0.0:  # one factor for every slot: the work is kept scaled to one epoch
        decay_now = math.exp(-max(0.0, params[P_WORK_AGE]) / params[P_WORK_WINDOW])
    least = np.iinfo(np.int64).max
    eligible = k
    recent_sum = 0.0
    if limited:
        eligible = 0
        for i in range(k):
            slot = candidates[i]
            decode_busy = has_capacity and capacities[i] != 0.0 and blocks[slot] > decode_limit * capacities[i]
            busy = decode_busy or (not math.isnan(prefill_limit) and prefill[slot] > prefill_limit)
            out[C_BUSY, i] = 1.0 if busy else 0.0
            if not busy:
                eligible += 1
                recent_sum += work[slot] * decay_now
                if prefill[slot] < least:
                    least = prefill[slot]
    else:  # no threshold: every candidate is eligible; the busy row is written only for whoever reads it
        if every:
            out[C_BUSY, :] = 0.0
        if params[P_WORK_WEIGHT] != 0.0:
            for i in range(k):
                recent_sum += work[candidates[i]] * decay_now
        if params[P_DECAY] != 0.0 and params[P_TRACK_PREFILL] != 0.0:
            for i in range(k):
                slot = candidates[i]
                if prefill[slot] < least:
                    least = prefill[slot]
    if eligible == 0:
        return NO_WORKER, 0, 0
    mean_recent = recent_sum / eligible
    weigh = trust.size > 0  # empty unless some candidate's credit is weighted down: no load per candidate then
    share = 0.0  # no pass over the candidates when nothing reads it
    if params[P_PREDICTED] != 0.0 or params[P_CREDIT_GAIN] != 0.0:
        share = _queued_share(candidates, prefill, limited, out, eligible)
    seen_load = 0.0
    if params[P_PREDICTED] != 0.0:
        seen_load = _seen_load(seen, share, params[P_WORK_AGE])
    weights = _weights(params, share, seen_load)
    decaying = params[P_DECAY] != 0.0 and params[P_TRACK_PREFILL] != 0.0
    if decaying:  # a worker holding nothing gets no credit to decay: its three divisions are skipped
        for i in range(k):
            slot = candidates[i]
            held = overlaps[0, slot] | overlaps[1, slot] | overlaps[2, slot] | overlaps[3, slot]
            out[C_DECAY, i] = _decay(prefill[slot], least, weights) if held != 0 else 1.0
    state = (overlaps, prefill, requests, blocks, leading, trust, weigh, work, decay_now, mean_recent, weights)
    first = candidates[0]
    if candidates[k - 1] - first == k - 1 and _in_a_run(candidates):
        for i in range(k):  # slots first, first + 1, ...: every load is contiguous, so the loop is vectorised
            out[C_TOTAL, i] = _slot_terms(  # only the total: compiled inline, the other terms are never computed
                np.uint64(first + i),  # unsigned: numba then indexes without a negative-index wrap
                out[C_DECAY, i] if decaying else 1.0,
                state,
            )[6]
    else:  # a gather per load: no quicker vectorised, so the loop stays scalar
        for i in range(k):
            out[C_TOTAL, i] = _slot_terms(np.uint64(candidates[i]), out[C_DECAY, i] if decaying else 1.0, state)[6]
    # the oracle's reservoir pass (``selection.choose``) over the eligible totals, without its draws:
    # the first eligible is "equal to itself" (one draw that always picks it), a cheaper one restarts the
    # ties, an equal one is a tie (a draw each)
    head = -1
    best = 0.0
    draws = skip = count = 0
    for i in range(k):
        if limited and out[C_BUSY, i] != 0.0:
            continue
        total = out[C_TOTAL, i]
        if head < 0:
            head, best, draws, skip, count = i, total, 1, 1, 0
        elif total < best:
            head, best, skip, count = i, total, draws, 0
        elif total == best:
            ties[count] = i
            count += 1
            draws += 1
    for j in range(k if every else count + 1):  # every candidate's terms, or the chosen's and its ties'
        i = j if every else (head if j == 0 else ties[j - 1])
        _fill(out, i, _slot_terms(np.uint64(candidates[i]), out[C_DECAY, i] if decaying else 1.0, state))
    if params[P_TEMPERATURE] != 0.0:
        return SAMPLE, 0, 0
    return head, skip, count


@kernel
def sample(
    out: npt.NDArray[np.float64],
    temperature: float,
    u: float,
    eligible: npt.NDArray[np.int64],
    work: npt.NDArray[np.float64],
) -> int:
    """``selection.choose`` above temperature 0 with the draw ``u``: the position chosen (``eligible`` and
    ``work`` are scratch of one entry per candidate)."""
    n = 0
    for i in range(out.shape[1]):
        if out[C_BUSY, i] == 0.0:
            eligible[n] = i
            work[n] = out[C_TOTAL, i]
            n += 1
    low = work[0]
    high = work[0]
    for j in range(1, n):
        low = min(low, work[j])
        high = max(high, work[j])
    cumulative = 0.0
    if high == low:
        p = 1.0 / n
        for j in range(n):
            cumulative += p
            if cumulative >= u:
                return int(eligible[j])
        return int(eligible[n - 1])
    span = high - low
    if not math.isfinite(span):
        largest = 0.0
        for j in range(n):
            largest = max(largest, abs(work[j]))
        for j in range(n):
            work[j] = work[j] / largest
        low = work[0]
        high = work[0]
        for j in range(1, n):
            low = min(low, work[j])
            high = max(high, work[j])
        span = high - low
    if span * temperature == 0.0:
        tied = 0
        for j in range(n):
            if work[j] == low:
                tied += 1
        p = 1.0 / tied
        for j in range(n):
            cumulative += p if work[j] == low else 0.0
            if cumulative >= u:
                return int(eligible[j])
        return int(eligible[n - 1])
    total = 0.0
    for j in range(n):
        work[j] = math.exp(-(work[j] - low) / (span * temperature))
        total += work[j]
    for j in range(n):
        cumulative += work[j] / total
        if cumulative >= u:
            return int(eligible[j])
    return int(eligible[n - 1])
