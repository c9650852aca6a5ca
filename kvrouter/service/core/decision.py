"""``Decision``: one routing decision as a value, and the sinks it is handed to.

The decider (``decider.py``) makes a decision and books it; everything else that follows from it (the
counters ``/metrics`` shows, the session's affinity, the blocks the index cap sees matched, the decisions
ring, the explain-by-id ring and the decision log, the shadow policies' comparison) is a *sink* that
reads the record: :func:`sinks` lists them in the order they run, and the decider calls each once, in one
loop. A new consumer of decisions is one more sink here, not another line in the decision's code.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ...events.model import WorkerKey
from ...routing.disagg import PREFILL_BOOKING, Split
from ...routing.router import Selection
from ...sim.policy import Cluster, Request
from .affinity import Affinity
from .counters import ServiceCounters
from .decisions import DecisionLog, DecisionRecords, Recorded, worker_terms
from .journal import Journal
from .matches import Matches
from .partition import Partition
from .requests import SelectRequest
from .shadow import ShadowChoice, Shadows

__all__ = ["Decision", "DecisionSink", "ShadowRound", "explain", "sinks"]

Sink = Callable[["Decision"], None]
DecisionSink = Sink
"""A consumer of decisions: called once per decision (probes excluded), after it is booked."""
_EXPLAINED: Final = "explain"


@dataclass(slots=True)
class ShadowRound:
    """The shadow policies' choices for one decision, made before the live decision booked anything."""

    request: Request
    cluster: Cluster
    choices: list[ShadowChoice]


@dataclass(slots=True)
class Decision:
    """One decision, as every edge answers it and every sink reads it."""

    partition: Partition
    selection: Selection
    selection_id: str | None
    """The reservation id when the request was booked (``select_and_reserve``), else the client's id."""
    reserved: bool
    fallbacks: list[tuple[WorkerKey, float]]
    """The next-best eligible workers with their costs, cheapest first."""
    endpoint: str | None
    address: str | None
    request: SelectRequest
    local: npt.NDArray[np.uint64]
    """The prompt's local block hashes."""
    elapsed: float = 0.0
    """Seconds the router took (the ``decide`` phase)."""
    seq: int = 0
    """The decisions ring's number (0 for a probe, which no sink sees)."""
    shadows: ShadowRound | None = None
    split: Split | None = None
    """In a disaggregated partition (``routing/disagg.py``): both choices; ``selection`` is ``split.decode``.
    None in an aggregated partition."""
    prefill_endpoint: str | None = None
    prefill_address: str | None = None
    """The prefill worker's, when the request is split."""


def explain(decision: Decision, selection: Selection | None = None) -> dict[str, Any]:
    """The ``explain`` member: the weights in effect and every candidate's terms, of ``selection`` (the
    decision's own by default; a split request's prefill choice otherwise)."""
    partition = decision.partition
    config = partition.router.config
    selection = decision.selection if selection is None else selection
    explanation = selection.explanation or ()
    prompt_blocks = selection.isl_tokens // partition.block_size
    return {
        "weights": {
            "overlap_credit": config.overlap_score_credit,
            "prefill_load_scale": config.prefill_load_scale,
            "decode_active_request_weight": config.decode_active_request_weight,
            "prefill_work_weight": config.prefill_work_weight,
            "predicted_credit": config.predicted_credit,
            "credit_load_gain": config.credit_load_gain,
            "temperature": config.router_temperature,
            "policy": config.router_selection_policy,
        },
        "workers": [worker_terms(w, prompt_blocks) for w in explanation],
        "trust": {f"{w.worker[0]}:{w.worker[1]}": partition.trust.get(w.worker) for w in explanation},
    }


def _counted(counters: ServiceCounters) -> Sink:
    def count(decision: Decision) -> None:
        selection = decision.selection
        blocks = len(decision.local)
        counters.decision.observe(decision.elapsed)
        counters.phases["decide"].observe(decision.elapsed)
        counters.hit_rate.observe(selection.overlap_blocks / blocks if blocks else 0.0)
        counters.decisions += 1
        counters.selections[selection.worker] = counters.selections.get(selection.worker, 0) + 1
        counters.overlap_blocks += selection.overlap_blocks
        counters.prompt_blocks += blocks
        if decision.reserved:
            counters.reservations += 1

    return count


def _bound(affinity: Affinity) -> Sink:
    def bind(decision: Decision) -> None:
        affinity.bind(decision.partition.name, decision.request.session_id, decision.selection.worker)

    return bind


def _matched(matches: Matches) -> Sink:
    def match(decision: Decision) -> None:
        overlap = decision.selection.overlap_blocks
        if overlap and decision.partition.approx is None:  # approximate mode's index is its own
            matches.add(decision.selection.worker, decision.local, overlap)

    return match


def _compared(shadows: Shadows) -> Sink:
    def account(decision: Decision) -> None:
        round_, record = decision.shadows, decision.selection.record
        if round_ is not None and record is not None:
            shadows.account(
                decision.partition, round_.request, round_.cluster, round_.choices, decision.selection.worker, record
            )

    return account


def _ringed(journal: Journal) -> Sink:
    def ring(decision: Decision) -> None:
        selection = decision.selection
        partition = decision.partition
        entry: dict[str, Any] = {
            "seq": decision.seq,
            "at": time.time(),
            "model_name": partition.model_name,
            "routing_group": partition.routing_group,
            "worker_id": selection.worker[0],
            "dp_rank": selection.worker[1],
            "overlap_blocks": selection.overlap_blocks,
            "prompt_blocks": len(decision.local),
            "isl_tokens": selection.isl_tokens,
            "cost": selection.cost.total,
            "reserved": decision.reserved,
            "selection_id": decision.selection_id,
            "decision_us": round(decision.elapsed * 1e6, 1),
        }
        if decision.shadows is not None:
            entry["shadows"] = {
                c.policy: {
                    "worker_id": c.worker[0],
                    "dp_rank": c.worker[1],
                    "overlap_blocks": c.overlap_blocks,
                    "cost": c.cost,
                }
                for c in decision.shadows.choices
            }
        if selection.explanation is not None:
            entry[_EXPLAINED] = explain(decision)["workers"]
        split = decision.split
        if split is not None:  # a disaggregated partition's: split, with its prefill worker, or why not
            entry["split"] = split.prefill is not None
            if split.prefill is not None:
                entry["prefill_worker_id"], entry["prefill_dp_rank"] = split.prefill.worker
            else:
                entry["local_prefill_reason"] = split.reason
        journal.decided(entry)

    return ring


def _kept(records: DecisionRecords, log: DecisionLog | None) -> Sink:
    def keep(decision: Decision) -> None:
        record = decision.selection.record
        if record is None:
            return
        partition = decision.partition
        recorded = Recorded(
            decision.selection_id or f"seq-{decision.seq}",
            decision.seq,
            time.time(),
            partition.model_name,
            partition.routing_group,
            partition.block_size,
            decision.selection.isl_tokens,
            decision.reserved,
            record,
        )
        if decision.selection_id is not None:
            records.add(recorded)
            split = decision.split
            prefill = None if split is None else split.prefill
            if prefill is not None and prefill.record is not None:  # ``/decisions/{id}``'s ``prefill``
                records.add(dataclasses.replace(recorded, selection_id=recorded.selection_id + PREFILL_BOOKING,
                                                record=prefill.record))  # fmt: skip
        if log is not None:
            log.add(recorded)

    return keep


def sinks(
    *,
    counters: ServiceCounters,
    affinity: Affinity,
    matches: Matches,
    journal: Journal,
    records: DecisionRecords,
    log: DecisionLog | None,
    shadows: Shadows | None,
) -> tuple[Sink, ...]:
    """Every sink of a service's decisions, in the order they run."""
    made: list[Sink] = [_bound(affinity), _counted(counters), _matched(matches)]
    if shadows is not None:
        made.append(_compared(shadows))  # before the ring: it prices each shadow's pick
    made += [_ringed(journal), _kept(records, log)]
    return tuple(made)
