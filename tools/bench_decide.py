"""Time one routing decision (``Router.select``) against the oracle, the index walk inside it and the reference's walk.

    python tools/bench_decide.py [--quick] [--workers N ...] [--json FILE]

For 16, 256, 1,024 and 4,096 workers, each on a fresh ``Engine(shards=1)``: 16 workers (all of them at 16) hold
four cached sequences each of a 32-block shared system prompt and 480 blocks of their own; every other
worker holds one unrelated 32-block chain. Every worker carries four booked requests of 64 blocks (the
16 holders' share the system prompt, the others' are unrelated), so the load terms and the slot
manager's active-block walk have work. Queries are 64 and 512 local hashes as ``uint64`` arrays (the
array interface: what a tokenizer's array, hashed once, gives): a holder's sequence cut at a random
depth, padded with novel blocks. Every decision is made under ``KVROUTER_CONFIG`` at temperature 0,
without booking (the load stays as built) and without ``explain``.

Figures per worker count and prompt length, each query timed alone and the sides whose ratios are
reported interleaved so they share the machine's noise: the new path (``Router.select`` on the engine),
the index walk alone (``Engine.find_matches`` from the array), and the oracle (``ReferenceRouter.select``,
given the list, as it was called) on as many queries as fit ``--oracle-seconds`` (it takes milliseconds
at 4,096 workers). Then, in a pass of its own, the reference's ``RadixTree.find_matches`` (Dynamo's Rust
index, loaded with the same events as ``tools/bench_index.py`` loads it) on the same blocks as a list:
it hands each query to a thread of its own, which wakes the other core and evicts the caller's cache
lines, and interleaved it roughly doubled the times of the sides beside it while the oracle, timed
apart, kept its own (a 16-worker decision measured 28 µs beside it, 13 µs without). Correctness: a
fresh pair of routers with one seed decides the first queries; every choice must agree, or the run
fails.

``ratios`` (internal: the reference decides only inside its Rust services): ``speedup`` = oracle ÷ new,
p50, 16 workers, 64 blocks (goal ≥ 20); ``overhead`` = walk alone ÷ whole decision, same case (goal
≥ 0.5: a decision costs at most twice the walk it contains); ``scale`` = 16-worker ÷ 4,096-worker
decision p50 at 64 blocks (below 1 means slower at 4,096; reported, no goal).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from time import perf_counter, perf_counter_ns
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from bench_index import _machine, _percentile, _reference_tree, leftovers

from kvrouter.engine import Engine
from kvrouter.events.codecs import dynamo as dynamo_codec
from kvrouter.events.model import EngineHash, LocalHash, Stored, StoredBlock, WorkerKey
from kvrouter.hashing import sequence_hashes
from kvrouter.routing import ReferenceRouter, ReferenceSlotManager, Router, SlotManager
from kvrouter.routing.config import KVROUTER_CONFIG

WORKER_COUNTS: Final = (16, 256, 1024, 4096)
FROZEN_AT: Final = 1000.0
"""The clock every router and slot manager of the run reads (seconds)."""
PROMPT_BLOCKS: Final = (64, 512)
HOLDERS: Final = 16
"""Workers holding cached sequences of the prompts; every other worker holds nothing of them."""
SYSTEM_BLOCKS: Final = 32
SEQUENCES_PER_HOLDER: Final = 4
OTHER_CHAIN_BLOCKS: Final = 32
BOOKED_PER_WORKER: Final = 4
BOOKED_BLOCKS: Final = 64
BLOCK_SIZE: Final = 16
QUERIES: Final = 2000
ORACLE_SECONDS: Final = 4.0
CHECKS: Final = 100
"""Decisions of a fresh (new, oracle) pair compared per worker count and length."""
WARM: Final = 30
QUICK: Final = {"workers": [16, 256], "queries": 200, "oracle_seconds": 0.5, "checks": 30}
ID_STRIDE: Final = 100_000
"""Worker ids of one worker count start at a multiple of this."""
FLUSH_TIMEOUT_S: Final = 300.0


def chain(rng: random.Random, blocks: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(blocks)]


def stored(worker_id: int, local: list[int]) -> Stored:
    seq = sequence_hashes(local)
    blocks = tuple(StoredBlock(EngineHash(s), LocalHash(h)) for s, h in zip(seq, local, strict=True))
    return Stored(worker_id=worker_id, parent=None, blocks=blocks)


class Fleet:
    """One worker count's index contents (engine and reference tree), load (both slot managers) and queries."""

    def __init__(self, engine: Engine, make_tree: Callable[[], Any], workers: int, queries: int, seed: int) -> None:
        rng = random.Random(seed * 7919 + workers)
        base = workers * ID_STRIDE
        self.ids = [base + i for i in range(workers)]
        self.keys: tuple[WorkerKey, ...] = tuple((w, 0) for w in self.ids)
        holders = self.ids[: min(HOLDERS, workers)]
        system = chain(rng, SYSTEM_BLOCKS)
        self.tree = make_tree()
        encoder = dynamo_codec.Encoder()
        sequences: list[list[int]] = []
        for worker_id in self.ids:
            if worker_id in holders:
                mine = [system + chain(rng, max(PROMPT_BLOCKS) - SYSTEM_BLOCKS) for _ in range(SEQUENCES_PER_HOLDER)]
                sequences.extend(mine)
            else:
                mine = [chain(rng, OTHER_CHAIN_BLOCKS)]
            for local in mine:
                event = stored(worker_id, local)
                engine.apply_event(worker_id, event)
                self.tree.apply_event(worker_id, encoder.encode_event(event))
        engine.flush(timeout=FLUSH_TIMEOUT_S)
        self.new_slots = SlotManager(block_size=BLOCK_SIZE, clock=frozen_clock)
        self.oracle_slots = ReferenceSlotManager(block_size=BLOCK_SIZE, clock=frozen_clock)
        n = 0
        for worker_id in self.ids:
            for _ in range(BOOKED_PER_WORKER):
                held = worker_id in holders
                local = rng.choice(sequences)[:BOOKED_BLOCKS] if held else chain(rng, BOOKED_BLOCKS)
                seq = sequence_hashes(local)
                for slots in (self.new_slots, self.oracle_slots):
                    slots.add_request(f"b{n}", (worker_id, 0), seq, BOOKED_BLOCKS * BLOCK_SIZE, 0)
                n += 1
        self.queries: dict[int, list[list[int]]] = {}
        for length in PROMPT_BLOCKS:
            made = []
            for _ in range(queries):
                base_seq = rng.choice(sequences)[: rng.randrange(1, length + 1)]
                made.append(base_seq + chain(rng, length - len(base_seq)))
            self.queries[length] = made
        self.engine = engine


def frozen_clock() -> float:
    """One instant for both routers and slot managers: the recent-prefill work factor decays with the
    clock, and two clocks read microseconds apart would make equal decisions differ in the last bits."""
    return FROZEN_AT


def stats(samples: list[float]) -> dict[str, float]:
    return {
        "p50_us": statistics.median(samples),
        "p99_us": _percentile(samples, 0.99),
        "per_s": 1e6 / statistics.fmean(samples),
        "samples": len(samples),
    }


def time_length(fleet: Fleet, length: int, args: argparse.Namespace) -> dict[str, Any]:
    engine = fleet.engine
    queries = fleet.queries[length]
    arrays: list[npt.NDArray[np.uint64]] = [np.array(q, dtype=np.uint64) for q in queries]
    isl = length * BLOCK_SIZE
    router = Router(KVROUTER_CONFIG, block_size=BLOCK_SIZE, seed=args.seed, slots=fleet.new_slots, clock=frozen_clock)
    oracle = ReferenceRouter(
        KVROUTER_CONFIG, block_size=BLOCK_SIZE, seed=args.seed, slots=fleet.oracle_slots, clock=frozen_clock
    )
    fleet_keys = fleet.keys
    select = router.select
    find: Callable[[Any], Any] = engine.find_matches  # takes the array as it is
    reference = fleet.tree.find_matches
    for i in range(min(WARM, len(queries))):
        select(engine, fleet_keys, local_hashes=arrays[i], isl_tokens=isl)
        find(arrays[i])
        reference(queries[i])
        oracle.select(engine, fleet_keys, local_hashes=queries[i], isl_tokens=isl)
    new: list[float] = []
    walk: list[float] = []
    slow: list[float] = []
    deadline = perf_counter() + args.oracle_seconds
    for i, (query, local) in enumerate(zip(queries, arrays, strict=True)):  # hot path: interleaved sides
        ask_oracle = perf_counter() < deadline or len(slow) < 3
        for side in (0, 1, 2) if i % 2 else (2, 1, 0):
            start = perf_counter_ns()
            if side == 0:
                select(engine, fleet_keys, local_hashes=local, isl_tokens=isl)
            elif side == 1:
                find(local)
            elif ask_oracle:
                oracle.select(engine, fleet_keys, local_hashes=query, isl_tokens=isl)
            else:
                continue
            (new, walk, slow)[side].append((perf_counter_ns() - start) / 1000)
    theirs: list[float] = []
    for query in queries:  # apart: its thread hand-off would add its noise to the sides compared above
        start = perf_counter_ns()
        reference(query)
        theirs.append((perf_counter_ns() - start) / 1000)
    fresh = Router(
        KVROUTER_CONFIG, block_size=BLOCK_SIZE, seed=args.seed + 1, slots=fleet.new_slots, clock=frozen_clock
    )
    fresh_oracle = ReferenceRouter(
        KVROUTER_CONFIG, block_size=BLOCK_SIZE, seed=args.seed + 1, slots=fleet.oracle_slots, clock=frozen_clock
    )
    checked = min(args.checks, len(queries))
    disagreements = 0
    for query, local in list(zip(queries, arrays, strict=True))[:checked]:
        mine = fresh.select(engine, fleet_keys, local_hashes=local, isl_tokens=isl)
        expected = fresh_oracle.select(engine, fleet_keys, local_hashes=query, isl_tokens=isl)
        if (mine.worker, mine.cost.total) != (expected.worker, expected.cost.total):
            disagreements += 1
    return {
        "new": stats(new),
        "oracle": stats(slow),
        "walk": stats(walk),
        "reference_find_matches": stats(theirs),
        "checked": checked,
        "disagreements": disagreements,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    make_tree = _reference_tree()
    configs: dict[str, Any] = {}
    for workers in args.workers:
        with Engine(shards=1) as engine:  # a fresh engine per fleet: a shard has 4,096 worker rows
            fleet = Fleet(engine, make_tree, workers, args.queries, args.seed)
            configs[str(workers)] = {str(length): time_length(fleet, length, args) for length in PROMPT_BLOCKS}
    first, last = str(min(args.workers)), str(max(args.workers))
    base = configs[first]["64"]
    return {
        "configs": configs,
        "ratios": {
            "speedup": base["oracle"]["p50_us"] / base["new"]["p50_us"],
            "overhead": base["walk"]["p50_us"] / base["new"]["p50_us"],
            "scale": base["new"]["p50_us"] / configs[last]["64"]["new"]["p50_us"],
        },
        "ratio_basis": f"p50 at 64 blocks; speedup and overhead at {first} workers, scale {first} / {last} workers",
        "goals": {"speedup": 20.0, "overhead": 0.5},
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"{'workers':>7} {'blocks':>6} | {'side':<24} {'p50 µs':>9} {'p99 µs':>9} {'per s':>9} {'n':>5}")
    names = {
        "new": "Router.select",
        "oracle": "ReferenceRouter.select",
        "walk": "find_matches (array)",
        "reference_find_matches": "RadixTree.find_matches",
    }
    for workers, lengths in result["configs"].items():
        for length, row in lengths.items():
            for side, label in names.items():
                s = row[side]
                print(
                    f"{workers:>7} {length:>6} | {label:<24} {s['p50_us']:>9.1f} {s['p99_us']:>9.1f} "
                    f"{s['per_s']:>9.0f} {s['samples']:>5}"
                )
            print(
                f"{'':>7} {'':>6} | agreement with the oracle: {row['checked'] - row['disagreements']}/{row['checked']}"
            )
    ratios = result["ratios"]
    goals = result["goals"]
    print(
        f"ratios ({result['ratio_basis']}): speedup {ratios['speedup']:.1f} (goal >= {goals['speedup']:.0f}), "
        f"overhead {ratios['overhead']:.2f} (goal >= {goals['overhead']}), scale {ratios['scale']:.2f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, nargs="+", default=list(WORKER_COUNTS), help="worker counts")
    parser.add_argument("--queries", type=int, default=QUERIES, help="queries per worker count and length")
    parser.add_argument("--oracle-seconds", type=float, default=ORACLE_SECONDS, help="oracle budget per case [s]")
    parser.add_argument("--checks", type=int, default=CHECKS, help="decisions compared with the oracle per case")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--quick", action="store_true", help=f"a small run, for tests: {QUICK} unless given")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:  # the small run's values, unless given on the command line
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    before = _machine()
    result = run(args)
    print_table(result)
    after = _machine()
    print(
        f"machine: {after['cpu_count']} CPUs; load average (1/5/15 min) {before['loadavg']} before, "
        f"{after['loadavg']} after; python {sys.version.split()[0]}; {args.queries} queries, seed {args.seed}"
    )
    left = leftovers()
    print(f"shm: {'clean' if not left else 'left behind: ' + ', '.join(left)}")
    disagreements = sum(row["disagreements"] for lengths in result["configs"].values() for row in lengths.values())
    if args.json:
        figures = {
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "machine": {"before": before, "after": after},
            **result,
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if disagreements or left else 0


if __name__ == "__main__":
    raise SystemExit(main())
