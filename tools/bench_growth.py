"""What a growing shard costs its writer and its readers: kvrouter against Dynamo's ``RadixTree``, in one run.

    python tools/bench_growth.py [--blocks N] [--workers W] [--quick] [--json FILE]

The workload: ``--workers`` (64) workers, each event one Stored chain of ``CHAIN`` (80) fresh blocks
(random local hashes; engine hash = sequence hash) under no parent, round-robin, until ``--blocks`` (2.5 M)
blocks. One shard's table grows from ``INITIAL_CAPACITY`` (64 k slots) to 8 M, and its engine map alike,
doubling on the way. Before any clock, ``PROBES`` chains of ``PROBE_BLOCKS`` blocks are stored on both sides.

- **kvrouter:** one ``ShardWriter`` in this process gets each event through ``apply_batch``, the call the
  applier makes per message (decoding is left out: ``bench_ingest.py`` times it), each call timed. A reader
  process, forked before the writer or its helper thread exists, attaches to the control segment by name
  and times ``find_matches`` of the probe chains in a loop, checking every answer: for ``IDLE_S`` before
  the burst, then during it.
- **The reference:** ``RadixTree.apply_event`` with the same events as JSON, and after every
  ``QUERY_EVERY`` events one ``find_matches`` of a probe chain, timed. The reference applies events and
  answers queries on one thread of its own, so a query waits behind what is queued, as its indexer's
  ``/query`` does.

Figures: burst blocks/s (kvrouter: to the last ``apply_batch``; the reference: to a query after the last
event); kvrouter's longest ``apply_batch`` (the writer's stall; a growth used to be one) and its calls
over 10 ms; ``find_matches`` p50/p99/p99.9/max, kvrouter's idle and during the burst, the reference's
during the burst (µs); the index's bytes per block, each side's PSS (``/proc/<pid>/smaps_rollup``, summed
over kvrouter's writer and reader processes: a shared page counts once) after its burst, growths settled,
minus before it, over the burst's blocks (one entry each: every block is fresh). The workload's own
objects are made before either figure. Nothing else should run: the machine's load is printed.

Ratios, above 1 when kvrouter is better: ``burst`` (blocks/s, kvrouter ÷ reference),
``read_p999_burst`` (the reference's p99.9 ÷ kvrouter's, during the burst) and ``bytes_per_block``
(the reference's ÷ kvrouter's). Checked and printed beside
them: kvrouter's p99.9 during the burst within 2x its idle p99, and no read over 1 ms (issue 33).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from time import monotonic, perf_counter_ns
from typing import Any, Final

import numpy as np
from bench_index import _machine, _reference_tree, in_process_owner, leftovers, percentiles, rollup

from kvrouter.events.codecs import dynamo as dynamo_codec
from kvrouter.events.model import EngineHash, LocalHash, Stored, StoredBlock
from kvrouter.hashing import sequence_hashes
from kvrouter.index.layout import H_CAPACITY, Control, control_name
from kvrouter.index.reader import IndexReader
from kvrouter.index.writer import ShardWriter, raw_event

CHAIN: Final = 80
PROBES: Final = 64
PROBE_BLOCKS: Final = 64
BLOCKS: Final = 2_500_000
WORKERS: Final = 64
IDLE_S: Final = 1.0
QUERY_EVERY: Final = 16
STALL_MS: Final = 10.0
QUICK: Final = {"blocks": 200_000}
GOALS: Final = {"burst": 1.0, "read_p999_burst": 1.0, "bytes_per_block": 1.0}


def pss(pid: int) -> int:
    """A process's proportional set size in bytes (0 if it is gone)."""
    return rollup(pid, "Pss")


def chain(rng: random.Random, worker: int, n: int) -> Stored:
    local = [rng.getrandbits(64) for _ in range(n)]
    blocks = tuple(StoredBlock(EngineHash(s), LocalHash(h)) for s, h in zip(sequence_hashes(local), local, strict=True))
    return Stored(worker, None, blocks)


def _reader(conn: Connection, control: str, probes: list[tuple[list[int], int]]) -> None:
    """The reader process: times ``find_matches`` of the probes per phase until told ``stop``."""
    reader = IndexReader(control)
    samples: dict[str, list[float]] = {"idle": [], "burst": []}
    wrong = 0
    watch = Control.attach(control)
    while watch.flushed(0) < 1:  # the probes stored
        pass
    watch.close()
    for query, _ in probes:  # the kernels loaded (or compiled) before any clock
        reader.find_matches(query)
    conn.send("ready")
    phase = conn.recv()
    i = 0
    while True:
        if conn.poll():
            phase = conn.recv()
            if phase == "stop":
                break
        query, worker = probes[i % len(probes)]
        i += 1
        start = perf_counter_ns()
        answer = reader.find_matches(query)
        samples[phase].append((perf_counter_ns() - start) / 1e3)
        wrong += answer != {(worker, 0): len(query)}
    reader.close()
    conn.send({"samples": samples, "wrong": wrong})


def run_kvrouter(probes: list[Stored], burst: list[Stored], blocks: int) -> dict[str, Any]:
    owner = in_process_owner()
    control = Control.create(control_name(owner), 1)
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    queries = [([int(b.local_hash) for b in e.blocks], e.worker_id) for e in probes]
    reader = multiprocessing.get_context("fork").Process(target=_reader, args=(theirs, control.name, queries))
    reader.start()  # before the writer: its helper thread starts on the first growth
    writer = ShardWriter(control, 0, owner)
    try:
        for event in probes:  # 4 k blocks: no growth yet
            writer.apply(event)
        control.set_flushed(0, 1)
        raws = [((e.worker_id, 0), [raw_event(e)]) for e in burst]
        assert ours.recv() == "ready"
        ours.send("idle")
        idle_until = monotonic() + IDLE_S
        while monotonic() < idle_until:
            pass
        assert reader.pid is not None
        tree = (os.getpid(), reader.pid)
        memory = sum(map(pss, tree))
        ours.send("burst")
        calls = np.empty(len(raws), dtype=np.float64)
        apply_batch = writer.apply_batch
        start = perf_counter_ns()
        for i, (worker, events) in enumerate(raws):  # hot path
            before = perf_counter_ns()
            apply_batch(worker, events)
            calls[i] = perf_counter_ns() - before
        seconds = (perf_counter_ns() - start) / 1e9
        writer.settle()
        grown = sum(map(pss, tree)) - memory
        ours.send("stop")
        read = ours.recv()
        reader.join(timeout=30)
        capacity = int(writer.table[H_CAPACITY])
    finally:
        if reader.is_alive():
            reader.kill()
        writer.close(unlink=True)
        control.close()
        control.unlink()
    return {
        "blocks_per_s": blocks / seconds,
        "longest_call_ms": float(calls.max()) / 1e6,
        "calls_over_10ms": int((calls > STALL_MS * 1e6).sum()),
        "call_p50_us": float(np.median(calls)) / 1e3,
        "table_slots": capacity,
        "read_idle_us": percentiles(read["samples"]["idle"]),
        "read_burst_us": percentiles(read["samples"]["burst"]),
        "wrong_answers": read["wrong"],
        "bytes_per_block": grown / blocks,
    }


def run_reference(probes: list[Stored], burst: list[Stored], blocks: int) -> dict[str, Any]:
    """The reference's side in a forked child: its memory then grows from a process that freed nothing
    (kvrouter's run left freed heap behind in this one, which the tree would reuse unseen)."""
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    child = multiprocessing.get_context("fork").Process(
        target=lambda: theirs.send(_reference_side(probes, burst, blocks))
    )
    child.start()  # kvrouter's writer is closed: its helper threads have ended
    try:
        return dict(ours.recv())
    finally:
        child.join(timeout=60)


def _reference_side(probes: list[Stored], burst: list[Stored], blocks: int) -> dict[str, Any]:
    tree = _reference_tree()()
    encode = dynamo_codec.Encoder().encode_event
    for event in probes:
        tree.apply_event(event.worker_id, encode(event))
    payloads = [(e.worker_id, encode(e)) for e in burst]
    queries = [[int(b.local_hash) for b in e.blocks] for e in probes]
    tree.find_matches(queries[0])
    memory = pss(os.getpid())
    samples: list[float] = []
    apply_event, find_matches = tree.apply_event, tree.find_matches
    start = perf_counter_ns()
    for i, (worker_id, payload) in enumerate(payloads):  # hot path
        apply_event(worker_id, payload)
        if i % QUERY_EVERY == 0:
            before = perf_counter_ns()
            find_matches(queries[i % len(queries)])
            samples.append((perf_counter_ns() - before) / 1e3)
    find_matches(queries[0])
    seconds = (perf_counter_ns() - start) / 1e9
    grown = pss(os.getpid()) - memory
    return {"blocks_per_s": blocks / seconds, "read_burst_us": percentiles(samples), "bytes_per_block": grown / blocks}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    probes = [chain(rng, w % args.workers, PROBE_BLOCKS) for w in range(PROBES)]
    burst = [chain(rng, i % args.workers, CHAIN) for i in range(args.blocks // CHAIN)]
    blocks = CHAIN * len(burst)
    before = _machine()
    ours = run_kvrouter(probes, burst, blocks)
    theirs = run_reference(probes, burst, blocks)
    read_idle, read_burst = ours["read_idle_us"], ours["read_burst_us"]
    return {
        "workload": {"blocks": blocks, "workers": args.workers, "chain": CHAIN, "seed": args.seed},
        "machine": {"before": before, "after": _machine()},
        "kvrouter": ours,
        "reference": theirs,
        "checks": {
            "p999_burst_within_2x_idle_p99": read_burst["p99.9"] <= 2 * read_idle["p99"],
            "no_read_over_1ms": read_burst["max"] <= 1000.0,
            "every_answer_right": ours["wrong_answers"] == 0,
        },
        "ratios": {
            "burst": ours["blocks_per_s"] / theirs["blocks_per_s"],
            "read_p999_burst": theirs["read_burst_us"]["p99.9"] / read_burst["p99.9"],
            "bytes_per_block": theirs["bytes_per_block"] / ours["bytes_per_block"],
        },
        "goals": GOALS,
        "ratio_basis": "one shard in process, one run",
    }


def print_result(result: dict[str, Any]) -> None:
    ours, theirs = result["kvrouter"], result["reference"]
    w = result["workload"]
    print(f"growth burst: {w['blocks']:,} blocks, {w['workers']} workers, chains of {w['chain']}")
    machine = result["machine"]
    print(f"machine load before/after: {machine['before']['loadavg']} / {machine['after']['loadavg']}")
    print(f"  burst blocks/s  kvrouter {ours['blocks_per_s']:>12,.0f}   reference {theirs['blocks_per_s']:>12,.0f}")
    print(
        f"  kvrouter apply_batch p50 {ours['call_p50_us']:.1f} µs, longest {ours['longest_call_ms']:.2f} ms, "
        f"{ours['calls_over_10ms']} calls over {STALL_MS:g} ms; table grew to {ours['table_slots']:,} slots"
    )
    for label, figures in (
        ("kvrouter idle", ours["read_idle_us"]),
        ("kvrouter burst", ours["read_burst_us"]),
        ("reference burst", theirs["read_burst_us"]),
    ):
        print(
            f"  find_matches {label:<16} n={figures['n']:>8,}  p50 {figures['p50']:>8.1f}  p99 {figures['p99']:>8.1f}"
            f"  p99.9 {figures['p99.9']:>8.1f}  max {figures['max']:>9.1f} µs"
        )
    print(
        f"  index bytes per block (PSS grown ÷ blocks)  kvrouter {ours['bytes_per_block']:.0f}"
        f"   reference {theirs['bytes_per_block']:.0f}"
    )
    for check, ok in result["checks"].items():
        print(f"  {check}: {'yes' if ok else 'NO'}")
    print(f"ratios ({result['ratio_basis']}):")
    for key, value in result["ratios"].items():
        goal = result["goals"][key]
        print(f"  {key:<16} {value:>8.2f}  goal ≥ {goal:g}: {'met' if value >= goal else 'not met'}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--blocks", type=int, default=BLOCKS, help="blocks in the burst")
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--quick", action="store_true", help=f"a small burst, for tests: {QUICK}")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks = QUICK["blocks"]
    result = run(args)
    print_result(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    left = leftovers()
    print(f"shm: {left if left else 'clean'}")
    if left or result["kvrouter"]["wrong_answers"]:
        print(f"bench_growth: {result['kvrouter']['wrong_answers']} wrong answers, left behind {left}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
