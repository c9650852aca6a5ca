"""The disaggregated policies ``kvrouter simulate --prefill-workers P --decode-workers D`` compares.

- ``kvrouter_disagg``: kvrouter's two choices and its conditional rule (``routing/disagg.py``): the prefill
  worker by ``KVROUTER_CONFIG``'s cost among the prefill workers, the decode worker by decode load, own
  overlap and the link, and the decode worker prefills itself when little is uncached there.
- ``kvrouter_always_split``: the same two choices, every request split.
- ``dynamo_disagg``: Dynamo's disaggregated routing as its docs describe it: the KV-aware prefill choice
  (``dynamo_t0``'s cost) and the least-loaded decode worker (active decode blocks, a random one of equals),
  every request split.
- ``random_pairs``: a random prefill worker and a random decode worker, every request split.

The aggregated comparison (``kvrouter`` on P+D workers) is the aggregated simulator's own policy.
"""

from __future__ import annotations

from typing import Any, Final

from ...errors import ConfigError
from ...events.model import WorkerKey
from ...routing import RouterConfig
from ...routing.config import KVROUTER_CONFIG
from ...routing.disagg import DEFAULT_MAX_LOCAL_PREFILL_TOKENS, Split, router_select, select_split
from ...routing.router import Router
from ..disagg import DisaggPolicy, Fleet, Plan
from ..policy import Request
from ._router import RouterPolicy, still_clock

__all__ = [
    "DISAGG_POLICIES",
    "DynamoDisaggPolicy",
    "KvrouterAlwaysSplitPolicy",
    "KvrouterDisaggPolicy",
    "RandomPairsPolicy",
    "make_disagg_policy",
]


class _PrefillChoice(DisaggPolicy):
    """A policy whose prefill choice is a :class:`RouterPolicy` over the prefill workers."""

    def __init__(self, config: RouterConfig, seed: int) -> None:
        self._prefill = RouterPolicy(config, seed=seed)

    def _choose_prefill(self, request: Request, fleet: Fleet) -> WorkerKey:
        return self._prefill.choose(request, fleet.pool(fleet.prefill))

    def booked_overlap(self, request: Request, worker: WorkerKey, index_overlap: int) -> int:
        return self._prefill.booked_overlap(request, worker, index_overlap)


class KvrouterDisaggPolicy(DisaggPolicy):
    """kvrouter's conditional disaggregation: :func:`~kvrouter.routing.disagg.select_split`, the service's call.

    Args:
        seed: the router's tie-break.
        max_local_prefill_tokens: ``--disagg-max-local-prefill-tokens``.
        prefill_busy_tokens: ``--disagg-prefill-busy-tokens`` (None: off).
    """

    name = "kvrouter_disagg"

    def __init__(
        self,
        *,
        seed: int = 0,
        max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
        prefill_busy_tokens: int | None = None,
    ) -> None:
        self.seed = seed
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.prefill_busy_tokens = prefill_busy_tokens
        self._router: Router | None = None
        self._last: tuple[str, Split] | None = None

    def plan(self, request: Request, fleet: Fleet) -> Plan:
        router = self._router
        if router is None or router.slots is not fleet.slots:
            router = self._router = Router(
                KVROUTER_CONFIG, block_size=fleet.block_size, seed=self.seed, clock=still_clock, slots=fleet.slots
            )
        split = select_split(
            router_select(router, fleet.index, request.local_hashes, request.input_tokens),
            fleet.index,
            fleet.slots,
            fleet.block_size,
            fleet.prefill,
            fleet.decode,
            local_hashes=request.local_hashes,
            isl_tokens=request.input_tokens,
            factor=fleet.factor,
            max_local_prefill_tokens=self.max_local_prefill_tokens,
            prefill_busy_tokens=self.prefill_busy_tokens,
        )
        self._last = (request.request_id, split)
        return Plan(split.decode.worker, None if split.prefill is None else split.prefill.worker, split.reason)

    def booked_overlap(self, request: Request, worker: WorkerKey, index_overlap: int) -> int:
        last = self._last
        if last is None or last[0] != request.request_id or last[1].prefill is None:
            return index_overlap
        prefill = last[1].prefill
        return index_overlap + prefill.predicted_blocks if prefill.worker == worker else index_overlap


class KvrouterAlwaysSplitPolicy(KvrouterDisaggPolicy):
    """kvrouter's two choices with every request split (no prompt is short enough to stay): what the
    conditional rule is measured against."""

    name = "kvrouter_always_split"

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed, max_local_prefill_tokens=-1)


class DynamoDisaggPolicy(_PrefillChoice):
    """Dynamo's disaggregated routing: KV-aware prefill (``RouterConfig()``), least-loaded decode, always split."""

    name = "dynamo_disagg"

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(RouterConfig(), seed)

    def plan(self, request: Request, fleet: Fleet) -> Plan:
        prefill = self._choose_prefill(request, fleet)
        loads = [fleet.slots.active_blocks(key) for key in fleet.decode]
        least = min(loads)
        decode = fleet.rng.choice([key for key, load in zip(fleet.decode, loads, strict=True) if load == least])
        return Plan(decode, prefill)


class RandomPairsPolicy(DisaggPolicy):
    """A uniformly random prefill worker and decode worker for every request."""

    name = "random_pairs"

    def plan(self, request: Request, fleet: Fleet) -> Plan:
        return Plan(fleet.rng.choice(fleet.decode), fleet.rng.choice(fleet.prefill))


DISAGG_POLICIES: Final[dict[str, type[DisaggPolicy]]] = {
    cls.name: cls for cls in (KvrouterDisaggPolicy, KvrouterAlwaysSplitPolicy, DynamoDisaggPolicy, RandomPairsPolicy)
}
"""Every disaggregated policy by the name ``kvrouter simulate`` runs it under."""


def make_disagg_policy(name: str, *, seed: int = 0, **options: Any) -> DisaggPolicy:
    """A fresh disaggregated policy for one run (``options``: its constructor's, as ``make_policy``).

    Raises:
        ConfigError: an unknown name, or an option the policy does not take.
    """
    cls = DISAGG_POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown disaggregated policy {name!r}; expected one of {', '.join(DISAGG_POLICIES)}")
    if cls is not RandomPairsPolicy:
        options["seed"] = seed
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"policy {name!r}: {exc}") from None
