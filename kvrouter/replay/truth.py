"""The truth check: does the router's index say what the engines' own caches say, during a drill and after it.

**Probes, during the drill.** A fixed set of prompts is asked every :data:`PROBE_INTERVAL_S` (100 ms,
the issue's figure): first every engine (``POST /overlap`` on each mock: how many leading blocks of each
probe its cache holds, computed by its engine thread between iterations), then the router
(``POST /query`` per probe: matched tokens per worker; with replicas, each replica in turn, a round
each). A router answer is **wrong** when, for some worker, the overlap it reports equals none of that
engine's answers from the last :data:`WINDOW_S` (250 ms) before the query up to the engine sample taken
right after it (the query fell between two samples, so either may be its truth). Workers are judged one
by one: the engines are sampled one after another, not at one instant, so a joint state would be an
artefact of the sampling order. Rejected: polling ``GET /cache`` (every block with its path of local
hashes: megabytes a second at 10 Hz).

**Equality, at the end.** Once the load has stopped and the engines are idle, :func:`index_equals_engines`
compares, per engine, its ``/cache`` with the index: every cached block is found at its full depth by
``POST /query_by_hash`` along its path of local hashes (one query per leaf path: a path found to its
end holds every block on it; the engines evict a sequence's tail before its prefix, so a cached block's
parent is cached), and the index's ``cached_blocks`` for the worker equals the engine's block count
(so the index holds nothing the engine dropped). Together: the same set of blocks.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..client import ApiError
from .stack import Stack

__all__ = ["PROBE_INTERVAL_S", "WINDOW_S", "ProbeLog", "index_equals_engines", "probe"]

log = logging.getLogger(__name__)

PROBE_INTERVAL_S: Final = 0.1
"""How often the probes are asked (the issue: every 100 ms)."""

WINDOW_S: Final = 0.25
"""How old an engine state may be and still make a router answer right (the issue: 250 ms)."""

QUERY_CONCURRENCY: Final = 8


@dataclass(slots=True)
class ProbeLog:
    """Engine samples and router answers of one drill, in time order."""

    truth: dict[int, list[tuple[float, list[int]]]] = field(default_factory=dict)
    """Worker -> (monotonic time the sample came back, overlap in blocks per probe)."""
    answers: list[tuple[float, int, dict[int, int]]] = field(default_factory=list)
    """(time the answer came back, probe index, worker -> overlap in blocks; absent = 0)."""
    departed: dict[int, float] = field(default_factory=dict)
    """Workers unregistered during the run -> when: from then on, holding nothing is right for them too."""
    failed: int = 0
    """Probe rounds that could not be completed (an engine or the router did not answer)."""

    def wrong(self, since: float = 0.0) -> list[float]:
        """Times of the router answers after ``since`` that match no recent state of some engine."""
        out = []
        times_of = {worker: [t for t, _ in samples] for worker, samples in self.truth.items()}
        for at, probe_index, overlaps in self.answers:
            if at < since:
                continue
            for worker, samples in self.truth.items():
                times = times_of[worker]
                lo = bisect.bisect_left(times, at - WINDOW_S)
                hi = bisect.bisect_right(times, at) + 1  # and the first sample after the answer
                allowed = {values[probe_index] for _, values in samples[lo:hi]}
                if worker in self.departed and at >= self.departed[worker]:
                    allowed.add(0)
                if allowed and overlaps.get(worker, 0) not in allowed:
                    out.append(at)
                    break
        return out


async def probe(stack: Stack, prompts: Sequence[list[int]], log_to: ProbeLog, stop: asyncio.Event) -> None:
    """Ask the engines, then the router, every :data:`PROBE_INTERVAL_S` until ``stop`` is set."""
    block = stack.block_size

    async def engine(mock_http: str, worker: int) -> None:
        status, answer = await stack.call("POST", mock_http + "/overlap", {"prompts": list(prompts)})
        if status != 200:
            raise ConnectionError(f"{mock_http}/overlap answered {status}")
        log_to.truth.setdefault(worker, []).append((time.monotonic(), answer["ranks"][0]["overlaps"]))

    async def router(base: str, index: int, prompt: list[int]) -> None:
        try:
            answer = await stack.client(base).query(stack.model_name, prompt)
        except ApiError as exc:
            raise ConnectionError(f"/query answered {exc.status}") from exc
        scores = answer["scores"]
        overlaps = {int(worker): ranks.get("0", 0) // block for worker, ranks in scores.items()}
        log_to.answers.append((time.monotonic(), index, overlaps))

    rounds = 0
    while not stop.is_set():
        started = time.monotonic()
        urls = stack.urls
        base = urls[rounds % len(urls)]  # replicas: each in turn
        rounds += 1
        try:
            await asyncio.gather(*(engine(mock.http, mock.worker_id) for mock in stack.mocks))
            await asyncio.gather(*(router(base, i, prompt) for i, prompt in enumerate(prompts)))
        except (OSError, TimeoutError, KeyError, IndexError) as exc:
            if not log_to.failed:  # a router draining (router-restart) closes a probe's connection mid-request
                log.info("probe round failed error=%r (logged once)", exc)
            log_to.failed += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(PROBE_INTERVAL_S - (time.monotonic() - started), 0.0))
    # one last engine sample, so the last answers have a sample after them
    try:
        await asyncio.gather(*(engine(mock.http, mock.worker_id) for mock in stack.mocks))
    except (OSError, TimeoutError, KeyError, IndexError):
        log_to.failed += 1


async def index_equals_engines(stack: Stack, url: str | None = None) -> tuple[bool, str]:
    """Whether the index of the router at ``url`` (default: the stack's) holds exactly every engine's cached
    blocks (see the module docstring).

    Returns:
        (equal, what differs: the first few mismatches, empty when equal).
    """
    block = stack.block_size
    base = stack.url if url is None else url
    rows = await stack.workers(base)
    members = {mock.worker_id for mock in stack.mocks}
    problems: list[str] = [
        f"the router still lists worker {row['instance_id']}, which left" for row in rows
        if int(row["instance_id"]) not in members
    ]  # fmt: skip
    listeners = {int(row["instance_id"]): row["listeners"].get("0") for row in rows}
    indexed = {worker: -1 if row is None else row.get("cached_blocks", -1) for worker, row in listeners.items()}
    leaves: dict[tuple[int, ...], set[int]] = {}
    for mock in stack.mocks:
        status, cache = await stack.call("GET", mock.http + "/cache")
        if status != 200:
            return False, f"{mock.http}/cache answered {status}"
        blocks: list[dict[str, Any]] = cache["ranks"][0]["blocks"]
        if indexed.get(mock.worker_id) != len(blocks):
            held = indexed.get(mock.worker_id)
            problems.append(f"worker {mock.worker_id}: the engine holds {len(blocks)} blocks, the index {held}")
        parents = {b["parent"] for b in blocks}
        for b in blocks:
            if b["engine_hash"] not in parents:
                leaves.setdefault(tuple(b["local_hashes"]), set()).add(mock.worker_id)
    limit = asyncio.Semaphore(QUERY_CONCURRENCY)

    async def check(path: tuple[int, ...], holders: set[int]) -> None:
        async with limit:
            try:
                answer = await stack.client(base).query_by_hash(stack.model_name, list(path))
            except ApiError as exc:
                problems.append(f"/query_by_hash answered {exc.status}: {exc.message[:120]}")
                return
        scores = answer["scores"]
        strangers = [worker for worker in scores if int(worker) not in members]
        if strangers:
            problems.append(f"a cached path is indexed for worker(s) {', '.join(strangers)}, which left")
        for worker in holders:
            found = scores.get(str(worker), {}).get("0", 0) // block
            if found != len(path):
                problems.append(f"worker {worker}: a cached path of {len(path)} blocks is indexed to depth {found}")

    await asyncio.gather(*(check(path, holders) for path, holders in leaves.items()))
    return not problems, "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
