"""Time kvrouter's event plane, real ZMQ frames into the shared tables, against Dynamo's ``RadixTree``.

    python tools/bench_ingest.py [--quick] [--repeat N] [--json FILE] [--wire]

The workload is ``tools/bench_index.py``'s (``spec/shm-engine.md`` §7.2): 200 prefix groups of 16-64
blocks, sequences of 32-128 blocks (a group's prefix and a unique suffix), each sequence one Stored
event (no parent) to a random worker, for 16 and 256 workers. Here every block is 16 real token ids
(random u32 from the seed), its local hash computed from them, its engine hash its router sequence hash,
so that vLLM frames can carry tokens for the router to re-hash. Everything is encoded before any clock
runs: per worker, one live frame ``[topic, seq, payload]`` per sequence, in two formats:

- ``kvrouter``: kvrouter-format batches (``events/codecs/kvrouter.py``, local hashes included, no tokens),
  event ids consecutive per worker from 0;
- ``vllm``: vLLM 0.33 map-encoded batches (``events/codecs/vllm.py``) with every block's token ids and
  engine hash; the router decodes, re-hashes the tokens and maps the engine hashes.

For each format and shard count (1, 2) the run starts a fresh ``Engine``, binds one XPUB per worker in
this process (a high-water mark holding the whole workload, so nothing can be dropped), registers every
worker with ``Engine.add_worker`` and waits until each XPUB has read its subscription (no frame is lost to
the slow joiner). The clock then runs from the first send, in workload order, to the moment every
worker's ``last_id`` in the control segment shows its last frame (polled every ``POLL_S``). Afterwards
every worker row must show no gap, no bad frame and all its events, and ``SPOT_CHECKS`` queries are
compared with the reference's answers. Publishing happens in this process, on the other core of a
2-core machine: the appliers also pay for their half of the sockets, which is the point.

The reference gets the same events as pre-built JSON through ``RadixTree.apply_event``, timed as
``bench_index.apply_reference`` times it (up to a query its thread answers after the events); its repeats
alternate with kvrouter's 1-shard runs. It neither reads sockets nor re-hashes, for ``ingest_vllm`` too:
kvrouter must keep up anyway. Medians over ``--repeat``.

Ratios, rates kvrouter ÷ reference (> 1: kvrouter better), from 1 shard, the lowest over the worker counts:
``ingest`` (kvrouter-format frames, goal ≥ 3) and ``ingest_vllm`` (vLLM frames, goal ≥ 1.5). The 2-shard
figures are printed and stored beside them. As diagnostics, each worker count also gets, per format, the
in-process rate of the applier's own work (decode + ``ShardWriter.apply_batch``, no process, no socket) and
what its receive costs a message, compiled and through ``recv_multipart`` (``tools/receive_cost.py``), and
each engine run where its CPU went (``CPU_ROLES``, from ``/proc``): with the clock's wall time beside it,
whether the two cores were busy throughout, and with what.

``--wire`` also sends vLLM frames over real ZMQ into ``kvrouter up`` (1 and 2 shards) and the reference's
``python -m dynamo.indexer``, service by service, and adds ``wire_burst_1``, ``wire_burst_2``,
``wire_lag_p99_300k`` and ``wire_bytes_per_block``, and kvrouter's ``find_matches`` latency during a table's
growth against its steady reads (``tools/ingest_wire.py`` says how).

Freshness: a reader process, forked before this process starts any thread, attaches to a 1-shard engine
by handle; this process publishes fresh kvrouter-format sequences from 16 workers at a steady
``FRESHNESS_BLOCKS_PER_S`` for ``--freshness-seconds``, recording each send time; the reader polls
``find_matches`` on each sequence sent and not yet seen, recording when the whole sequence is visible.
Both read ``CLOCK_MONOTONIC`` (``time.monotonic_ns``), one clock for every process on Linux. p50/p99 of
visible - sent, in µs; the reader's poll round (a few queries) bounds the resolution.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from time import monotonic_ns, perf_counter, perf_counter_ns
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt
import zmq
from bench_index import (
    PREFIX_BLOCKS,
    PREFIX_GROUPS,
    SEQUENCE_BLOCKS,
    WORKER_COUNTS,
    Workload,
    _machine,
    _percentile,
    _reference_tree,
    apply_reference,
    in_process_owner,
    leftovers,
    print_ratios,
)
from receive_cost import receive_cost

from kvrouter.engine import Engine, attach
from kvrouter.events.codecs import dynamo as dynamo_codec, vllm
from kvrouter.events.codecs.frames import encode_live
from kvrouter.events.codecs.kvrouter import Decoder, Encoder, RawBatch
from kvrouter.events.model import EngineHash, EventBatch, LocalHash, Stored, StoredBlock, WorkerKey
from kvrouter.hashing import sequence_hashes_array
from kvrouter.hashing.blocks import block_hashes_array
from kvrouter.index.layout import NO_ID, W_DP_RANK, W_IN_USE, W_LAST_ID, W_WORKER_ID, Control, control_name
from kvrouter.index.writer import ShardWriter
from kvrouter.plane import PlaneConfig, WorkerSpec

IngestFormat = Literal["kvrouter", "vllm"]
FORMATS: Final[tuple[IngestFormat, ...]] = ("kvrouter", "vllm")
SHARD_COUNTS: Final = (1, 2)
BLOCK_SIZE: Final = 16
"""Tokens per block, the registered block size (the reference's ``kv_block_size`` default)."""
SEQUENCES: Final = 10_000
QUERY_BLOCKS: Final = 64
SPOT_CHECKS: Final = 200
"""Queries of ``QUERY_BLOCKS`` compared with the reference after every engine run."""
TOPIC: Final = b""
"""vLLM's default topic."""
POLL_S: Final = 0.001
"""This process reads the workers' rows this often while the appliers catch up [s]."""
SUBSCRIBE_TIMEOUT_S: Final = 60.0
APPLY_TIMEOUT_S: Final = 300.0
"""Longest the appliers may take to reach every worker's last frame before the run is failed [s]."""
HWM_MARGIN: Final = 64
IN_PROCESS_WARM: Final = 50
"""Messages of the in-process rate's warm-up pass (it compiles the kernels)."""

FRESHNESS_BLOCKS_PER_S: Final = 20_000
FRESHNESS_SECONDS: Final = 3.0
FRESHNESS_WORKERS: Final = 16
FRESHNESS_LEAD_NS: Final = 100_000_000
"""The schedule starts this long after the reader is told, so it is polling before the first send [ns]."""
FRESHNESS_GRACE_NS: Final = 10_000_000_000
"""The reader gives up on a sequence this long after the schedule's end [ns]."""
FRESHNESS_WARM_SEQUENCES: Final = 50
"""Sequences of the warm-up phase, sent at once and left out of the figures."""
FRESHNESS_SEED_OFFSET: Final = 7919
"""The freshness sequences come from another seed than the ingest workload's."""

QUICK: Final = {
    "sequences": 500,
    "repeat": 1,
    "freshness_seconds": 1.0,
    "wire_frames": 2000,
    "wire_publishers": [4],
    "wire_repeat": 1,
    "wire_rates": [100_000],
}
GOALS: Final = {"ingest": 3.0, "ingest_vllm": 1.5}
"""Issue 33's goals, each a ratio from 1 shard (an earlier issue asked 1 of ``ingest_vllm``)."""
RATIO_KEYS: Final = {"kvrouter": "ingest", "vllm": "ingest_vllm"}


# -- workload -----------------------------------------------------------------------------------


@dataclass
class StoredSequence:
    """One Stored event: its worker, its id among that worker's events, and its blocks."""

    worker: int
    event_id: int
    tokens: npt.NDArray[np.uint32]
    """``[blocks, BLOCK_SIZE]`` token ids."""
    local: list[int]
    engine: list[int]


def build_sequences(workers: int, sequences: int, seed: int) -> list[StoredSequence]:
    """bench_index's shape with token ids: prefix groups of token blocks, then per sequence a group's
    prefix and a unique random suffix, given to a random worker."""
    rng = random.Random(seed * 1_000_003 + workers)
    tokens = np.random.default_rng(seed * 1_000_003 + workers)

    def blocks(n: int) -> npt.NDArray[np.uint32]:
        return tokens.integers(0, 2**32, size=(n, BLOCK_SIZE), dtype=np.uint32)

    groups = [blocks(rng.randint(*PREFIX_BLOCKS)) for _ in range(PREFIX_GROUPS)]
    counts = [0] * workers
    made: list[StoredSequence] = []
    for _ in range(sequences):
        length = rng.randint(*SEQUENCE_BLOCKS)
        prefix = rng.choice(groups)[: length - 1]
        block_tokens = np.concatenate([prefix, blocks(length - len(prefix))])
        local = block_hashes_array(block_tokens.ravel(), BLOCK_SIZE)
        worker = rng.randrange(workers)
        made.append(
            StoredSequence(worker, counts[worker], block_tokens, local.tolist(), sequence_hashes_array(local).tolist())
        )
        counts[worker] += 1
    return made


def stored_event(sequence: StoredSequence) -> Stored:
    blocks = tuple(
        StoredBlock(EngineHash(s), LocalHash(h), tuple(t))
        for s, h, t in zip(sequence.engine, sequence.local, sequence.tokens.tolist(), strict=True)
    )
    return Stored(worker_id=sequence.worker, parent=None, blocks=blocks, event_id=sequence.event_id)


@dataclass
class IngestWorkload:
    """One worker count's events in every encoding."""

    base: Workload
    """bench_index's: kvrouter batches (the in-process rate), the reference's JSON, counts, probe queries."""
    frames: dict[str, list[tuple[int, list[bytes]]]]
    """Per format, (worker, live frames) in workload order."""
    vllm_payloads: list[bytes]
    last_ids: list[int]
    """Per worker: the seq / event id of its last frame (``NO_ID``: it publishes nothing)."""


def build_workload(workers: int, sequences: int, seed: int) -> IngestWorkload:
    made = build_sequences(workers, sequences, seed)
    kvrouter_encoder, vllm_encoder, reference_encoder = Encoder(), vllm.Encoder(), dynamo_codec.Encoder()
    events: list[tuple[WorkerKey, bytes]] = []
    reference_events: list[tuple[int, bytes]] = []
    frames: dict[str, list[tuple[int, list[bytes]]]] = {name: [] for name in FORMATS}
    vllm_payloads: list[bytes] = []
    last_ids = [NO_ID] * workers
    distinct: set[int] = set()
    for sequence in made:
        event = stored_event(sequence)
        batch = EventBatch((event,), timestamp=0.0, dp_rank=0)
        payload = kvrouter_encoder.encode(batch)
        engine_payload = vllm_encoder.encode(batch)
        events.append(((sequence.worker, 0), payload))
        reference_events.append((sequence.worker, reference_encoder.encode_event(event)))
        frames["kvrouter"].append((sequence.worker, encode_live(TOPIC, sequence.event_id, payload)))
        frames["vllm"].append((sequence.worker, encode_live(TOPIC, sequence.event_id, engine_payload)))
        vllm_payloads.append(engine_payload)
        last_ids[sequence.worker] = sequence.event_id
        distinct.update(sequence.engine)
    rng = random.Random(seed)
    queries: list[list[int]] = []
    for i in range(SPOT_CHECKS):
        base = rng.choice(made).local[:QUERY_BLOCKS]
        if i % 2:  # half diverge from a stored sequence at a uniformly random block
            base = base[: rng.randrange(len(base))]
        queries.append(base + [rng.getrandbits(64) for _ in range(QUERY_BLOCKS - len(base))])
    blocks = sum(len(s.local) for s in made)
    base_workload = Workload(workers, events, reference_events, blocks, len(distinct), {QUERY_BLOCKS: queries})
    return IngestWorkload(base_workload, frames, vllm_payloads, last_ids)


# -- the engine side ----------------------------------------------------------------------------


class Publishers:
    """One XPUB per worker, bound in this process, standing in for the engines' PUB sockets. An XPUB reads
    the subscription, so sending waits for it instead of losing frames to the slow joiner."""

    def __init__(self, workers: int, hwm: int) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sockets: list[zmq.Socket[bytes]] = []
        try:
            for _ in range(workers):
                socket = self.context.socket(zmq.XPUB)
                self.sockets.append(socket)
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.SNDHWM, hwm)  # before bind: every subscriber's pipe gets it
                socket.bind("tcp://127.0.0.1:*")
        except BaseException:
            self.close()
            raise
        self.endpoints = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in self.sockets]

    def wait_subscribed(self, timeout: float) -> None:
        poller = zmq.Poller()
        for socket in self.sockets:
            poller.register(socket, zmq.POLLIN)
        waiting = set(self.sockets)
        deadline = perf_counter() + timeout
        while waiting:
            left = deadline - perf_counter()
            if left <= 0:
                raise SystemExit(f"bench_ingest: {len(waiting)} of {len(self.sockets)} workers never subscribed")
            for socket, _ in poller.poll(int(left * 1000) + 1):
                message = socket.recv()
                if message[:1] == b"\x01":
                    waiting.discard(socket)

    def close(self) -> None:
        for socket in self.sockets:
            socket.close(linger=0)
        self.context.term()


class Progress:
    """Every worker's ``last_id`` word, read straight from the control segment's rows."""

    def __init__(self, control: Control, last_ids: list[int]) -> None:
        self.views: list[tuple[npt.NDArray[np.uint64], npt.NDArray[np.intp], npt.NDArray[np.uint64]]] = []
        found: set[int] = set()
        for shard in range(control.shards):
            rows = control.worker_rows(shard)
            used = np.flatnonzero((rows[:, W_IN_USE] != 0) & (rows[:, W_DP_RANK] == 0))
            ids = rows[used, W_WORKER_ID].tolist()
            found.update(ids)
            expected = np.array([last_ids[i] for i in ids], dtype=np.uint64)
            self.views.append((rows, used, expected))
        if found != set(range(len(last_ids))):
            raise SystemExit(f"bench_ingest: rows for {len(found)} of {len(last_ids)} workers")

    def done(self) -> bool:
        return all(np.array_equal(rows[used, W_LAST_ID], expected) for rows, used, expected in self.views)


CPU_ROLES: Final = ("sender", "applier", "applier_zmq_io", "growth_helpers")
"""Where a run's CPU goes: this process (the publishers, their ZMQ I/O thread), each applier's main thread,
its ZMQ I/O thread, and its other threads (the growth helpers)."""


def thread_cpu(appliers: list[int]) -> dict[str, float]:
    """CPU seconds so far (user + system) of this process and of the applier processes, by ``CPU_ROLES``."""
    tick = os.sysconf("SC_CLK_TCK")
    used = dict.fromkeys(CPU_ROLES, 0.0)
    for pid in [os.getpid(), *appliers]:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    name, ticks = proc_stat(Path(f"/proc/{pid}/task/{tid}/stat"))
                    if pid == os.getpid():
                        role = "sender"
                    elif int(tid) == pid:
                        role = "applier"
                    elif name.startswith("ZMQbg"):
                        role = "applier_zmq_io"
                    else:
                        role = "growth_helpers"
                    used[role] += ticks / tick
    return used


def check_workers(engine: Engine, workload: IngestWorkload) -> list[str]:
    """What the worker rows show wrong after a run: gaps, bad frames, missing events."""
    counts = [0] * workload.base.workers
    for worker, _ in workload.frames["kvrouter"]:
        counts[worker] += 1
    problems = []
    rows = engine.workers()
    for worker, count in enumerate(counts):
        row = rows.get((worker, 0))
        if row is None:
            problems.append(f"worker {worker}: no row")
            continue
        last = None if workload.last_ids[worker] == NO_ID else workload.last_ids[worker]
        if row.gaps_detected or row.bad_frames or row.events != count or row.last_id != last:
            problems.append(
                f"worker {worker}: gaps {row.gaps_detected}, bad frames {row.bad_frames}, "
                f"events {row.events} of {count}, last id {row.last_id} (expected {last})"
            )
    return problems


def spot_check(engine: Engine, tree: Any, queries: list[list[int]]) -> int:
    """Answers that differ from the reference's."""
    mismatches = 0
    for query in queries:
        answer, expected = engine.find_matches(query), tree.find_matches(query).scores
        if answer != expected:
            mismatches += 1
            if mismatches <= 3:
                print(f"mismatch: kvrouter {sorted(answer.items())[:4]} reference {sorted(expected.items())[:4]}")
    return mismatches


def ingest_engine(workload: IngestWorkload, fmt: IngestFormat, shards: int, tree: Any) -> dict[str, Any]:
    """One fresh engine following every worker over ZMQ: the time from the first send until every worker's
    last frame is applied, then the checks."""
    base = workload.base
    frames = workload.frames[fmt]
    with Engine(shards=shards) as engine:
        publishers = Publishers(base.workers, len(frames) + HWM_MARGIN)
        try:
            for worker, endpoint in enumerate(publishers.endpoints):
                engine.add_worker(WorkerSpec(worker, endpoint, format=fmt, block_size=BLOCK_SIZE))
            publishers.wait_subscribed(SUBSCRIBE_TIMEOUT_S)
            control = Control.attach(engine.reader_handle().control_name)
            try:
                progress = Progress(control, workload.last_ids)
                sends = [(publishers.sockets[worker].send_multipart, message) for worker, message in frames]
                appliers = [control.pid(shard) for shard in range(shards)]
                cpu_before = thread_cpu(appliers)
                start = perf_counter_ns()
                for send, message in sends:  # hot path
                    send(message)
                sent = perf_counter_ns()
                deadline = perf_counter() + APPLY_TIMEOUT_S
                while not progress.done():
                    if perf_counter() > deadline:
                        raise SystemExit(
                            f"bench_ingest: {fmt} {shards} shard(s): not applied after {APPLY_TIMEOUT_S} s: "
                            + "; ".join(check_workers(engine, workload)[:5])
                        )
                    time.sleep(POLL_S)
                seconds = (perf_counter_ns() - start) / 1e9
                cpu_after = thread_cpu(appliers)
            finally:
                control.close()
        finally:
            publishers.close()
        problems = check_workers(engine, workload)
        rows = engine.workers().values()
        mismatches = spot_check(engine, tree, base.queries[QUERY_BLOCKS])
    return {
        "events_applied": sum(row.events for row in rows),
        "gaps_detected": sum(row.gaps_detected for row in rows),
        "bad_frames": sum(row.bad_frames for row in rows),
        "seconds": seconds,
        "send_seconds": (sent - start) / 1e9,
        "cpu_s": {role: cpu_after[role] - cpu_before[role] for role in CPU_ROLES},
        "events_per_s": len(frames) / seconds,
        "blocks_per_s": base.blocks / seconds,
        "problems": problems,
        "mismatches": mismatches,
        "compared": len(base.queries[QUERY_BLOCKS]),
    }


def apply_in_process(workload: IngestWorkload, fmt: IngestFormat) -> float:
    """Blocks/s of the applier's own work per message, decode (for vLLM: re-hash included) and
    ``ShardWriter.apply_batch``, in this process: no sockets, no stream checks. A first pass over a few
    messages into a throwaway writer compiles the kernels here, before any engine forks."""
    decoders: list[Callable[[bytes], RawBatch]]
    if fmt == "kvrouter":
        decoders = [Decoder().decode_raw] * workload.base.workers
    else:
        decoders = [vllm.Decoder(worker, BLOCK_SIZE).decode_raw for worker in range(workload.base.workers)]
    messages = [(decoders[worker], frames[2]) for worker, frames in workload.frames[fmt]]
    rate = 0.0
    for timed in (messages[:IN_PROCESS_WARM], messages):
        owner = in_process_owner()
        control = Control.create(control_name(owner), 1)
        try:
            writer = ShardWriter(control, 0, owner)
            try:
                apply_batch = writer.apply_batch
                start = perf_counter_ns()
                for decode, payload in timed:  # hot path: what the applier does per message
                    batch = decode(payload)
                    apply_batch((batch.worker_id, batch.dp_rank), batch.events)
                rate = workload.base.blocks / ((perf_counter_ns() - start) / 1e9)
            finally:
                writer.close(unlink=True)
        finally:
            control.close()
            control.unlink()
    return rate


# -- freshness ----------------------------------------------------------------------------------


Query = tuple[WorkerKey, list[int]]
"""A sequence the reader waits for: whole for this worker once applied."""


def watch_visible(
    find: Callable[[list[int]], dict[WorkerKey, int]], queries: list[Query], offsets: list[int], t0: int
) -> list[int]:
    """When each query became whole for its worker (``monotonic_ns``; 0: never), polling each from its send
    time ``t0 + offsets[i]`` on. Waits (sleeping) for the next send while nothing is pending."""
    n = len(queries)
    visible = [0] * n
    pending: list[int] = []
    next_i = found = 0
    deadline = t0 + offsets[-1] + FRESHNESS_GRACE_NS
    while found < n:  # hot path
        now = monotonic_ns()
        if now > deadline:
            break
        while next_i < n and t0 + offsets[next_i] <= now:
            pending.append(next_i)
            next_i += 1
        if not pending:
            if next_i < n:
                time.sleep(max(0, t0 + offsets[next_i] - now) / 1e9)
            continue
        still = []
        for i in pending:
            key, local = queries[i]
            if find(local).get(key, 0) == len(local):
                visible[i] = monotonic_ns()
                found += 1
            else:
                still.append(i)
        pending = still
        os.sched_yield()
    return visible


def _freshness_reader(conn: Connection) -> None:
    """The forked reader. Told the handle and both phases' sequences, it answers ``ready``; then for each phase
    it is told the schedule's start, watches that phase's sequences and sends back when each became visible."""
    try:
        message = conn.recv()
        if message is None:
            return
        handle, phases = message
        reader = attach(handle)
        try:
            find = reader.find_matches
            conn.send("ready")
            for queries, offsets in phases:
                t0 = conn.recv()
                if t0 is None:
                    return
                conn.send(watch_visible(find, queries, offsets, t0))
        finally:
            reader.close()
    finally:
        conn.close()


def start_freshness_reader() -> tuple[multiprocessing.process.BaseProcess, Connection]:
    """Fork the reader now, before this process starts any thread (zmq, the reference, the engine's)."""
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    process = context.Process(target=_freshness_reader, args=(theirs,), daemon=True)
    process.start()
    theirs.close()
    return process, ours


def paced_send(
    sockets: list[zmq.Socket[bytes]], items: list[tuple[int, list[bytes]]], offsets: list[int], t0: int
) -> list[int]:
    """Send ``items[i]`` at ``t0 + offsets[i]`` (or as soon after as the sleep allows); the send times."""
    sent = [0] * len(items)
    for i, (worker, message) in enumerate(items):  # hot path: paced sends
        wait = t0 + offsets[i] - monotonic_ns()
        if wait > 0:
            time.sleep(wait / 1e9)
        sent[i] = monotonic_ns()
        sockets[worker].send_multipart(message)
    return sent


def reader_answer(conn: Connection, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise SystemExit("bench_ingest: the freshness reader did not answer")
    return conn.recv()


def run_freshness(
    process: multiprocessing.process.BaseProcess, conn: Connection, seconds: float, seed: int
) -> dict[str, Any]:
    """Publish kvrouter-format sequences at ``FRESHNESS_BLOCKS_PER_S`` for ``seconds``; p50/p99 send → visible.

    A warm-up phase goes first: ``FRESHNESS_WARM_SEQUENCES`` sent at once, watched by the reader until all are
    visible (an applier's and a reader's first messages load code and grow tables from empty); it is reported
    apart, with when the applier's rows and when the reader saw it."""
    rough = int(seconds * FRESHNESS_BLOCKS_PER_S / (sum(SEQUENCE_BLOCKS) / 2)) + 1
    made = build_sequences(FRESHNESS_WORKERS, FRESHNESS_WARM_SEQUENCES + rough, seed + FRESHNESS_SEED_OFFSET)
    encoder = Encoder()
    items = [
        (s.worker, encode_live(TOPIC, s.event_id, encoder.encode(EventBatch((stored_event(s),), 0.0, 0)))) for s in made
    ]
    queries: list[Query] = [((s.worker, 0), s.local) for s in made]
    warm_items, items = items[:FRESHNESS_WARM_SEQUENCES], items[FRESHNESS_WARM_SEQUENCES:]
    warm_queries, queries = queries[:FRESHNESS_WARM_SEQUENCES], queries[FRESHNESS_WARM_SEQUENCES:]
    offsets: list[int] = []
    blocks = 0
    for _, local in queries:
        offsets.append(int(blocks * 1e9 / FRESHNESS_BLOCKS_PER_S))
        blocks += len(local)
    last_ids = [NO_ID] * FRESHNESS_WORKERS
    for s in made[:FRESHNESS_WARM_SEQUENCES]:
        last_ids[s.worker] = s.event_id
    with Engine(shards=1) as engine:
        publishers = Publishers(FRESHNESS_WORKERS, len(made) + HWM_MARGIN)
        try:
            for worker, endpoint in enumerate(publishers.endpoints):
                engine.add_worker(WorkerSpec(worker, endpoint, format="kvrouter", block_size=BLOCK_SIZE))
            publishers.wait_subscribed(SUBSCRIBE_TIMEOUT_S)
            warm_offsets = [0] * len(warm_items)
            conn.send((engine.reader_handle(), [(warm_queries, warm_offsets), (queries, offsets)]))
            if reader_answer(conn, SUBSCRIBE_TIMEOUT_S) != "ready":
                raise SystemExit("bench_ingest: the freshness reader did not get ready")
            control = Control.attach(engine.reader_handle().control_name)
            try:
                progress = Progress(control, last_ids)
                t0 = monotonic_ns()
                conn.send(t0)
                warm_sent = paced_send(publishers.sockets, warm_items, warm_offsets, t0)
                while not progress.done() and monotonic_ns() < t0 + FRESHNESS_GRACE_NS:
                    time.sleep(POLL_S / 10)
                warm_applied = monotonic_ns()
            finally:
                control.close()
            warm_visible: list[int] = reader_answer(conn, FRESHNESS_GRACE_NS / 1e9 + 30)
            t0 = monotonic_ns() + FRESHNESS_LEAD_NS
            conn.send(t0)
            sent = paced_send(publishers.sockets, items, offsets, t0)
            visible: list[int] = reader_answer(conn, FRESHNESS_GRACE_NS / 1e9 + 30)
        finally:
            publishers.close()
    process.join(30)
    latencies = [(v - s) / 1000 for v, s in zip(visible, sent, strict=True) if v]
    span = (sent[-1] - sent[0]) / 1e9 if len(sent) > 1 else 0.0
    return {
        "target_blocks_per_s": FRESHNESS_BLOCKS_PER_S,
        "achieved_blocks_per_s": (blocks - len(queries[-1][1])) / span if span else 0.0,
        "seconds": span,
        "sequences": len(sent),
        "blocks": blocks,
        "workers": FRESHNESS_WORKERS,
        "missing": len(sent) - len(latencies),
        "p50_us": statistics.median(latencies) if latencies else float("nan"),
        "p99_us": _percentile(latencies, 0.99) if latencies else float("nan"),
        "max_us": max(latencies, default=float("nan")),
        "warm_up_applied_us": (warm_applied - warm_sent[0]) / 1000,
        "warm_up_visible_us": (max(warm_visible) - warm_sent[0]) / 1000 if all(warm_visible) else float("nan"),
    }


def stop_reader(process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
    """End the reader if the freshness run did not (it waits on its first message)."""
    if process.is_alive():
        with contextlib.suppress(OSError):
            conn.send(None)
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
    conn.close()


# -- the run ------------------------------------------------------------------------------------


def median_of(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "events_per_s": statistics.median(s["events_per_s"] for s in samples),
        "blocks_per_s": statistics.median(s["blocks_per_s"] for s in samples),
        "samples_blocks_per_s": [s["blocks_per_s"] for s in samples],
        "send_seconds": statistics.median(s["send_seconds"] for s in samples),
        "seconds": statistics.median(s["seconds"] for s in samples),
        "cpu_s": {role: statistics.median(s["cpu_s"][role] for s in samples) for role in CPU_ROLES},
        "events_applied": [s["events_applied"] for s in samples],
        "gaps_detected": sum(s["gaps_detected"] for s in samples),
        "bad_frames": sum(s["bad_frames"] for s in samples),
        "problems": [p for s in samples for p in s["problems"]],
        "mismatches": sum(s["mismatches"] for s in samples),
        "compared": sum(s["compared"] for s in samples),
    }


def run_workers(workload: IngestWorkload, args: argparse.Namespace) -> dict[str, Any]:
    """Both formats at every shard count for one worker count, plus the reference; the reference's repeats
    alternate with kvrouter's 1-shard runs."""
    make_tree = _reference_tree()
    base = workload.base
    in_process = {fmt: apply_in_process(workload, fmt) for fmt in FORMATS}
    limit = PlaneConfig().max_message_bytes
    receive = {fmt: receive_cost([f for _, f in workload.frames[fmt]], TOPIC, limit) for fmt in FORMATS}
    reference: list[float] = []
    runs: dict[IngestFormat, dict[int, list[dict[str, Any]]]] = {fmt: {s: [] for s in args.shards} for fmt in FORMATS}
    tree: Any = None
    first = args.shards[0]
    for _ in range(args.repeat):
        tree = None  # the previous tree goes before the next is built
        tree, rate = apply_reference(make_tree, base)
        reference.append(rate)
        for fmt in FORMATS:
            runs[fmt][first].append(ingest_engine(workload, fmt, first, tree))
    for shards in args.shards[1:]:
        for _ in range(args.repeat):
            for fmt in FORMATS:
                runs[fmt][shards].append(ingest_engine(workload, fmt, shards, tree))
    del tree
    reference_blocks = statistics.median(reference)
    return {
        "workers": base.workers,
        "events": len(base.events),
        "blocks": base.blocks,
        "distinct_blocks": base.distinct_blocks,
        "in_process_blocks_per_s": in_process,
        "receive_us_per_message": receive,
        "reference": {
            "blocks_per_s": reference_blocks,
            "events_per_s": reference_blocks * len(base.events) / base.blocks,
            "samples_blocks_per_s": reference,
        },
        "formats": {
            fmt: {str(s): median_of(samples) for s, samples in by_shards.items()} for fmt, by_shards in runs.items()
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    configs: dict[str, Any] = {}
    for workers in args.workers:
        build_start = perf_counter()
        workload = build_workload(workers, args.sequences, args.seed)
        print(f"{workers} workers: workload encoded in {perf_counter() - build_start:.1f} s", flush=True)
        configs[f"w{workers}"] = run_workers(workload, args)
    detail = {
        key: {
            shards: {
                RATIO_KEYS[fmt]: config["formats"][fmt][shards]["blocks_per_s"] / config["reference"]["blocks_per_s"]
                for fmt in FORMATS
            }
            for shards in config["formats"][FORMATS[0]]
        }
        for key, config in configs.items()
    }
    basis = str(args.shards[0])
    ratios = {key: min(detail[config][basis][key] for config in configs) for key in GOALS}
    return {
        "configs": configs,
        "ratios": ratios,
        "ratio_basis": (
            f"{basis} shard(s); blocks/s kvrouter ÷ reference, the lowest over worker counts {list(args.workers)}"
        ),
        "ratios_by_config": detail,
        "goals": dict(GOALS),
        "goals_met": {key: ratios[key] >= goal for key, goal in GOALS.items()},
    }


def failures_of(result: dict[str, Any]) -> list[str]:
    failures = []
    for key, config in result["configs"].items():
        for fmt, by_shards in config["formats"].items():
            for shards, row in by_shards.items():
                where = f"{key} {fmt} {shards} shard(s)"
                failures += [f"{where}: {p}" for p in row["problems"]]
                if row["mismatches"]:
                    failures.append(f"{where}: {row['mismatches']} of {row['compared']} answers differ")
    freshness = result.get("freshness")
    if freshness and freshness["missing"]:
        failures.append(f"freshness: {freshness['missing']} sequences never became visible")
    return failures


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{'ingest':<12} {'W':>4} {'shards':>6} {'kvrouter Mblk/s':>15} {'k events/s':>10} "
        f"{'reference':>10} {'ratio':>6} {'send s':>6} {'in-process Mblk/s':>17}"
    )
    for config in result["configs"].values():
        reference = config["reference"]["blocks_per_s"] / 1e6
        for fmt in FORMATS:
            for shards, row in config["formats"][fmt].items():
                rate = row["blocks_per_s"] / 1e6
                print(
                    f"{fmt:<12} {config['workers']:>4} {shards:>6} {rate:>15.2f} {row['events_per_s'] / 1e3:>10.1f} "
                    f"{reference:>10.2f} {rate / reference:>6.2f} {row['send_seconds']:>6.2f} "
                    f"{config['in_process_blocks_per_s'][fmt] / 1e6:>17.2f}"
                )
        for fmt in FORMATS:
            for shards, row in config["formats"][fmt].items():
                print(
                    f"{'':<12} {config['workers']:>4} {fmt} frames, {shards} shard(s), CPU during the run (s, medians; "
                    f"the run {row['seconds']:.2f} s on {os.cpu_count()} CPUs): "
                    + ", ".join(f"{role} {seconds:.2f}" for role, seconds in row["cpu_s"].items())
                )
        for fmt, ways in config["receive_us_per_message"].items():
            print(
                f"{'':<12} {config['workers']:>4} receive, {fmt} frames (µs a message): "
                + ", ".join(f"{way} {us:.2f}" for way, us in ways.items())
            )
        print(
            f"{'':<12} {config['workers']:>4} reference {config['reference']['events_per_s'] / 1e3:.1f} k events/s; "
            f"{config['events']} events, {config['blocks']:,} block-applies, "
            f"{config['distinct_blocks']:,} distinct blocks"
        )
    freshness = result.get("freshness")
    if freshness:
        print()
        print(
            f"freshness (kvrouter frames, {freshness['workers']} workers, 1 shard, target "
            f"{freshness['target_blocks_per_s']:,} blocks/s, achieved {freshness['achieved_blocks_per_s']:,.0f} over "
            f"{freshness['seconds']:.1f} s, {freshness['sequences']} sequences): send → visible in another process "
            f"p50 {freshness['p50_us']:.0f} µs, p99 {freshness['p99_us']:.0f} µs, max {freshness['max_us']:.0f} µs"
            + (f", {freshness['missing']} never visible" if freshness["missing"] else "")
        )
        print(
            f"  warm-up before it ({FRESHNESS_WARM_SEQUENCES} sequences at once, left out): applied (control rows) "
            f"{freshness['warm_up_applied_us'] / 1000:.1f} ms, visible to the reader "
            f"{freshness['warm_up_visible_us'] / 1000:.1f} ms after the first send"
        )
    if "wire" in result:
        from ingest_wire import print_lag, print_wire

        print()
        print_wire(result)
        print_lag(result)
    print()
    print_ratios(result, width=20)
    for key, by_shards in result["ratios_by_config"].items():
        for shards, ratios in by_shards.items():
            print(f"  {key} {shards} shard(s): " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    compared = sum(
        row["compared"] for c in result["configs"].values() for f in c["formats"].values() for row in f.values()
    )
    failures = failures_of(result)
    print(f"correctness: {compared} answers compared with the reference; {len(failures)} problems")
    for failure in failures[:10]:
        print(f"  {failure}")


# -- main ---------------------------------------------------------------------------------------


def proc_stat(path: Path) -> tuple[str, int]:
    """A process's or thread's name and CPU time so far (user + system, clock ticks), from its ``stat``."""
    text = path.read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return text[text.index("(") + 1 : text.rindex(")")], int(fields[11]) + int(fields[12])


def cpu_ticks() -> dict[int, tuple[str, int]]:
    """Every process's name and CPU time so far (user + system, clock ticks)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            found[int(entry)] = proc_stat(Path(f"/proc/{entry}/stat"))
        except OSError:
            continue
    return found


def busy_others(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], ours: set[int]) -> list[str]:
    """The processes other than this run's that took the most CPU during it (one started meanwhile counts
    all its CPU time; one that ended meanwhile is missed)."""
    tick = os.sysconf("SC_CLK_TCK")
    used = [
        (ticks - before.get(pid, (name, 0))[1], name, pid)
        for pid, (name, ticks) in after.items()
        if pid not in ours and ticks > before.get(pid, (name, 0))[1]
    ]
    return [f"{name}[{pid}] {delta / tick:.1f} s" for delta, name, pid in sorted(used, reverse=True)[:4]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, nargs="+", default=list(WORKER_COUNTS), help="worker counts")
    parser.add_argument(
        "--shards", type=int, nargs="+", default=list(SHARD_COUNTS), help="shard counts; ratios use the first"
    )
    parser.add_argument("--sequences", type=int, default=SEQUENCES, help="Stored events (one sequence each)")
    parser.add_argument("--repeat", type=int, default=3, help="repeats per side, format and shard count (median)")
    parser.add_argument("--freshness-seconds", type=float, default=FRESHNESS_SECONDS, help="0: skip freshness")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--quick", action="store_true", help=f"a tiny workload, for tests: {QUICK}")
    parser.add_argument(
        "--wire", action="store_true", help="also the same vLLM frames over ZMQ into kvrouter up and dynamo.indexer"
    )
    parser.add_argument("--wire-repeat", type=int, default=2, help="--wire repeats per service (order alternated)")
    parser.add_argument("--wire-frames", type=int, default=20_000, help="--wire sequences per burst")
    parser.add_argument(
        "--wire-rates", type=int, nargs="+", default=[100_000, 300_000, 1_000_000], help="--wire steady blocks/s"
    )
    parser.add_argument(
        "--wire-publishers", type=int, nargs="+", default=[16, 64], help="--wire publisher counts; ratios use the first"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    reader, conn = start_freshness_reader()  # before any thread: zmq's, the reference's, the engine's
    before = _machine()
    ticks = cpu_ticks()
    started = perf_counter()
    try:
        result = run(args)
        if args.freshness_seconds > 0:
            result["freshness"] = run_freshness(reader, conn, args.freshness_seconds, args.seed)
    finally:
        stop_reader(reader, conn)
    if args.wire:
        from ingest_wire import WIRE_GOALS, run_wire

        wire = run_wire(args.wire_repeat, args.seed, args.wire_publishers, args.wire_frames, args.wire_rates)
        result["wire"], result["wire_lag"] = wire["wire"], wire["wire_lag"]
        result["ratios"].update(wire["wire_ratios"])
        result["goals"].update({key: goal for key, goal in WIRE_GOALS.items() if key in wire["wire_ratios"]})
        result["goals_met"] = {key: result["ratios"][key] >= goal for key, goal in result["goals"].items()}
    print_table(result)
    after = _machine()
    others = busy_others(ticks, cpu_ticks(), {os.getpid(), reader.pid or 0})
    print(
        f"machine: {after['cpu_count']} CPUs; load average (1/5/15 min) {before['loadavg']} before, "
        f"{after['loadavg']} after; busiest other processes during the run: {', '.join(others) or 'none'}; "
        f"python {sys.version.split()[0]}; {args.sequences} sequences, median of {args.repeat}, seed {args.seed}; "
        f"{perf_counter() - started:.0f} s"
    )
    status = 1 if failures_of(result) else 0
    left = leftovers()
    print(f"shm: {'clean' if not left else 'left behind: ' + ', '.join(left)}")
    if left:
        status = 1
    if args.json:
        figures = {
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "machine": {"before": before, "after": after, "busiest_others": others},
            **result,
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
