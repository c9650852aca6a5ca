"""The two choices of a disaggregated request, and when not to split it.

Rules:

1. **The prefill worker** is chosen among the prefill-capable workers by today's cost function (cached
   overlap against queued prefill and decode load): the prefill hop is an aggregated decision whose
   output is one token.
2. **The decode worker** is chosen among the decode-capable workers by::

       cost(w) = active_decode_blocks(w) + missing_blocks(w) x link(w)

   where ``missing_blocks`` are the prompt's blocks ``w`` does not hold (its own cached overlap is
   reused, as vLLM's decode side pulls only what it lacks), and ``link`` is how much slower than a
   transfer inside ``w``'s topology domain the transfer from the prefill worker is: 1 inside one domain,
   ``gbps_local / gbps`` across (8 with the defaults). Lowest cost wins; ties go to the earlier worker.
3. **The decode worker prefills locally** when it is the prefill choice too (a ``both`` worker), when the
   prompt's part it lacks is at most ``max_local_prefill_tokens`` (a transfer's fixed cost and a second
   hop's latency buy nothing for a short prefill), or when every prefill worker has more than
   ``prefill_busy_tokens`` queued (a congested prefill pool; None: never). Otherwise the request is split.

Why this decode cost: both terms are blocks the decode worker will hold. The request's own blocks become
active decode blocks on whichever worker decodes it, so the blocks it already caches are the ones that
cost neither memory nor transfer there; a block that crosses a slow link costs its extra time on top.
The unit stays the router's (blocks), so no weight joins the options. Rejected: a cost in seconds
(decode load has no time without a model of the engine's speed) and least-loaded alone (Dynamo's decode
choice, which ignores the decode worker's cache and the link).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError
from ..events.model import StorageTier, WorkerKey
from ..options import Panel, option
from .router import OverlapSource, Router, Selection
from .slots import SlotManager

__all__ = [
    "DEFAULT_KV_BYTES_PER_TOKEN",
    "DEFAULT_MAX_LOCAL_PREFILL_TOKENS",
    "PREFILL_BOOKING",
    "SAME_WORKER",
    "DisaggConfig",
    "Link",
    "Select",
    "Split",
    "choose_decode",
    "decode_costs",
    "local_prefill_reason",
    "router_select",
    "select_split",
]

DEFAULT_KV_BYTES_PER_TOKEN: Final = 131_072
"""A Llama-3-8B-like shape: 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes."""
DEFAULT_MAX_LOCAL_PREFILL_TOKENS: Final = 2048
"""Not 512, the first guess: 2,048 lowered the TTFT p90 of ``kvrouter_disagg`` on every run of
``tools/bench_disagg.py``'s grid and on five of six held-out ones (the sixth 0.2 % higher), with the ITL p90
within 0.3 ms (``docs/routing-benchmark.md``, "Choosing the rule's defaults"). Below 4,096, so a fresh 4k
prompt on an idle fleet is split."""


@dataclass(frozen=True, slots=True)
class Link:
    """The KV transfer between a prefill and a decode worker: bandwidths and bytes per token.

    Raises:
        ValueError: a bandwidth or byte count that is not positive, or a fixed cost below 0.
    """

    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    gbps: float = 25.0
    """Between topology domains."""
    gbps_local: float = 200.0
    """Inside one domain."""
    overhead_ms: float = 0.0
    """A transfer's fixed cost (handshake, descriptor exchange): 0 in the router, an assumption in the simulator."""

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 1 or not self.gbps > 0 or not self.gbps_local > 0:
            raise ValueError("kv_bytes_per_token, gbps and gbps_local must be positive")
        if not self.overhead_ms >= 0:
            raise ValueError(f"overhead_ms must be >= 0, got {self.overhead_ms!r}")

    def factor(self, local: bool) -> float:
        """How many times slower than inside one domain the transfer is: 1 when ``local``."""
        return 1.0 if local else self.gbps_local / self.gbps

    def bytes(self, tokens: int) -> int:
        return max(0, tokens) * self.kv_bytes_per_token

    def ms(self, tokens: int, *, local: bool) -> float:
        """Milliseconds to move ``tokens`` tokens' KV: the fixed cost, then bytes over the link (0 for none)."""
        if tokens <= 0:
            return 0.0
        return self.overhead_ms + self.bytes(tokens) * 8 / ((self.gbps_local if local else self.gbps) * 1e9) * 1e3


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """``kvrouter up``'s options for disaggregated partitions: the link (rule 2) and when not to split (rule 3).

    Raises:
        ConfigError: a bandwidth or byte count that is not positive, or a negative token bound.
    """

    kv_bytes_per_token: int = field(
        default=DEFAULT_KV_BYTES_PER_TOKEN,
        metadata=option(
            "--kv-bytes-per-token",
            help="[bytes] KV one token takes; the default is a Llama-3-8B-like shape (32 x 8 x 128 x 2 x 2).",
            panel=Panel.DISAGG,
            min=1,
        ),
    )
    kv_transfer_gbps: float = field(
        default=25.0,
        metadata=option(
            "--kv-transfer-gbps", help="[Gbit/s] KV transfer bandwidth between topology domains.", panel=Panel.DISAGG
        ),
    )
    kv_transfer_gbps_local: float = field(
        default=200.0,
        metadata=option(
            "--kv-transfer-gbps-local", help="[Gbit/s] KV transfer bandwidth inside one domain.", panel=Panel.DISAGG
        ),
    )
    max_local_prefill_tokens: int = field(
        default=DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
        metadata=option(
            "--disagg-max-local-prefill-tokens",
            help="[tokens] The decode worker prefills a prompt it lacks at most this much of, unsplit.",
            panel=Panel.DISAGG,
            min=0,
        ),
    )
    prefill_busy_tokens: int | None = field(
        default=None,
        metadata=option(
            "--disagg-prefill-busy-tokens",
            help="[tokens] Prefill on the decode worker when every prefill worker has more than this queued.",
            panel=Panel.DISAGG,
            min=0,
            show_default="off",
        ),
    )

    def __post_init__(self) -> None:
        try:
            self.link  # noqa: B018 (the link checks its own fields)
        except ValueError as exc:
            raise ConfigError(f"DisaggConfig: {exc}") from exc
        if self.max_local_prefill_tokens < 0 or (self.prefill_busy_tokens is not None and self.prefill_busy_tokens < 0):
            raise ConfigError("DisaggConfig: token bounds must be >= 0")

    @property
    def link(self) -> Link:
        return Link(self.kv_bytes_per_token, self.kv_transfer_gbps, self.kv_transfer_gbps_local)


def decode_costs(
    candidates: Sequence[WorkerKey],
    prompt_blocks: int,
    overlaps: Mapping[WorkerKey, int],
    loads: Mapping[WorkerKey, int],
    factors: Mapping[WorkerKey, float],
) -> list[float]:
    """Each candidate's decode cost (rule 2), in ``candidates`` order.

    Args:
        candidates: the decode-capable workers.
        prompt_blocks: the prompt's blocks, its partial last block included.
        overlaps: each worker's cached leading blocks of the prompt (absent: 0).
        loads: each worker's active decode blocks (absent: 0).
        factors: each worker's :meth:`Link.factor` from the prefill worker (absent: 1).
    """
    return [
        loads.get(key, 0) + max(0, prompt_blocks - overlaps.get(key, 0)) * factors.get(key, 1.0) for key in candidates
    ]


def choose_decode(costs: Sequence[float], candidates: Sequence[WorkerKey]) -> WorkerKey:
    """The cheapest candidate; the first of equals."""
    best = min(range(len(candidates)), key=costs.__getitem__)
    return candidates[best]


def local_prefill_reason(
    uncached_tokens: int,
    queued_prefill_tokens: Iterable[int],
    *,
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    prefill_busy_tokens: int | None = None,
) -> str | None:
    """Why the decode worker prefills the request itself (rule 3), or None to split it.

    Args:
        uncached_tokens: the prompt's tokens the chosen decode worker does not hold.
        queued_prefill_tokens: each prefill-capable worker's queued prefill tokens.
    """
    if uncached_tokens <= max_local_prefill_tokens:
        return f"short_prefill: {uncached_tokens} uncached tokens <= {max_local_prefill_tokens}"
    if prefill_busy_tokens is not None:
        queued = list(queued_prefill_tokens)
        if queued and min(queued) > prefill_busy_tokens:
            return f"prefill_busy: every prefill worker has more than {prefill_busy_tokens} tokens queued"
    return None


PREFILL_BOOKING: Final = "#prefill"
"""A split request's prefill hop is booked on its prefill worker as ``<id>#prefill`` beside the request's own
id on its decode worker: two ordinary bookings, so the slot manager, the replica sync and the recording need
nothing new."""

SAME_WORKER: Final = "same_worker: the prefill choice is the decode worker (a worker of role both)"
"""Why a request whose two choices are one worker is not split: there is nothing to transfer."""

Select = Callable[[Sequence[WorkerKey], "str | None"], Selection]
"""``router.select`` among the given workers for one prompt, booking it under the id when one is given."""


@dataclass(frozen=True, slots=True)
class Split:
    """A disaggregated decision: the decode worker's selection, and the prefill worker's when the request is split."""

    decode: Selection
    prefill: Selection | None
    """None: the decode worker prefills the request itself (``reason`` says why)."""
    reason: str | None
    decode_costs: tuple[tuple[WorkerKey, float], ...]
    """Every decode candidate with its rule-2 cost, in the order given (none when nothing was split)."""


def select_split(
    select: Select,
    index: OverlapSource,
    slots: SlotManager,
    block_size: int,
    prefill_workers: Sequence[WorkerKey],
    decode_workers: Sequence[WorkerKey],
    *,
    local_hashes: Sequence[int] | npt.NDArray[np.uint64],
    isl_tokens: int,
    factor: Callable[[WorkerKey, WorkerKey], float],
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    prefill_busy_tokens: int | None = None,
    book: str | None = None,
) -> Split:
    """Both choices of one request and the rule between them (rules 1-3), on ``slots``' loads.

    The prefill choice is ``select`` among ``prefill_workers`` (booking nothing); the decode worker is the
    cheapest by :func:`decode_costs` (its overlap from ``index``'s device tier, its load from ``slots``,
    ``factor`` between the chosen prefill worker and it); its selection is ``select`` on it alone, so that its
    overlap, cost terms and explanation are the ones a booking and an answer need. With ``book``, a split
    request's prefill is booked on its prefill worker (``select`` on it alone, under ``book`` +
    :data:`PREFILL_BOOKING`) and the request on its decode worker under ``book``; an unsplit one on its
    decode worker only. Without ``prefill_workers`` (none healthy) the request is not split.
    """
    if not prefill_workers:  # a whole request: today's decision among the decode-capable workers
        alone = "no_prefill_worker: no schedulable worker of role prefill or both"
        return Split(select(decode_workers, book), None, alone, ())
    prefill = select(prefill_workers, None)
    local: Any = local_hashes
    hashes = local.tolist() if isinstance(local, np.ndarray) else list(local)  # every index takes a list
    device = index.find_matches_by_tier(hashes)[StorageTier.DEVICE]
    costs = decode_costs(
        decode_workers,
        math.ceil(isl_tokens / block_size),
        device,
        {key: slots.active_blocks(key) for key in decode_workers},
        {key: factor(prefill.worker, key) for key in decode_workers},
    )
    chosen = choose_decode(costs, decode_workers)
    reason = (
        SAME_WORKER
        if chosen == prefill.worker
        else local_prefill_reason(
            isl_tokens - device.get(chosen, 0) * block_size,
            (slots.active_prefill_tokens(key) for key in prefill_workers),
            max_local_prefill_tokens=max_local_prefill_tokens,
            prefill_busy_tokens=prefill_busy_tokens,
        )
    )
    if reason is None and book is not None:  # booked alone on it; the choice among all stays the answer
        select((prefill.worker,), book + PREFILL_BOOKING)
    decode = select((chosen,), book)
    return Split(decode, None if reason else prefill, reason, tuple(zip(decode_workers, costs, strict=True)))


def router_select(
    router: Router,
    index: OverlapSource,
    local_hashes: Sequence[int] | npt.NDArray[np.uint64],
    isl_tokens: int,
    *,
    capacities: Mapping[WorkerKey, int] | None = None,
    explain: bool = False,
) -> Select:
    """:data:`Select` on ``router`` for one prompt (the simulator's; the service records each call too)."""
    local: Any = local_hashes

    def select(workers: Sequence[WorkerKey], request_id: str | None) -> Selection:
        return router.select(
            index,
            workers,
            local_hashes=local,
            isl_tokens=isl_tokens,
            capacities=capacities,
            request_id=request_id,
            explain=explain,
        )

    return select
