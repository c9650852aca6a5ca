"""What the service keeps of each decision: an id-addressed ring to explain it later, and the decision log.

**Explain by id** (``GET /decisions/{selection_id}``): every decision that has an id (a reservation's
``selection_id``, or the id a ``/select`` client gave) keeps the router's :class:`DecisionRecord` — every
candidate's cost terms and overlaps as two small arrays — in :class:`DecisionRecords`, a ring bounded by
count and by bytes (a 4,096-candidate decision holds about 300 KB, a 16-candidate one 2 KB). The
explanation's Python objects are built only when someone asks, so keeping every decision costs a copy of
two arrays on the decision path, not the tens of microseconds of an explanation. The answer is the
decision as it was made: the candidates' terms, the winner, the runner-up and by how much it lost, and
the prefill a choice by overlap alone would have saved (``avoidable_prefill_tokens``: the best eligible
candidate's overlap minus the winner's, in tokens — what the router spent on balancing load).

**The decision log** (``--decision-log FILE``): one JSON line per decision (:func:`summary`: the winner,
its overlap and the best overlap, the runner-up, the cost), buffered and written once a second off the
decision path. ``kvrouter decision-log FILE`` summarises one (hit rate, avoidable prefill, per-worker
skew). Rejected: writing every candidate's terms to the log (kilobytes per decision at a few thousand
decisions a second); the ring holds those for the recent ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import orjson

from ...routing import _kernels as kernels
from ...routing.disagg import PREFILL_BOOKING
from ...routing.router import DecisionRecord, WorkerExplanation

__all__ = [
    "RECORDS_BYTES",
    "RECORDS_MAX",
    "DecisionLog",
    "DecisionRecords",
    "Recorded",
    "decision_json",
    "summarise",
    "summary",
]

log = logging.getLogger(__name__)

RECORDS_MAX: Final = 100_000
"""Decisions kept to explain by id, at most."""
RECORDS_BYTES: Final = 64 << 20
"""...and at most this much of their arrays: the oldest go first."""
FLUSH_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class Recorded:
    """One decision as the ring keeps it."""

    selection_id: str
    seq: int
    at: float
    model_name: str
    routing_group: str
    block_size: int
    isl_tokens: int
    reserved: bool
    record: DecisionRecord


class DecisionRecords:
    """The ring behind ``GET /decisions/{selection_id}``: insertion-ordered, bounded by count and bytes."""

    def __init__(self, max_records: int = RECORDS_MAX, max_bytes: int = RECORDS_BYTES) -> None:
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, Recorded] = OrderedDict()
        self.nbytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._records)

    def add(self, recorded: Recorded) -> None:
        old = self._records.pop(recorded.selection_id, None)  # a /select id reused: the newest wins
        if old is not None:
            self.nbytes -= old.record.nbytes
        self._records[recorded.selection_id] = recorded
        self.nbytes += recorded.record.nbytes
        while self._records and (len(self._records) > self.max_records or self.nbytes > self.max_bytes):
            _, gone = self._records.popitem(last=False)
            self.nbytes -= gone.record.nbytes
            self.evicted += 1

    def get(self, selection_id: str) -> Recorded | None:
        return self._records.get(selection_id)

    def explained(self, selection_id: str) -> dict[str, Any] | None:
        """``GET /decisions/{selection_id}``'s answer, with a split request's prefill choice as ``prefill``
        (kept as ``<id>#prefill``); None when the decision is not kept."""
        recorded = self._records.get(selection_id)
        if recorded is None:
            return None
        answer = decision_json(recorded)
        prefill = self._records.get(selection_id + PREFILL_BOOKING)
        if prefill is not None:
            answer["prefill"] = decision_json(prefill)
        return answer


def _eligible(record: DecisionRecord) -> np.ndarray[Any, np.dtype[np.bool_]]:
    eligible: np.ndarray[Any, np.dtype[np.bool_]] = record.terms[kernels.C_BUSY] == 0.0
    return eligible


def summary(recorded: Recorded) -> dict[str, Any]:
    """The decision log's line: who won with what overlap and cost, the best overlap any eligible candidate
    had, and the runner-up. From the arrays alone (numpy, a few µs)."""
    record = recorded.record
    terms, device = record.terms, record.overlaps[0]
    eligible = _eligible(record)
    head = record.head
    best = int(device[eligible].max()) if eligible.any() else int(device[head])
    others = eligible.copy()
    others[head] = False
    runner: dict[str, Any] | None = None
    if others.any():
        totals = np.where(others, terms[kernels.C_TOTAL], np.inf)
        second = int(np.argmin(totals))
        runner = {
            "worker_id": record.keys[second][0],
            "dp_rank": record.keys[second][1],
            "overlap_blocks": int(device[second]),
            "cost": float(terms[kernels.C_TOTAL, second]),
            "lost_by": float(terms[kernels.C_TOTAL, second] - terms[kernels.C_TOTAL, head]),
        }
    chosen = record.keys[head]
    return {
        "selection_id": recorded.selection_id,
        "seq": recorded.seq,
        "at": recorded.at,
        "model_name": recorded.model_name,
        "routing_group": recorded.routing_group,
        "block_size": recorded.block_size,
        "prompt_blocks": recorded.isl_tokens // recorded.block_size,
        "isl_tokens": recorded.isl_tokens,
        "reserved": recorded.reserved,
        "worker_id": chosen[0],
        "dp_rank": chosen[1],
        "overlap_blocks": int(device[head]),
        "best_overlap_blocks": best,
        "avoidable_prefill_tokens": (best - int(device[head])) * recorded.block_size,
        "cost": float(terms[kernels.C_TOTAL, head]),
        "candidates": len(record.keys),
        "runner_up": runner,
    }


def worker_terms(w: WorkerExplanation, prompt_blocks: int) -> dict[str, Any]:
    """One candidate's terms, as ``/select``'s ``explain`` gives them."""
    return {
        "worker_id": w.worker[0],
        "dp_rank": w.worker[1],
        "overlap_blocks": w.overlap.device,
        "overlap": {
            "device": w.overlap.device,
            "host": w.overlap.host,
            "disk": w.overlap.disk,
            "shared": w.overlap.shared,
            "predicted": w.overlap.predicted,
        },
        "prompt_blocks": prompt_blocks,
        "raw_prefill_blocks": w.cost.raw_prefill_blocks,
        "overlap_credit_blocks": w.cost.overlap_credit_blocks,
        "predicted_credit_blocks": w.cost.predicted_credit_blocks,
        "adjusted_prefill_blocks": w.cost.adjusted_prefill_blocks,
        "prefill_cost": w.cost.prefill_cost,
        "decode_cost": w.cost.decode_blocks,
        "request_cost": w.cost.request_cost,
        "work_factor": w.cost.work_factor,
        "cost": w.cost.total,
        "prob": w.probability,
        "selected": w.selected,
        "busy": w.busy,
    }


def decision_json(recorded: Recorded) -> dict[str, Any]:
    """``GET /decisions/{selection_id}``: :func:`summary` plus every candidate's terms."""
    answer = summary(recorded)
    prompt_blocks = answer["prompt_blocks"]
    answer["temperature"] = recorded.record.temperature
    answer["workers"] = [worker_terms(w, prompt_blocks) for w in recorded.record.explain()]
    return answer


class DecisionLog:
    """``--decision-log FILE``: one :func:`summary` line per decision, appended once a second.

    Raises:
        OSError: the file cannot be opened for appending (at :meth:`open`).
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._lines: list[bytes] = []
        self._file: Any = None
        self.written = 0
        self.failed = 0

    def open(self) -> None:
        self._file = self.path.open("ab")

    def add(self, recorded: Recorded) -> None:
        self._lines.append(orjson.dumps(summary(recorded)) + b"\n")

    def flush(self) -> None:
        lines, self._lines = self._lines, []
        if not lines or self._file is None:
            return
        try:
            self._file.write(b"".join(lines))
            self._file.flush()
            self.written += len(lines)
        except OSError as exc:  # a full disk must not stop routing: counted, logged once
            self.failed += len(lines)
            if self.failed == len(lines):
                log.warning("decision log write failed path=%s error=%s", self.path, exc)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            self.flush()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def summarise(lines: Iterable[bytes]) -> dict[str, Any]:
    """What ``kvrouter decision-log FILE`` prints: over every line of a decision log, the hit rate the
    router got against the best any candidate offered, the prefill it spent on balance, and how evenly
    the decisions spread over the workers (``skew``: the busiest worker's share times the workers; 1.0 is
    even). Lines that are not a decision are counted in ``bad_lines``."""
    bad = decisions = reserved = prompt = overlap = best = avoidable = 0
    workers: dict[tuple[int, int], list[int]] = {}
    first = last = None
    for line in lines:
        if not line.strip():
            continue
        try:
            entry = orjson.loads(line)
            key = (int(entry["worker_id"]), int(entry["dp_rank"]))
            blocks, got, top = (
                int(entry["prompt_blocks"]),
                int(entry["overlap_blocks"]),
                int(entry["best_overlap_blocks"]),
            )
            spent, at = int(entry["avoidable_prefill_tokens"]), float(entry["at"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            bad += 1
            continue
        decisions += 1
        reserved += bool(entry.get("reserved"))
        prompt, overlap, best, avoidable = prompt + blocks, overlap + got, best + top, avoidable + spent
        first = at if first is None else min(first, at)
        last = at if last is None else max(last, at)
        row = workers.setdefault(key, [0, 0, 0, 0])
        row[0] += 1
        row[1] += blocks
        row[2] += got
        row[3] += spent
    top_share = max((row[0] for row in workers.values()), default=0) / decisions if decisions else 0.0
    return {
        "decisions": decisions,
        "reserved": reserved,
        "bad_lines": bad,
        "seconds": (last - first) if first is not None and last is not None else 0.0,
        "hit_rate": overlap / prompt if prompt else 0.0,
        "best_hit_rate": best / prompt if prompt else 0.0,
        "avoidable_prefill_tokens": avoidable,
        "skew": top_share * len(workers),
        "workers": [
            {
                "worker_id": key[0],
                "dp_rank": key[1],
                "decisions": row[0],
                "share": row[0] / decisions,
                "hit_rate": row[2] / row[1] if row[1] else 0.0,
                "avoidable_prefill_tokens": row[3],
            }
            for key, row in sorted(workers.items())
        ],
    }
