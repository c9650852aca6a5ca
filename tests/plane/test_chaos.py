"""Chaos: mock engines serve a workload while the test drops event batches on the wire, restarts an engine,
SIGKILLs an applier, and removes and re-adds a worker. Once traffic stops, the router's index equals the
truth (every engine's own cache, read from the engine) and every gap is accounted recovered or lost.

Everything is real: ``kvrouter mock-worker`` processes publishing vLLM frames (with their replay sockets)
and kvrouter-format frames (with their local indexers), the engine's applier processes subscribing to
them, shared memory read back by this process. A short version of the drills ``kvrouter replay`` runs.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvrouter import Engine
from kvrouter.plane import WorkerSpec
from tests.conftest import Worker, free_port

BLOCK = 16
PREFIXES = 6
"""Shared system prompts: requests share and branch, engines evict under pressure."""


def prompts(rng: random.Random, count: int) -> list[list[int]]:
    shared = [[rng.randrange(1, 30_000) for _ in range(BLOCK * rng.randint(1, 4))] for _ in range(PREFIXES)]
    return [rng.choice(shared) + [rng.randrange(1, 30_000) for _ in range(rng.randint(8, 80))] for _ in range(count)]


def burst(workers: list[Worker], rng: random.Random, count: int) -> None:
    """``count`` completions spread over the workers (and their dp ranks), all answered."""
    jobs = [(rng.choice(workers), prompt) for prompt in prompts(rng, count)]
    with ThreadPoolExecutor(8) as pool:
        for answer in pool.map(lambda job: job[0].complete(job[1], max_tokens=rng.randint(1, 24)), jobs):
            assert answer["usage"]["prompt_tokens"] > 0


def truth(cache: dict[str, Any]) -> dict[tuple[int, int], set[tuple[int, ...]]]:
    """Per (worker, dp_rank), the local-hash path of every block the engine holds."""
    return {
        (cache["worker_id"], rank["dp_rank"]): {tuple(b["local_hashes"]) for b in rank["blocks"]}
        for rank in cache["ranks"]
    }


def depth(held: set[tuple[int, ...]], path: tuple[int, ...]) -> int:
    """Leading blocks of ``path`` held, each with every block before it: the contract's overlap."""
    n = 0
    while n < len(path) and path[: n + 1] in held:
        n += 1
    return n


def last_id(cache: dict[str, Any], rank: int) -> int | None:
    entry = cache["ranks"][rank]
    value = entry.get("last_seq", entry.get("last_event_id"))
    return None if value is None else int(value)


def lagging(engine: Engine, workers: list[Worker]) -> list[str]:
    """Every (worker, dp_rank) whose row is not at its engine's last id, or has a gap without an outcome yet
    (a gap's count is written after the batches that close it), with both sides."""
    rows = engine.workers()
    behind = []
    for worker in workers:
        cache = worker.cache()
        for rank in range(len(cache["ranks"])):
            key = (cache["worker_id"], rank)
            row = rows.get(key)
            if (
                row is None
                or row.state == "restoring"
                or row.last_id != last_id(cache, rank)
                or row.gaps_detected != row.gaps_recovered + row.gaps_lost
            ):
                behind.append(f"{key}: engine at {last_id(cache, rank)}, router {row}")
    return behind


def spec(worker: Worker, worker_id: int, fmt: str, dp: int) -> WorkerSpec:
    if fmt == "kvrouter":
        return WorkerSpec(
            worker_id, worker.events[0], format="kvrouter", query_endpoint=worker.replay[0], block_size=BLOCK
        )
    ranks = tuple(range(dp))
    return WorkerSpec(worker_id, worker.events[0], replay_endpoint=worker.replay[0], dp_ranks=ranks, block_size=BLOCK)


def replace(engine: Engine, worker: WorkerSpec) -> None:
    """Worker churn: the worker leaves the index, then joins again and is restored from its replay socket."""
    engine.remove_worker(worker.worker_id)
    engine.add_worker(worker)


def test_chaos_ends_with_the_index_equal_to_every_engines_cache(start_worker, wait_until):
    rng = random.Random(20261130)
    layout = [(1, "vllm", 1), (2, "vllm", 2), (3, "kvrouter", 1)]
    workers = []
    for wid, fmt, dp in layout:
        port = free_port(2 * dp)  # rank r on port + r, as the registry's rule says; replay after
        options = ("--format", fmt, "--dp-size", str(dp), "--num-gpu-blocks", "96", "--block-size", str(BLOCK))
        workers.append(start_worker(*options, events_port=port, replay_port=port + dp, worker_id=wid))
    specs = [spec(worker, wid, fmt, dp) for worker, (wid, fmt, dp) in zip(workers, layout, strict=True)]
    with Engine(shards=2) as engine:
        for worker_spec in specs:
            engine.add_worker(worker_spec)
        burst(workers, rng, 30)
        drop = [
            lambda worker=worker: worker.call("POST", "/faults", {"drop_batches": rng.randint(1, 4)})
            for worker in workers
        ]
        drills: list[Callable[[], Any]] = [
            *drop,
            lambda: workers[0].call("POST", "/restart", {}),
            lambda: workers[2].call("POST", "/restart", {}),
            lambda: os.kill(engine.stats()[rng.randrange(2)].pid, signal.SIGKILL),
            lambda: replace(engine, specs[1]),
        ]
        for round_ in range(12):
            drills[round_ % len(drills)]()
            burst(workers, rng, 20)
        burst(workers, rng, 10)  # traffic after the last fault, so every drop shows up as a gap
        deadline = time.monotonic() + 60
        while (behind := lagging(engine, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not behind, behind
        wait_until(lambda: all(s.status == "up" for s in engine.stats()), what="every shard up")
        rows = engine.workers()
        for worker in workers:
            for key, held in truth(worker.cache()).items():
                row = rows[key]
                assert row.gaps_detected == row.gaps_recovered + row.gaps_lost, (key, row)
                assert row.state == "exact", (key, row)
                assert row.cached_blocks == len(held), (key, row)
                for path in held:
                    assert engine.find_matches(list(path)).get(key, 0) == depth(held, path), (key, path)
        assert sum(row.gaps_recovered for row in rows.values()) > 0
        assert sum(row.restarts for row in rows.values()) >= 2
        assert sum(s.restarts for s in engine.stats()) == 1  # the one SIGKILL drill
