"""A feed for the dashboard's tests: seeded, moved by hand, and told when to fail.

Everything it returns follows from the seed and the number of ``step()`` calls, so a Pilot test or an
SVG snapshot sees the same screen on every run. Its time is a :class:`~tests.clock.FakeClock` that the
steps move, handed to the app as its clock, so ages and the stale flag are deterministic too.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from tests.clock import FakeClock
from tui.model import Candidate, Decision, LogEvent, ProbeRow, RouterGone, Shadow, Snapshot, WorkerRow

START = 1_700_000_000.0
"""The fake's epoch: a fixed wall-clock time, so ``taken_at`` looks like a real feed's."""


class FakeFeed:
    """``workers`` workers with ``dp`` ranks each; ``step()`` moves the router on by ``seconds``."""

    def __init__(self, *, seed: int = 13, workers: int = 4, dp: int = 2, temperature: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.clock = FakeClock()
        self.clock.now = START
        self.started_at = START - 3725.0
        self.temperature = temperature
        self.replicas: tuple[int, float] | None = None
        """(peers, sync lag ms) the snapshots carry, as a replica-synced router's do; None without the bridge."""
        self.shadows: dict[str, Shadow] = {}
        """What the snapshots say of shadow policies (``--shadow-policy``)."""
        self.index: tuple[int, int, int] | None = None
        """(entries, cap, evicted) the snapshots carry (``--max-index-blocks``); None where the source does not say."""
        self.gone: Exception | None = None
        """When set, ``poll`` and ``probe`` raise it."""
        self.polls = 0
        self.probes: list[tuple[int, ...]] = []
        self.closed = False
        self.totals = {"events": 1_000_000, "queries": 250_000, "decisions": 90_000}
        self.gaps = [0, 0, 0]
        self.last_gap_at: float | None = None
        self.rows = {
            (worker, rank): WorkerRow(
                worker_id=worker,
                dp_rank=rank,
                model="llama-3-8b",
                state="exact",
                cached_blocks=self.rng.randrange(2_000, 20_000),
                active_blocks=self.rng.randrange(0, 400),
                prefill_tokens=self.rng.randrange(0, 8_000),
                requests=self.rng.randrange(0, 24),
                gaps_detected=0,
                gaps_lost=0,
                last_event_at=START - self.rng.random(),
            )
            for worker in range(1, workers + 1)
            for rank in range(dp)
        }
        self.decisions: list[Decision] = []
        self.events: list[LogEvent] = [
            LogEvent(seq=worker, at=START - 60, kind="worker_registered", text=f"worker={worker} dp_ranks={dp}")
            for worker in range(1, workers + 1)
        ]

    @property
    def source(self) -> str:
        return "shm:kvrouter-4242-stats"

    @property
    def now(self) -> float:
        return self.clock.now

    def step(self, seconds: float = 0.25, *, decisions: int = 2) -> None:
        """The router's next ``seconds``: traffic, cache churn, ``decisions`` new routing decisions."""
        self.clock.now += seconds
        for name, per_second in (("events", 12_000), ("queries", 850), ("decisions", 400)):
            self.totals[name] += round(per_second * seconds * self.rng.uniform(0.7, 1.3))
        for key, row in self.rows.items():
            if row.state in ("stale", "unhealthy"):
                continue
            self.rows[key] = replace(
                row,
                cached_blocks=max(0, row.cached_blocks + self.rng.randrange(-40, 120)),
                active_blocks=max(0, row.active_blocks + self.rng.randrange(-20, 21)),
                prefill_tokens=max(0, row.prefill_tokens + self.rng.randrange(-500, 501)),
                requests=max(0, row.requests + self.rng.randrange(-2, 3)),
                last_event_at=self.now - self.rng.random() * 0.2,
            )
        for _ in range(decisions):
            self._decide()

    def mark(self, worker: int, dp: int, *, state: str | None = None, gaps: int = 0, lost: int = 0) -> None:
        """Put a worker in a state and give it gaps (logged as events, counted in the header)."""
        row = self.rows[(worker, dp)]
        self.rows[(worker, dp)] = replace(
            row,
            state=state or row.state,
            gaps_detected=row.gaps_detected + gaps,
            gaps_lost=row.gaps_lost + lost,
        )
        for index in range(gaps):
            is_lost = index < lost
            self.gaps[0] += 1
            self.gaps[2 if is_lost else 1] += 1
            self.last_gap_at = self.now
            kind = "gap_lost" if is_lost else "gap_recovered"
            self._log(kind, f"worker={worker} dp={dp} expected={100 + index} got={104 + index}")
        if state is not None:
            self._log("worker_state", f"worker={worker} dp={dp} state={state}")

    def offload(self, worker: int, dp: int, *, host: int = 0, disk: int = 0, shared: int = 0) -> None:
        """Give a worker blocks in the slower tiers (none has any until told: the seeded screens stay as
        they were); the steps leave them as set."""
        self.rows[(worker, dp)] = replace(self.rows[(worker, dp)], cached_offloaded=(host, disk, shared))

    def _log(self, kind: str, text: str) -> None:
        self.events.append(LogEvent(seq=len(self.events) + 1, at=self.now, kind=kind, text=text))

    def _decide(self) -> None:
        prompt_blocks = self.rng.randrange(8, 64)
        candidates = []
        for (worker, rank), row in self.rows.items():
            if row.state == "unhealthy":
                continue
            overlap = self.rng.randrange(0, prompt_blocks + 1)
            prefill = float(prompt_blocks - overlap)
            request = row.requests * 0.5
            total = prefill + row.active_blocks / 16 + request
            candidates.append((total, worker, rank, overlap, prefill, row.active_blocks // 16, request))
        best = min(candidates)
        explained = tuple(
            Candidate(
                worker_id=worker,
                dp_rank=rank,
                overlap_blocks=overlap,
                prefill_cost=prefill,
                decode_blocks=decode,
                request_cost=request,
                total=total,
                probability=1.0 if (worker, rank) == best[1:3] else 0.0,
                selected=(worker, rank) == best[1:3],
                busy=False,
            )
            for total, worker, rank, overlap, prefill, decode, request in candidates
        )
        if self.temperature > 0:
            weights = [2.0 ** (-c.total / self.temperature / 10) for c in explained]
            norm = sum(weights)
            explained = tuple(replace(c, probability=w / norm) for c, w in zip(explained, weights, strict=True))
        self.decisions.append(
            Decision(
                seq=len(self.decisions) + 1,
                at=self.now,
                worker_id=best[1],
                dp_rank=best[2],
                overlap_blocks=best[3],
                prompt_blocks=prompt_blocks,
                cost=best[0],
                decision_us=round(self.rng.uniform(150, 900)),
                candidates=explained,
            )
        )

    def poll(self) -> Snapshot:
        self.polls += 1
        if self.gone is not None:
            raise self.gone
        return Snapshot(
            source=self.source,
            taken_at=self.now,
            started_at=self.started_at,
            shards=4,
            shards_up=4,
            shards_recovering=0,
            events_total=self.totals["events"],
            queries_total=self.totals["queries"],
            decisions_total=self.totals["decisions"],
            route_p50_us=210.0,
            route_p99_us=900.0,
            gaps_detected=self.gaps[0],
            gaps_recovered=self.gaps[1],
            gaps_lost=self.gaps[2],
            last_gap_at=self.last_gap_at,
            weights={"credit": 1.0, "scale": 1.0, "T": self.temperature},
            workers=tuple(self.rows.values()),
            decisions=tuple(self.decisions[-64:]),
            events=tuple(self.events[-64:]),
            index_lag_ms=4.0,
            replicas=None if self.replicas is None else self.replicas[0],
            sync_lag_ms=None if self.replicas is None else self.replicas[1],
            extra={"model": "llama-3-8b"},
            shadows=dict(self.shadows),
            index_blocks=None if self.index is None else self.index[0],
            index_blocks_cap=0 if self.index is None else self.index[1],
            index_evicted=0 if self.index is None else self.index[2],
        )

    def probe(self, tokens: Sequence[int]) -> tuple[ProbeRow, ...]:
        """The prompt's overlap on a worker: a share of its blocks that grows with the worker's cache."""
        if self.gone is not None:
            raise self.gone
        self.probes.append(tuple(tokens))
        blocks = max(1, len(tokens) // 16)
        rows = []
        for (worker, rank), row in self.rows.items():
            overlap = min(blocks, row.cached_blocks * blocks // 20_000)
            rows.append(ProbeRow(worker, rank, overlap, float(blocks - overlap) + row.requests * 0.5, False))
        return tuple(rows)

    def close(self) -> None:
        self.closed = True


def gone() -> RouterGone:
    return RouterGone("no kvrouter at shm:kvrouter-4242-stats (segment missing)")
