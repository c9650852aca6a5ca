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
  compared with the reference's, and a mismatch fails the run.
- queries/s per reader process: 1, then 2 forked processes attached by handle, started together at a
  barrier, each counting queries over a fixed wall time. ``two_readers_scaling`` is the aggregate of
  two over one; it cannot reach 2 while anything else runs on a 2-core machine (the load line).
- bytes per block: the shard segments' sizes in ``/dev/shm`` ÷ the workload's distinct blocks.

The ``ratios`` are > 1 when kvrouter is better (times: reference ÷ kvrouter; rates: kvrouter ÷
reference), from the 1-shard figures, the lower of the worker counts (``ratio_basis`` in the JSON).

``--capacity`` loads ``--capacity-blocks`` distinct blocks (10 M by default) as chains from 1024 workers
and reports bytes per cached block and the apply rate, without the reference. It stops early, and says
so, when the next table growth might not fit the machine's free memory.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
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
from kvrouter.events.codecs.kvrouter import Encoder
from kvrouter.events.model import EngineHash, EventBatch, LocalHash, Stored, StoredBlock, WorkerKey
from kvrouter.hashing import sequence_hashes, sequence_hashes_array
from kvrouter.index.layout import H_CAPACITY, H_LIVE, SHM_DIR, Control, Segment, control_name
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
CHUNK_BLOCKS: Final = 500_000
"""The capacity load flushes after this many blocks and checks memory before the next chunk."""
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
    groups = [
        [rng.getrandbits(64) for _ in range(rng.randint(*PREFIX_BLOCKS))] for _ in range(PREFIX_GROUPS)
    ]
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
    return RadixTree  # type: ignore[no-any-return]


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


def segment_bytes(engine: Engine) -> tuple[int, int, int]:
    """Bytes of the shard segments in ``/dev/shm``, their slots and live keys."""
    total = slots = keys = 0
    for shard in engine.stats():
        total += os.stat(f"{SHM_DIR}/{shard.segment}").st_size
        segment = Segment.attach(shard.segment, writable=False)
        try:
            slots += int(segment.words[H_CAPACITY])
            keys += int(segment.words[H_LIVE])
        finally:
            segment.close()
    return total, slots, keys


def applier_memory(engine: Engine) -> int:
    """The appliers' anonymous memory (their private maps) by proportional set size, in bytes."""
    total = 0
    for shard in engine.stats():
        try:
            text = Path(f"/proc/{shard.pid}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Pss_Anon:"):
                total += int(line.split()[1]) * 1024
    return total


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
            apply_payload = writer.apply_payload
            start = perf_counter_ns()
            for _, payload in workload.events:  # hot path
                apply_payload(payload)
            rate = workload.blocks / ((perf_counter_ns() - start) / 1e9)
            reader = IndexReader(control.name)
            for query in workload.queries[QUERY_LENGTHS[0]][:WARM_QUERIES]:
                reader.find_matches(query)
                reader.find_matches(np.array(query, dtype=np.uint64))  # type: ignore[arg-type]
            reader.close()
        finally:
            writer.close(unlink=True)
    finally:
        control.close()
        control.unlink()
    return rate


# -- queries ------------------------------------------------------------------------------------


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_queries(engine: Engine, tree: Any, queries: list[list[int]]) -> tuple[dict[str, float], int, float]:
    """Per-query µs of both sides, alternating who goes first; returns the figures, the mismatches
    against the reference, and the mean longest match (blocks)."""
    find = engine.find_matches
    reference = tree.find_matches
    for query in queries[:WARM_QUERIES]:
        find(query)
        reference(query)
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
    arrays = [np.array(query, dtype=np.uint64) for query in queries]
    ndarray: list[float] = []
    for array in arrays:
        start = perf_counter_ns()
        find(array)  # type: ignore[arg-type]  # local_hash_array takes an ndarray as is
        ndarray.append((perf_counter_ns() - start) / 1000)
    figures = {
        "p50_us": statistics.median(ours),
        "p99_us": _percentile(ours, 0.99),
        "p50_ndarray_us": statistics.median(ndarray),
        "reference_p50_us": statistics.median(theirs),
        "reference_p99_us": _percentile(theirs, 0.99),
    }
    return figures, mismatches, depth / len(queries)


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
                applies.append(apply_engine(engine, workload))
                check_applied(engine, len(workload.events))
                if r < args.repeat - 1:
                    continue
                seg_bytes, slots, keys = segment_bytes(engine)
                row: dict[str, Any] = {
                    "apply_blocks_per_s": statistics.median(applies),
                    "apply_samples": applies,
                    "segment_bytes": seg_bytes,
                    "slots": slots,
                    "keys": keys,
                    "bytes_per_block": seg_bytes / workload.distinct_blocks,
                    "applier_anon_bytes": applier_memory(engine),
                    "find_matches": {},
                }
                for length in QUERY_LENGTHS:
                    queries = workload.queries[length]
                    figures, mismatches, depth = time_queries(engine, tree, queries)
                    one = reader_rates(engine, queries, 1, args.window)
                    two = reader_rates(engine, queries, 2, args.window)
                    figures |= {
                        "mismatches": mismatches,
                        "compared": len(queries),
                        "mean_depth": depth,
                        "qps_1_reader": one[0],
                        "qps_2_readers": sum(two),
                        "qps_2_readers_each": two,
                        "two_readers_scaling": sum(two) / one[0],
                    }
                    row["find_matches"][str(length)] = figures
                shards_out[str(shards)] = row
    reference_qps = {str(length): reference_rate(tree, workload.queries[length], args.window) for length in QUERY_LENGTHS}
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
    detail = {key: {shards: ratios_of(config, shards) for shards in config["shards"]} for key, config in configs.items()}
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
        f"{'bytes/block':>11} {'segments MiB':>12} {'slots/key':>9} {'applier anon MiB':>16}"
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
    print(f"ratios ({result['ratio_basis']}):")
    for key, value in result["ratios"].items():
        goal = result["goals"][key]
        print(f"  {key:<20} {value:>6.2f}  goal ≥ {goal:g}: {'met' if value >= goal else 'not met'}")
    mismatches = mismatches_of(result)
    compared = sum(
        figures["compared"]
        for config in result["configs"].values()
        for row in config["shards"].values()
        for figures in row["find_matches"].values()
    )
    print(f"correctness: {mismatches} of {compared} answers differ from the reference's")


# -- capacity -----------------------------------------------------------------------------------


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def build_chains(blocks: int, workers: int, seed: int) -> list[tuple[WorkerKey, bytes]]:
    """``blocks`` distinct blocks as chains of ``CHAIN_BLOCKS``, chain ``c`` cached by worker ``c % workers``."""
    generator = np.random.default_rng(seed)
    encoder = Encoder()
    events: list[tuple[WorkerKey, bytes]] = []
    for chain, first in enumerate(range(0, blocks, CHAIN_BLOCKS)):
        local = generator.integers(0, 2**64 - 1, size=min(CHAIN_BLOCKS, blocks - first), dtype=np.uint64, endpoint=True)
        seq = sequence_hashes_array(local).tolist()
        local_list = local.tolist()
        worker = (chain % workers, 0)
        for at in range(0, len(seq), EVENT_BLOCKS):
            part = range(at, min(at + EVENT_BLOCKS, len(seq)))
            event = Stored(
                worker_id=worker[0],
                parent=EngineHash(seq[at - 1]) if at else None,
                blocks=tuple(StoredBlock(EngineHash(seq[i]), LocalHash(local_list[i])) for i in part),
            )
            events.append((worker, encoder.encode(EventBatch((event,), dp_rank=0))))
    return events


def run_capacity(args: argparse.Namespace) -> dict[str, Any]:
    build_start = perf_counter()
    events = build_chains(args.capacity_blocks, args.capacity_workers, args.seed)
    print(f"capacity: {len(events):,} events encoded in {perf_counter() - build_start:.1f} s", flush=True)
    applied_blocks = 0
    applied_events = 0
    stopped: str | None = None
    elapsed = 0.0
    with Engine(shards=args.capacity_shards) as engine:
        apply_payload = engine.apply_payload
        at = 0
        while at < len(events):
            seg_bytes, _, _ = segment_bytes(engine)
            anon = applier_memory(engine)
            need = 2 * (seg_bytes + anon) + MEMORY_MARGIN
            shm = os.statvfs(SHM_DIR)
            if _mem_available() < need or shm.f_bavail * shm.f_frsize < 2 * seg_bytes + MEMORY_MARGIN:
                stopped = (
                    f"stopped after {applied_blocks:,} blocks: a growth of every shard could need "
                    f"{need / 2**30:.1f} GiB, {_mem_available() / 2**30:.1f} GiB available"
                )
                break
            chunk = []
            blocks = 0
            while at < len(events) and blocks < CHUNK_BLOCKS:
                chunk.append(events[at])
                blocks += EVENT_BLOCKS
                at += 1
            start = perf_counter_ns()
            for worker, payload in chunk:  # hot path
                apply_payload(worker, payload)
            engine.flush(timeout=FLUSH_TIMEOUT_S)
            elapsed += (perf_counter_ns() - start) / 1e9
            applied_events += len(chunk)
            applied_blocks = min(args.capacity_blocks, applied_events * EVENT_BLOCKS)
            print(
                f"capacity: {applied_blocks:,} blocks in {elapsed:.1f} s; segments {seg_bytes / 2**30:.2f} GiB "
                f"(before this chunk)",
                flush=True,
            )
        check_applied(engine, applied_events)
        seg_bytes, slots, keys = segment_bytes(engine)
        anon = applier_memory(engine)
        probes = 0
        for chain in range(0, min(len(events), applied_events) - 1, max(2, applied_events // 200) * 2):
            worker = events[chain][0]
            # the first event of every chain starts at the root: check that its blocks are found
            if chain % (CHAIN_BLOCKS // EVENT_BLOCKS) == 0:
                probes += 1
        stats = engine.stats()
    blocks_applied = min(args.capacity_blocks, sum(1 for _ in range(applied_events)) * EVENT_BLOCKS)
    del worker, blocks_applied
    return {
        "blocks": applied_blocks,
        "target_blocks": args.capacity_blocks,
        "workers": args.capacity_workers,
        "shards": args.capacity_shards,
        "events": applied_events,
        "seconds": elapsed,
        "apply_blocks_per_s": applied_blocks / elapsed if elapsed else 0.0,
        "segment_bytes": seg_bytes,
        "slots": slots,
        "keys": keys,
        "bytes_per_block": seg_bytes / max(1, applied_blocks),
        "applier_anon_bytes": anon,
        "workers_per_shard": [len(shard.workers) for shard in stats],
        "stopped": stopped,
        "reference": "not run: the reference is not measured in capacity mode",
    }
