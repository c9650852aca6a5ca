"""Time kvrouter's shared-memory index engine against Dynamo's ``RadixTree`` on one seeded workload, in one run.

    python tools/bench_index.py [--quick] [--repeat N] [--json FILE]
    python tools/bench_index.py --capacity [--capacity-blocks N] [--json FILE]

The workload follows the reference's own microbenchmark (``spec/shm-engine.md`` §7.2): prefix groups
of 16-64 random local hashes, sequences of 32-128 blocks (a group's prefix and a unique suffix), each
sequence one Stored event (no parent) to a random worker, for 16 and 256 workers. A block's engine
hash is its router sequence hash (``hashing.sequence_hashes``), so both sides key blocks the same way
(spec §1). kvrouter gets pre-encoded kvrouter msgpack batches through ``Engine.apply_payload``; the
reference gets pre-built JSON through ``RadixTree.apply_event``. Queries are 64 and 512 blocks of
local hashes as a Python list, half a stored sequence (padded with novel blocks), half diverging from
one at a uniformly random block.

Figures, for 1, 2 and 4 shards (applier processes; workers given to shards round-robin by the engine):
- apply: blocks ÷ (all ``apply_payload`` calls + the final ``flush``), each repeat into a fresh engine;
  the reference's repeats (a fresh tree each, timed up to a query that waits for its thread) alternate
  with the 1-shard ones. Median over ``--repeat``.
- find_matches p50/p99 through ``Engine.find_matches``, each query timed alone and alternating with
  the reference's answer to the same query, so both share the machine's noise; every answer is
  compared with the reference's, and a mismatch fails the run. A second pass gives the same queries
  as ``uint64`` arrays (what a tokenizer's array saves: the list conversion). Alternating costs
  kvrouter a few µs a query (the reference's thread wakes the other core and evicts cache lines), so
  the tight loop of a reader process (queries/s) is the kinder figure and shown beside it.
- queries/s per reader process: 1, then 2 forked processes attached by handle, started together at a
  barrier, each counting queries over a fixed wall time. ``two_readers_scaling`` is the aggregate of
  two over one; it cannot reach 2 while anything else runs on a 2-core machine (the load line).
- bytes per block: the shard segments' sizes in ``/dev/shm`` ÷ the workload's distinct blocks; beside it
  the appliers' private maps (growth of their anonymous memory since the engine started).
- an in-process ``ShardWriter`` apply rate on the same batches, labelled: the applier's own work
  without processes or sockets (it also compiles the kernels before the engine forks).

The ``ratios`` are > 1 when kvrouter is better (times: reference ÷ kvrouter; rates: kvrouter ÷
reference), from the 1-shard figures, the lower of the worker counts (``ratio_basis`` in the JSON);
``ratios_by_config`` has every worker count and shard count.

``--capacity`` loads ``--capacity-blocks`` distinct blocks (10 M by default) as chains from 1024 workers
(round-robin) and reports bytes per cached block (shard segments ÷ distinct blocks), the appliers' private
maps and the apply rate (sends and a flush per chunk; encoding is not timed), without the reference.
Between chunks it predicts which tables the next chunk grows and stops early, saying so, when that
growth might not fit the machine's free memory or ``/dev/shm``: a benchmark must not take the machine down.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from time import perf_counter, perf_counter_ns
from typing import Any, Final

import numpy as np

from kvrouter.engine import Engine, ReaderHandle, attach
from kvrouter.events.codecs import dynamo as dynamo_codec
from kvrouter.events.codecs.kvrouter import Decoder, Encoder
from kvrouter.events.model import EngineHash, EventBatch, LocalHash, Stored, StoredBlock, WorkerKey
from kvrouter.hashing import sequence_hashes, sequence_hashes_array
from kvrouter.index.layout import H_CAPACITY, H_LIVE, H_USED, MAX_LOAD, SHM_DIR, Control, Segment, control_name
from kvrouter.index.reader import IndexReader
from kvrouter.index.writer import ShardWriter

WORKER_COUNTS: Final = (16, 256)
SHARD_COUNTS: Final = (1, 2, 4)
QUERY_LENGTHS: Final = (64, 512)
PREFIX_GROUPS: Final = 200
PREFIX_BLOCKS: Final = (16, 64)
SEQUENCE_BLOCKS: Final = (32, 128)
"""The reference microbenchmark's shape (``spec/shm-engine.md`` §7.2): 200 groups, prefixes of U[16, 64]
blocks, sequences of U[32, 128] blocks with at least one unique block."""
SEQUENCES: Final = 10_000
QUERIES: Final = 2000
WINDOW_S: Final = 2.0
"""Wall time each reader process counts queries over [s]."""
CORRECTNESS_MIN: Final = 200
"""At least this many answers per query length are compared with the reference's."""
WARM_QUERIES: Final = 50
CHECK_EVERY: Final = 8
"""A reader process looks at the clock once per this many queries."""
FLUSH_TIMEOUT_S: Final = 600.0
READER_TIMEOUT_S: Final = 120.0
"""Longest a reader process may take beyond its window before the run is failed [s]."""
QUICK: Final = {"sequences": 500, "queries": 200, "window": 0.3, "repeat": 1}

GOALS: Final = {"find_matches_64": 5.0, "find_matches_512": 2.0, "apply": 3.0, "two_readers_scaling": 1.8}
"""The issue's moonshots, each a ratio measured in one run."""

CAPACITY_BLOCKS: Final = 10_000_000
CAPACITY_WORKERS: Final = 1024
CAPACITY_SHARDS: Final = 4
CHAIN_BLOCKS: Final = 128
EVENT_BLOCKS: Final = 64
"""Capacity chains: 128 distinct blocks each, sent as Stored events of 64 (the second names the first's
last block as parent), as the shm workload sends its documents (spec §1)."""
CAPACITY_PROBES: Final = 100
"""Chains queried after the capacity load, each expected whole for its worker."""
CHUNK_BLOCKS: Final = 500_000
"""The capacity load flushes after this many blocks and checks memory before the next chunk."""
GROWTH_FACTOR: Final = 4
"""A growing table (and an applier's maps) may take up to 4x its size: the writer sizes the new one for a
quarter load rounded up to a power of two (``index/writer.py`` ``_capacity_for``)."""
MEMORY_MARGIN: Final = 2 << 30
"""Free memory kept beyond what a growth of every shard at once could take [bytes]."""


# -- workload -----------------------------------------------------------------------------------


@dataclass
class Workload:
    """One worker count's events, both encodings, and the queries."""

    workers: int
    events: list[tuple[WorkerKey, bytes]]
    """kvrouter msgpack batches, one per sequence, with the worker that sends it."""
    reference_events: list[tuple[int, bytes]]
    """The same events as the reference's ``KvCacheEvent`` JSON, with the worker id."""
    blocks: int
    """Block-applies: the sum of every event's blocks."""
    distinct_blocks: int
    queries: dict[int, list[list[int]]]
    """Per query length, local hashes as the caller has them: a list."""


def build_workload(workers: int, sequences: int, queries: int, seed: int) -> Workload:
    rng = random.Random(seed * 1_000_003 + workers)
    groups = [[rng.getrandbits(64) for _ in range(rng.randint(*PREFIX_BLOCKS))] for _ in range(PREFIX_GROUPS)]
    encoder = Encoder()
    reference_encoder = dynamo_codec.Encoder()
    stored: list[list[int]] = []
    events: list[tuple[WorkerKey, bytes]] = []
    reference_events: list[tuple[int, bytes]] = []
    distinct: set[int] = set()
    blocks = 0
    for event_id in range(sequences):
        length = rng.randint(*SEQUENCE_BLOCKS)
        prefix = rng.choice(groups)[: length - 1]
        local = prefix + [rng.getrandbits(64) for _ in range(length - len(prefix))]
        seq = sequence_hashes(local)
        worker_id = rng.randrange(workers)
        event = Stored(
            worker_id=worker_id,
            parent=None,
            blocks=tuple(StoredBlock(EngineHash(s), LocalHash(h)) for s, h in zip(seq, local, strict=True)),
            event_id=event_id,
        )
        events.append(((worker_id, 0), encoder.encode(EventBatch((event,), dp_rank=0))))
        reference_events.append((worker_id, reference_encoder.encode_event(event)))
        distinct.update(seq)
        blocks += length
        stored.append(local)
    by_length: dict[int, list[list[int]]] = {}
    for length in QUERY_LENGTHS:
        made = []
        for i in range(queries):
            base = rng.choice(stored)[:length]
            if i % 2:  # half diverge from a stored sequence at a uniformly random block
                base = base[: rng.randrange(len(base))]
            made.append(base + [rng.getrandbits(64) for _ in range(length - len(base))])
        by_length[length] = made
    return Workload(workers, events, reference_events, blocks, len(distinct), by_length)


# -- the reference ------------------------------------------------------------------------------


def _reference_tree() -> Callable[[], Any]:
    """The reference index class, imported only when the benchmark runs."""
    try:
        from dynamo._core import RadixTree
    except ImportError as exc:
        raise SystemExit(
            "bench_index: the reference `dynamo._core` is missing; install the anchors extra: "
            "pip install -e '.[anchors]' (ai-dynamo-runtime)"
        ) from exc
    return RadixTree


def apply_reference(make_tree: Callable[[], Any], workload: Workload) -> tuple[Any, float]:
    """A fresh tree with every event applied, and its blocks/s; the time ends with one query, which
    the tree's thread answers only after the events queued before it."""
    tree = make_tree()
    apply_event = tree.apply_event
    probe = workload.queries[QUERY_LENGTHS[0]][0]
    start = perf_counter_ns()
    for worker_id, payload in workload.reference_events:  # hot path
        apply_event(worker_id, payload)
    tree.find_matches(probe)
    return tree, workload.blocks / ((perf_counter_ns() - start) / 1e9)


# -- the engine ---------------------------------------------------------------------------------


def apply_engine(engine: Engine, workload: Workload) -> float:
    """Blocks/s from the first ``apply_payload`` to the end of the ``flush`` that makes them visible."""
    apply_payload = engine.apply_payload
    start = perf_counter_ns()
    for worker, payload in workload.events:  # hot path
        apply_payload(worker, payload)
    engine.flush(timeout=FLUSH_TIMEOUT_S)
    return workload.blocks / ((perf_counter_ns() - start) / 1e9)


def check_applied(engine: Engine, events: int) -> None:
    stats = engine.stats()
    applied = sum(shard.events_applied for shard in stats)
    errors = {kind: n for shard in stats for kind, n in shard.errors.items() if n}
    if applied != events or errors:
        raise SystemExit(f"bench_index: the engine applied {applied} of {events} events, errors {errors}")


@dataclass
class ShardSize:
    """One shard's table and applier as seen after a flush."""

    segment_bytes: int
    """The shard segment's size in ``/dev/shm``."""
    slots: int
    used: int
    """Slots taken by live keys and tombstones: the table grows when these pass half the slots."""
    keys: int
    applier_anon_bytes: int
    """Growth of the applier's anonymous memory (proportional set size) since ``baseline``: its private
    maps, without the pages it shares with the process that forked it."""


def rollup(pid: int, field: str) -> int:
    """One ``/proc/<pid>/smaps_rollup`` figure (``Pss``, ``Pss_Anon``, ...) in bytes (0 if the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def anon_pss(pid: int) -> int:
    """A process's anonymous memory by proportional set size, in bytes (0 if it is gone)."""
    return rollup(pid, "Pss_Anon")


def applier_baseline(engine: Engine) -> dict[int, int]:
    """Every applier's anonymous memory now, before any event: what ``shard_sizes`` subtracts."""
    return {shard.pid: anon_pss(shard.pid) for shard in engine.stats()}


def shard_sizes(engine: Engine, baseline: dict[int, int]) -> list[ShardSize]:
    sizes = []
    for shard in engine.stats():
        segment = Segment.attach(shard.segment, writable=False)
        try:
            words = segment.words
            slots, used, keys = int(words[H_CAPACITY]), int(words[H_USED]), int(words[H_LIVE])
        finally:
            segment.close()
        anon = anon_pss(shard.pid) - baseline.get(shard.pid, 0)
        sizes.append(ShardSize(os.stat(f"{SHM_DIR}/{shard.segment}").st_size, slots, used, keys, anon))
    return sizes


def size_figures(sizes: list[ShardSize], distinct_blocks: int) -> dict[str, Any]:
    total = sum(s.segment_bytes for s in sizes)
    return {
        "segment_bytes": total,
        "slots": sum(s.slots for s in sizes),
        "keys": sum(s.keys for s in sizes),
        "bytes_per_block": total / max(1, distinct_blocks),
        "applier_anon_bytes": sum(s.applier_anon_bytes for s in sizes),
    }


def in_process_owner() -> int:
    """The owner id in the names of the in-process writer's segments (the engine's carry the pid)."""
    return (os.getpid() << 20) + 1


def apply_in_process(workload: Workload) -> float:
    """Blocks/s of one ``ShardWriter`` in this process: the applier's work without sockets or a process.
    It also compiles the kernels here, before the engine forks its appliers and readers."""
    owner = in_process_owner()
    control = Control.create(control_name(owner), 1)
    try:
        writer = ShardWriter(control, 0, owner)
        try:
            decode, apply_batch = Decoder().decode_raw, writer.apply_batch
            start = perf_counter_ns()
            for _, payload in workload.events:  # hot path: what the applier does per message
                batch = decode(payload)
                apply_batch((batch.worker_id, batch.dp_rank), batch.events)
            rate = workload.blocks / ((perf_counter_ns() - start) / 1e9)
            reader = IndexReader(control.name)
            try:
                for query in workload.queries[QUERY_LENGTHS[0]][:WARM_QUERIES]:
                    reader.find_matches(query)
                    reader.find_matches(np.array(query, dtype=np.uint64))  # type: ignore[arg-type]
            finally:
                reader.close()
        finally:
            writer.close(unlink=True)
    finally:
        control.close()
        control.unlink()
    return rate


# -- queries ------------------------------------------------------------------------------------


def print_ratios(result: dict[str, Any], *, width: int) -> None:
    """The ``ratios`` with their goals, met or not: the last lines every benchmark prints."""
    print(f"ratios ({result['ratio_basis']}):")
    for key, value in result["ratios"].items():
        goal = result["goals"][key]
        print(f"  {key:<{width}} {value:>6.2f}  goal ≥ {goal:g}: {'met' if value >= goal else 'not met'}")


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def percentiles(samples: list[float]) -> dict[str, float]:
    """Count, p50, p99, p99.9 and max of ``samples`` (NaN for each figure when there are none)."""
    if not samples:
        return {"n": 0, "p50": math.nan, "p99": math.nan, "p99.9": math.nan, "max": math.nan}
    return {
        "n": len(samples),
        "p50": _percentile(samples, 0.5),
        "p99": _percentile(samples, 0.99),
        "p99.9": _percentile(samples, 0.999),
        "max": max(samples),
    }


@dataclass
class Timed:
    """One pass of queries, each timed alone on both sides."""

    ours: list[float]
    theirs: list[float]
    """µs per query, kvrouter and the reference."""
    mismatches: int
    depth: float
    """Mean longest match, in blocks."""


def alternate(find: Callable[[Any], dict[WorkerKey, int]], reference: Any, queries: Sequence[Any]) -> Timed:
    """Time ``find`` and the reference on every query, alternating who goes first, and compare answers."""
    ours: list[float] = []
    theirs: list[float] = []
    mismatches = 0
    depth = 0
    for i, query in enumerate(queries):  # hot path
        if i % 2:
            start = perf_counter_ns()
            answer = find(query)
            middle = perf_counter_ns()
            expected = reference(query).scores
            end = perf_counter_ns()
            ours.append((middle - start) / 1000)
            theirs.append((end - middle) / 1000)
        else:
            start = perf_counter_ns()
            expected = reference(query).scores
            middle = perf_counter_ns()
            answer = find(query)
            end = perf_counter_ns()
            theirs.append((middle - start) / 1000)
            ours.append((end - middle) / 1000)
        if answer != expected:
            mismatches += 1
            if mismatches <= 3:
                print(f"mismatch: kvrouter {sorted(answer.items())[:4]} reference {sorted(expected.items())[:4]}")
        depth += max(expected.values(), default=0)
    return Timed(ours, theirs, mismatches, depth / len(queries))


def time_queries(engine: Engine, tree: Any, queries: list[list[int]]) -> dict[str, Any]:
    """Latency of both sides on every query, given as lists (the figures and the reference's) and then
    as ``uint64`` arrays, each pass alternating with the reference so both meet the same noise."""
    reference = tree.find_matches
    for query in queries[:WARM_QUERIES]:
        engine.find_matches(query)
        reference(query)
    lists = alternate(engine.find_matches, reference, queries)
    arrays = alternate(engine.find_matches, reference, [np.array(query, dtype=np.uint64) for query in queries])
    return {
        "p50_us": statistics.median(lists.ours),
        "p99_us": _percentile(lists.ours, 0.99),
        "p50_ndarray_us": statistics.median(arrays.ours),
        "reference_p50_us": statistics.median(lists.theirs),
        "reference_p99_us": _percentile(lists.theirs, 0.99),
        "mismatches": lists.mismatches + arrays.mismatches,
        "compared": 2 * len(queries),
        "mean_depth": lists.depth,
    }


def reference_rate(tree: Any, queries: list[list[int]], seconds: float) -> float:
    """Queries/s of the reference from one caller over ``seconds``."""
    find = tree.find_matches
    count = 0
    start = perf_counter()
    deadline = start + seconds
    while True:
        for query in queries:  # hot path
            find(query)
        count += len(queries)
        if perf_counter() >= deadline:
            return count / (perf_counter() - start)


def _reader_process(
    handle: ReaderHandle, queries: list[list[int]], seconds: float, barrier: Barrier, out: Connection
) -> None:
    """A forked reader: attach, warm up, wait for the others, count queries for ``seconds``."""
    reader = attach(handle)
    try:
        find = reader.find_matches
        for query in queries[:WARM_QUERIES]:
            find(query)
        barrier.wait(READER_TIMEOUT_S)
        n = len(queries)
        count = 0
        start = perf_counter()
        deadline = start + seconds
        while True:  # hot path
            find(queries[count % n])
            count += 1
            if count % CHECK_EVERY == 0 and perf_counter() >= deadline:
                break
        out.send((count, perf_counter() - start))
    finally:
        reader.close()
        out.close()


def reader_rates(engine: Engine, queries: list[list[int]], readers: int, seconds: float) -> list[float]:
    """Queries/s of each of ``readers`` processes running together."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(readers)
    pipes = [context.Pipe(duplex=False) for _ in range(readers)]
    processes = [
        context.Process(target=_reader_process, args=(engine.reader_handle(), queries, seconds, barrier, send))
        for _, send in pipes
    ]
    for process in processes:
        process.start()
    rates: list[float] = []
    try:
        for (receive, send), process in zip(pipes, processes, strict=True):
            send.close()
            if not receive.poll(seconds + READER_TIMEOUT_S):
                raise SystemExit(f"bench_index: reader process {process.pid} did not report")
            count, elapsed = receive.recv()
            rates.append(count / elapsed)
    finally:
        for process in processes:
            process.join(READER_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
    if any(process.exitcode != 0 for process in processes):
        raise SystemExit(f"bench_index: reader exit codes {[p.exitcode for p in processes]}")
    return rates


# -- the run ------------------------------------------------------------------------------------


def run_workers(workload: Workload, make_tree: Callable[[], Any], args: argparse.Namespace) -> dict[str, Any]:
    """Every shard count for one worker count: apply, queries, readers, bytes; plus the reference."""
    in_process = apply_in_process(workload)
    reference_applies: list[float] = []
    tree: Any = None
    shards_out: dict[str, Any] = {}
    for shards in args.shards:
        applies: list[float] = []
        for r in range(args.repeat):
            if shards == args.shards[0]:
                tree = None  # the previous tree goes before the next is built
                tree, rate = apply_reference(make_tree, workload)
                reference_applies.append(rate)
            with Engine(shards=shards) as engine:
                baseline = applier_baseline(engine)
                applies.append(apply_engine(engine, workload))
                check_applied(engine, len(workload.events))
                if r < args.repeat - 1:
                    continue
                row: dict[str, Any] = {
                    "apply_blocks_per_s": statistics.median(applies),
                    "apply_samples": applies,
                    **size_figures(shard_sizes(engine, baseline), workload.distinct_blocks),
                    "find_matches": {},
                }
                for length in QUERY_LENGTHS:
                    queries = workload.queries[length]
                    figures = time_queries(engine, tree, queries)
                    one = reader_rates(engine, queries, 1, args.window)
                    two = reader_rates(engine, queries, 2, args.window)
                    figures |= {
                        "qps_1_reader": one[0],
                        "qps_2_readers": sum(two),
                        "qps_2_readers_each": two,
                        "two_readers_scaling": sum(two) / one[0],
                    }
                    row["find_matches"][str(length)] = figures
                shards_out[str(shards)] = row
    reference_qps = {
        str(length): reference_rate(tree, workload.queries[length], args.window) for length in QUERY_LENGTHS
    }
    del tree
    return {
        "workers": workload.workers,
        "events": len(workload.events),
        "blocks": workload.blocks,
        "distinct_blocks": workload.distinct_blocks,
        "in_process_apply_blocks_per_s": in_process,
        "reference": {
            "apply_blocks_per_s": statistics.median(reference_applies),
            "apply_samples": reference_applies,
            "qps": reference_qps,
        },
        "shards": shards_out,
    }


def ratios_of(config: dict[str, Any], shards: str) -> dict[str, float]:
    row = config["shards"][shards]
    out = {"apply": row["apply_blocks_per_s"] / config["reference"]["apply_blocks_per_s"]}
    for length in QUERY_LENGTHS:
        figures = row["find_matches"][str(length)]
        out[f"find_matches_{length}"] = figures["reference_p50_us"] / figures["p50_us"]
        out[f"find_matches_{length}_p99"] = figures["reference_p99_us"] / figures["p99_us"]
        out[f"qps_{length}"] = figures["qps_1_reader"] / config["reference"]["qps"][str(length)]
        out[f"two_readers_scaling_{length}"] = figures["two_readers_scaling"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    make_tree = _reference_tree()
    configs: dict[str, Any] = {}
    for workers in args.workers:
        workload = build_workload(workers, args.sequences, args.queries, args.seed)
        configs[f"w{workers}"] = run_workers(workload, make_tree, args)
    basis = str(args.shards[0])
    detail = {
        key: {shards: ratios_of(config, shards) for shards in config["shards"]} for key, config in configs.items()
    }
    first = [detail[key][basis] for key in configs]
    ratios = {
        "find_matches_64": min(r["find_matches_64"] for r in first),
        "find_matches_512": min(r["find_matches_512"] for r in first),
        "apply": min(r["apply"] for r in first),
        "two_readers_scaling": min(min(r["two_readers_scaling_64"], r["two_readers_scaling_512"]) for r in first),
    }
    return {
        "configs": configs,
        "ratios": ratios,
        "ratio_basis": (
            f"{basis} shard(s); the lowest over worker counts {list(args.workers)} (and, for two_readers_scaling, "
            "over query lengths 64 and 512); find_matches from p50 latency"
        ),
        "ratios_by_config": detail,
        "goals": dict(GOALS),
        "goals_met": {key: ratios[key] >= goal for key, goal in GOALS.items()},
    }


def mismatches_of(result: dict[str, Any]) -> int:
    return sum(
        figures["mismatches"]
        for config in result["configs"].values()
        for row in config["shards"].values()
        for figures in row["find_matches"].values()
    )


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{'apply':<7} {'W':>4} {'shards':>6} {'kvrouter Mblk/s':>15} {'reference':>10} {'ratio':>6} "
        f"{'bytes/block':>11} {'segments MiB':>12} {'slots/key':>9} {'applier maps MiB':>16}"
    )
    for config in result["configs"].values():
        reference = config["reference"]["apply_blocks_per_s"] / 1e6
        for shards, row in config["shards"].items():
            rate = row["apply_blocks_per_s"] / 1e6
            print(
                f"{'':<7} {config['workers']:>4} {shards:>6} {rate:>15.2f} {reference:>10.2f} {rate / reference:>6.2f} "
                f"{row['bytes_per_block']:>11.0f} {row['segment_bytes'] / 2**20:>12.1f} "
                f"{row['slots'] / max(1, row['keys']):>9.2f} {row['applier_anon_bytes'] / 2**20:>16.1f}"
            )
        print(
            f"{'':<7} {config['workers']:>4} {'':>6} in-process writer (1 shard, no processes, no sockets): "
            f"{config['in_process_apply_blocks_per_s'] / 1e6:.2f} M blocks/s; {config['events']} events, "
            f"{config['blocks']:,} block-applies, {config['distinct_blocks']:,} distinct blocks"
        )
    print()
    print(
        f"{'find_matches':<12} {'W':>4} {'shards':>6} {'L':>4} {'depth':>5} {'p50 µs':>7} {'p99 µs':>7} "
        f"{'ref p50':>7} {'ref p99':>7} {'ratio':>6} {'ndarray p50':>11} {'1 reader q/s':>12} "
        f"{'2 readers q/s':>13} {'scaling':>7} {'ref q/s':>8} {'q/s ratio':>9}"
    )
    for config in result["configs"].values():
        for shards, row in config["shards"].items():
            for length, f in row["find_matches"].items():
                reference_qps = config["reference"]["qps"][length]
                print(
                    f"{'':<12} {config['workers']:>4} {shards:>6} {length:>4} {f['mean_depth']:>5.0f} "
                    f"{f['p50_us']:>7.1f} {f['p99_us']:>7.1f} {f['reference_p50_us']:>7.1f} "
                    f"{f['reference_p99_us']:>7.1f} {f['reference_p50_us'] / f['p50_us']:>6.2f} "
                    f"{f['p50_ndarray_us']:>11.1f} {f['qps_1_reader']:>12,.0f} {f['qps_2_readers']:>13,.0f} "
                    f"{f['two_readers_scaling']:>7.2f} {reference_qps:>8,.0f} {f['qps_1_reader'] / reference_qps:>9.2f}"
                )
    print()
    print_ratios(result, width=20)
    mismatches = mismatches_of(result)
    compared = sum(
        figures["compared"]
        for config in result["configs"].values()
        for row in config["shards"].values()
        for figures in row["find_matches"].values()
    )
    print(f"correctness: {mismatches} of {compared} answers differ from the reference's")


# -- capacity -----------------------------------------------------------------------------------


Chain = tuple[WorkerKey, bytes, int]
"""One capacity event: its worker, its kvrouter batch, its blocks."""


def build_chains(blocks: int, workers: int, seed: int) -> list[Chain]:
    """``blocks`` distinct blocks as chains of ``CHAIN_BLOCKS``, chain ``c`` cached by worker ``c % workers``."""
    generator = np.random.default_rng(seed)
    encoder = Encoder()
    events: list[Chain] = []
    for chain, first in enumerate(range(0, blocks, CHAIN_BLOCKS)):
        size = min(CHAIN_BLOCKS, blocks - first)
        local = generator.integers(0, 2**64 - 1, size=size, dtype=np.uint64, endpoint=True)
        seq = sequence_hashes_array(local).tolist()
        local_list = local.tolist()
        worker = (chain % workers, 0)
        for at in range(0, size, EVENT_BLOCKS):
            part = range(at, min(at + EVENT_BLOCKS, size))
            event = Stored(
                worker_id=worker[0],
                parent=EngineHash(seq[at - 1]) if at else None,
                blocks=tuple(StoredBlock(EngineHash(seq[i]), LocalHash(local_list[i])) for i in part),
            )
            events.append((worker, encoder.encode(EventBatch((event,), dp_rank=0)), len(part)))
    return events


def check_chains(engine: Engine, events: list[Chain]) -> int:
    """Query the first event of about ``CAPACITY_PROBES`` chains spread over the load; the count not
    found whole for their worker."""
    decoder = Decoder()
    per_chain = CHAIN_BLOCKS // EVENT_BLOCKS
    step = max(per_chain, len(events) // CAPACITY_PROBES // per_chain * per_chain)
    missed = 0
    for at in range(0, len(events), step):
        worker, payload, _ = events[at]
        local = decoder.decode_raw(payload).events[0].local
        if engine.find_matches(local.tolist()) != {worker: len(local)}:
            missed += 1
    return missed


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def growth_need(sizes: list[ShardSize], new_blocks: int) -> int:
    """Bytes the next ``new_blocks`` could take at once: every shard whose table would pass its load
    grows, and the writer sizes the new table (and its private maps, which fill at the same pace) for a
    quarter load, rounded up to a power of two: up to 4x, while the old one is still mapped."""
    share = new_blocks // max(1, len(sizes))
    return sum(
        GROWTH_FACTOR * (s.segment_bytes + s.applier_anon_bytes) for s in sizes if s.used + share > s.slots * MAX_LOAD
    )


def run_capacity(args: argparse.Namespace) -> dict[str, Any]:
    build_start = perf_counter()
    events = build_chains(args.capacity_blocks, args.capacity_workers, args.seed)
    print(f"capacity: {len(events):,} events encoded in {perf_counter() - build_start:.1f} s", flush=True)
    applied_blocks = applied_events = 0
    stopped: str | None = None
    elapsed = 0.0
    with Engine(shards=args.capacity_shards) as engine:
        baseline = applier_baseline(engine)
        apply_payload = engine.apply_payload
        while applied_events < len(events):
            chunk: list[Chain] = []
            blocks = 0
            while applied_events + len(chunk) < len(events) and blocks < CHUNK_BLOCKS:
                chunk.append(events[applied_events + len(chunk)])
                blocks += chunk[-1][2]
            need = growth_need(shard_sizes(engine, baseline), blocks) + MEMORY_MARGIN
            shm = os.statvfs(SHM_DIR)
            available = min(_mem_available(), shm.f_bavail * shm.f_frsize)
            if available < need:
                stopped = (
                    f"stopped after {applied_blocks:,} blocks: the next {blocks:,} would grow tables that could "
                    f"need {need / 2**30:.1f} GiB with the margin, {available / 2**30:.1f} GiB available"
                )
                break
            start = perf_counter_ns()
            for worker, payload, _ in chunk:  # hot path
                apply_payload(worker, payload)
            engine.flush(timeout=FLUSH_TIMEOUT_S)
            elapsed += (perf_counter_ns() - start) / 1e9
            applied_events += len(chunk)
            applied_blocks += blocks
            if args.progress:
                print(f"capacity: {applied_blocks:,} blocks in {elapsed:.1f} s", flush=True)
        check_applied(engine, applied_events)
        sizes = size_figures(shard_sizes(engine, baseline), applied_blocks)
        missed = check_chains(engine, events[:applied_events])
        workers_per_shard = [len(shard.workers) for shard in engine.stats()]
    return {
        "blocks": applied_blocks,
        "target_blocks": args.capacity_blocks,
        "workers": args.capacity_workers,
        "shards": args.capacity_shards,
        "workers_per_shard": workers_per_shard,
        "events": applied_events,
        "seconds": elapsed,
        "apply_blocks_per_s": applied_blocks / elapsed if elapsed else 0.0,
        **sizes,
        "stopped": stopped,
        "chains_missing": missed,
        "reference": "not run: capacity mode measures the engine alone",
    }


def print_capacity(result: dict[str, Any]) -> None:
    print(
        f"capacity: {result['blocks']:,} distinct blocks (target {result['target_blocks']:,}) from "
        f"{result['workers']} workers on {result['shards']} shards {result['workers_per_shard']}"
    )
    print(
        f"  apply: {result['seconds']:.1f} s, {result['apply_blocks_per_s'] / 1e6:.2f} M blocks/s "
        f"(sends and a flush per {CHUNK_BLOCKS:,}-block chunk)"
    )
    print(
        f"  shard segments: {result['segment_bytes'] / 2**30:.2f} GiB in {SHM_DIR}, "
        f"{result['bytes_per_block']:.0f} bytes per cached block ({result['slots']:,} slots, {result['keys']:,} keys)"
    )
    print(
        f"  appliers' private maps (anonymous PSS growth since start): {result['applier_anon_bytes'] / 2**30:.2f} GiB, "
        f"{result['applier_anon_bytes'] / max(1, result['blocks']):.0f} bytes per block"
    )
    print(f"  sample check: {result['chains_missing']} of the probed chains not found whole")
    if result["stopped"]:
        print(f"  {result['stopped']}")
    print(f"  {result['reference']}")


# -- main ---------------------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "cpu_count": os.cpu_count()}


def leftovers() -> list[str]:
    """Segments, locks and socket folders of this process's engines or in-process writer still present."""
    prefixes = (f"kvrouter-{os.getpid()}-", f"kvrouter-{in_process_owner()}-")
    names = [f"{SHM_DIR}/{n}" for n in os.listdir(SHM_DIR) if n.startswith(prefixes)]
    tmp = tempfile.gettempdir()
    return names + [f"{tmp}/{n}" for n in os.listdir(tmp) if n.startswith(prefixes)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, nargs="+", default=list(WORKER_COUNTS), help="worker counts")
    parser.add_argument(
        "--shards", type=int, nargs="+", default=list(SHARD_COUNTS), help="shard counts; ratios use the first"
    )
    parser.add_argument("--sequences", type=int, default=SEQUENCES, help="Stored events (one sequence each)")
    parser.add_argument("--queries", type=int, default=QUERIES, help="queries per length")
    parser.add_argument("--window", type=float, default=WINDOW_S, help="seconds each reader process counts over")
    parser.add_argument("--repeat", type=int, default=3, help="apply repeats per side and shard count (median)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--quick", action="store_true", help=f"a tiny workload, for tests: {QUICK}")
    parser.add_argument("--capacity", action="store_true", help="load --capacity-blocks distinct blocks instead")
    parser.add_argument("--capacity-blocks", type=int, default=CAPACITY_BLOCKS)
    parser.add_argument("--capacity-workers", type=int, default=CAPACITY_WORKERS)
    parser.add_argument("--capacity-shards", type=int, default=CAPACITY_SHARDS)
    parser.add_argument("--progress", action="store_true", help="capacity: print a line per chunk")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.queries < CORRECTNESS_MIN:
        parser.error(f"--queries: at least {CORRECTNESS_MIN} per length are compared with the reference")
    before = _machine()
    status = 0
    result: dict[str, Any]
    if args.capacity:
        result = {"capacity": run_capacity(args)}
        print_capacity(result["capacity"])
        status = 1 if result["capacity"]["chains_missing"] else 0
        settings = f"seed {args.seed}"
    else:
        result = run(args)
        print_table(result)
        status = 1 if mismatches_of(result) else 0
        settings = (
            f"{args.sequences} sequences, {args.queries} queries per length, {args.window} s reader windows, "
            f"apply median of {args.repeat}, seed {args.seed}"
        )
    after = _machine()
    print(
        f"machine: {after['cpu_count']} CPUs; load average (1/5/15 min) {before['loadavg']} before, "
        f"{after['loadavg']} after; python {sys.version.split()[0]}; {settings}"
    )
    left = leftovers()
    print(f"shm: {'clean' if not left else 'left behind: ' + ', '.join(left)}")
    if left:
        status = 1
    if args.json:
        figures = {
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "machine": {"before": before, "after": after},
            **result,
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
