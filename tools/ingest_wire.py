"""``bench_ingest.py --wire``: vLLM frames over real ZMQ into ``kvrouter up`` and ``python -m dynamo.indexer``.

For each publisher count (``--wire-publishers``: 16 and 64), ``--wire-frames`` (20,000) sequences of ``bench_ingest``'s
shape (32-128 blocks of 16 token ids, prefix groups shared) are encoded once as vLLM 0.33 frames, one
``[topic, seq, payload]`` per sequence, each sequence to a random publisher. Then, one service at a time
(``kvrouter up --mock-workers 0`` with 1 shard, with 2 shards, and the reference's standalone indexer at
its default 4 threads), alternating the order over ``--wire-repeat`` repeats:

1. the service starts and answers ``/health`` (kvrouter: its index up);
2. one XPUB per publisher binds in this process; every publisher is registered with the same
   ``/register`` body (kvrouter adds ``"format": "vllm"``); the run waits until each XPUB has read its
   subscription;
3. the PSS of the service's process tree is read (workers registered, nothing stored);
4. the clock starts, every frame is sent in workload order, then ``/query`` is asked, over one kept-alive
   connection, for each publisher's last sequence, the last sent first, every ``BURST_POLL_S`` until it
   answers it whole on its instance, then at once for the next; when every one has, the clock stops. Each of
   those queries is timed: the ``/query`` latency while the service ingests;
5. ``PSS_SETTLE_S`` later, the PSS is read again; the index's bytes per block is its growth over the
   (publisher, block) entries the burst stored.

Then, for the first publisher count and each ``--wire-rates`` (100k, 300k, 1M blocks/s), a fresh start
of each service gets the frames at that steady rate for up to ``LAG_SECONDS`` (a thread paces them) while
this thread asks ``/query``, every ``QUERY_GAP_S``, for the first publisher's latest sent sequence; once it
answers whole, every sequence that publisher sent up to it is visible: send-to-visible lag per sequence
(a query and its gap, 1-2 ms, bound the resolution), and the CPU the service's processes used meanwhile
(from ``/proc``: what ingesting at that rate costs the host, per block offered). Sequences still unseen
``VISIBLE_TIMEOUT_S`` after the end mean the service fell behind. Meanwhile, against kvrouter, a reader
process of its own times ``find_matches`` of that publisher's first sequence every 0.5 ms, each read filed
by whether a shard's table was growing around it (``tools/growth_reads.py``): issue 33's read goals. The
steady runs are repeated and alternated as the bursts are, each figure the median over the repeats (one
run's p99 is its seven worst sequences).

Both services parse the frames, hash the token ids and build their index; kvrouter's 2-shard run splits
the publishers over two appliers. This process sends on one core while the service has the other.
Ratios (above 1: kvrouter better): ``wire_burst_1`` and ``wire_burst_2`` (blocks/s with 16 publishers,
kvrouter with 1 or 2 shards ÷ the reference), ``wire_lag_p99_300k`` (the reference's p99 lag ÷ kvrouter's,
1 shard, 300k blocks/s; a side that fell behind counts as infinite) and ``wire_bytes_per_block`` (the
reference's ÷ kvrouter's, 16 publishers, 1 shard).
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from time import perf_counter
from typing import Any, Final

from bench_index import percentiles, rollup
from bench_ingest import (
    BLOCK_SIZE,
    HWM_MARGIN,
    SUBSCRIBE_TIMEOUT_S,
    TOPIC,
    Publishers,
    StoredSequence,
    build_sequences,
    stored_event,
)
from bench_service import (
    START_TIMEOUT,
    Server,
    free_port,
    process_family,
    process_ticks,
    stop,
    stopped_on_failure,
    tail,
    wait_http,
)
from growth_reads import goals, growth_reads

from kvrouter.events.codecs import vllm
from kvrouter.events.codecs.frames import encode_live
from kvrouter.events.model import EventBatch

MODEL: Final = "bench"
VISIBLE_TIMEOUT_S: Final = 300.0
PSS_SETTLE_S: Final = 2.0
"""How long after the burst's last sequence shows the PSS is read again, for every service alike: the
memory a burst leaves behind (the index), not what a service frees once it is done: kvrouter's applier
gives its receive buffers back when it idles (``index/heap.py``), and unmaps a grown table's predecessor
``RETIRE_S`` (1 s) after the successor is published, so that readers still in it finish. At 1 s, two of
seven 16-publisher bursts read 175 bytes an entry instead of 141-143, the old table still mapped when a
growth had ended in the burst's last second; at 2 s seven of seven read 141-143, and the reference's
figure (165-192) did not move either way (three runs each, 2026-12-07)."""
QUERY_GAP_S: Final = 0.001
"""The pause between two rounds of queries (the lag's, and the burst's asking whether every last sequence shows):
the resolution, against the load the queries add; without it the burst's client and the service's HTTP front
took a core between them, on a two-core machine."""
BURST_POLL_S: Final = 0.005
"""How often the burst's wait asks again while the publisher it waits for has not shown: one query in flight,
every 5 ms (0.4 % of a 1.2 s burst). Asking every publisher in rounds 1 ms apart asked kvrouter's fast
``/query`` 760 times in a 1.2 s burst and the reference's slow one 30 times: the measuring load fell on
the faster service, on the two cores both share."""
WATCHED: Final = 0
"""The publisher whose sequences the steady runs time."""
LAG_RATIO_RATE: Final = 300_000
LAG_SECONDS: Final = 3.0
"""How long each steady run offers its rate (less when the burst's frames run out first)."""
WIRE_GOALS: Final = {"wire_burst_1": 1.5, "wire_burst_2": 2.5, "wire_lag_p99_300k": 1.0, "wire_bytes_per_block": 1.0}
"""Issue 33's goals (the bytes per block: "at or below the reference's")."""
SIDES: Final = ("kvrouter-1", "kvrouter-2", "reference")
"""Each service of a repeat: kvrouter with that many shards, and the reference's indexer."""


class Burst:
    """One publisher count's frames, their sequences, and each publisher's last sequence."""

    def __init__(self, publishers: int, frames: int, seed: int) -> None:
        made = build_sequences(publishers, frames, seed)
        encoder = vllm.Encoder()
        self.publishers = publishers
        self.frames = [
            (s.worker, encode_live(TOPIC, s.event_id, encoder.encode(EventBatch((stored_event(s),), timestamp=0.0))))
            for s in made
        ]
        self.blocks = sum(len(s.local) for s in made)
        self.entries = len({(s.worker, h) for s in made for h in s.engine})
        last = {s.worker: (sent, s) for sent, s in enumerate(made)}
        self.last_sent = [(worker, s) for worker, (_, s) in sorted(last.items(), key=lambda item: item[1][0])]
        """Each publisher and its last sequence, in the order they were sent: the burst's wait asks the last first."""
        self.most = max(sum(1 for w, _ in self.frames if w == worker) for worker in range(publishers))
        self.sequences = made


def start(side: str, folder: Path) -> Server:
    port = free_port()
    log = folder / f"{side}.log"
    if side == "reference":
        command = [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--block-size", str(BLOCK_SIZE)]
    else:
        shards = side.rsplit("-", 1)[1]
        command = [sys.executable, "-m", "kvrouter", "up", "--mock-workers", "0", "--shards", shards]
        command += ["--host", "127.0.0.1", "--port", str(port), "--zmq-port", str(free_port())]
    with log.open("wb") as out:
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(side, f"http://127.0.0.1:{port}", process, log)
    with stopped_on_failure(server):
        wait_http(server, "/health", START_TIMEOUT)
        if side != "reference":  # the index up: a first run compiles its kernels
            wait_http(server, "/ready", START_TIMEOUT, lambda _, body: "engine starting" not in str(body))
    return server


def tree_pss(root: int) -> int:
    """PSS of ``root`` and every descendant, in bytes: a page shared among them counts once in all."""
    return sum(rollup(pid, "Pss") for pid in process_family(root))


class Queries:
    """``POST /query`` over one kept-alive connection, each call timed."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=30)
        self.latencies_ms: list[float] = []

    def shows(self, sequence: StoredSequence, instance: int) -> bool:
        """Whether ``/query`` answers the whole sequence on the instance (in blocks or in tokens: the
        services count differently)."""
        blocks = len(sequence.local)
        return self.matched(sequence.tokens.ravel().tolist(), instance) in (blocks, blocks * BLOCK_SIZE)

    def matched(self, tokens: list[int], instance: int) -> int:
        body = json.dumps({"token_ids": tokens, "model_name": MODEL}).encode()
        started = perf_counter()
        self.connection.request("POST", "/query", body, {"Content-Type": "application/json"})
        response = self.connection.getresponse()
        answer = json.loads(response.read())
        self.latencies_ms.append((perf_counter() - started) * 1e3)
        if response.status != 200:
            raise SystemExit(f"bench_ingest --wire: /query answered {response.status}: {answer}")
        return int(answer.get("scores", {}).get(str(instance), {}).get("0", 0))

    def close(self) -> None:
        self.connection.close()


@contextmanager
def serving(side: str, burst: Burst, folder: Path) -> Iterator[tuple[Server, Publishers, Queries]]:
    """The service started, every publisher bound, registered and subscribed; stopped afterwards."""
    server = start(side, folder)
    publishers = Publishers(burst.publishers, burst.most + HWM_MARGIN)
    queries = Queries(server.url)
    try:
        for worker, endpoint in enumerate(publishers.endpoints):
            body: dict[str, Any] = {
                "instance_id": worker + 1,
                "endpoint": endpoint,
                "model_name": MODEL,
                "block_size": BLOCK_SIZE,
            }
            if side != "reference":
                body["format"] = "vllm"
            server.client.request("POST", "/register", body)
        publishers.wait_subscribed(SUBSCRIBE_TIMEOUT_S)
        time.sleep(0.2)  # a subscription read is the socket joined, not yet the service's first poll
        yield server, publishers, queries
    except BaseException:
        print(tail(server.log), file=sys.stderr)
        raise
    finally:
        queries.close()
        publishers.close()
        code = stop(server)
    if side != "reference" and code != 0:
        raise SystemExit(f"bench_ingest --wire: {side} exited {code}: {tail(server.log)}")


def run_side(side: str, burst: Burst, folder: Path) -> dict[str, Any]:
    with serving(side, burst, folder) as (server, publishers, queries):
        idle = tree_pss(server.process.pid)
        sockets = publishers.sockets
        started = perf_counter()
        for worker, frame in burst.frames:  # hot path: the whole burst, as fast as this core sends
            sockets[worker].send_multipart(frame)
        sent = perf_counter() - started
        waiting = list(burst.last_sent)
        deadline = started + VISIBLE_TIMEOUT_S
        while waiting:
            worker, sequence = waiting[-1]
            if queries.shows(sequence, worker + 1):
                waiting.pop()  # the next publisher is asked at once: it has most likely shown too
                continue
            if perf_counter() > deadline:
                raise SystemExit(f"bench_ingest --wire: {side} never showed {len(waiting)} publishers' last sequence")
            time.sleep(BURST_POLL_S)
        seconds = perf_counter() - started
        time.sleep(PSS_SETTLE_S)
        grown = tree_pss(server.process.pid) - idle
    return {
        "blocks_per_s": burst.blocks / seconds,
        "seconds": seconds,
        "send_seconds": sent,
        "query_ms": percentiles(queries.latencies_ms),
        "pss_idle_mb": idle / 2**20,
        "bytes_per_block": grown / burst.entries,
    }


def run_lag(side: str, burst: Burst, rate: float, folder: Path) -> dict[str, Any]:
    """Frames sent at ``rate`` blocks/s for up to ``LAG_SECONDS`` (a thread paces them); meanwhile this
    thread asks ``/query``, every ``QUERY_GAP_S``, for the latest sequence the first publisher sent, and when it
    answers whole, every sequence that publisher sent up to it is visible now: send-to-visible lag per
    sequence of the first publisher, in ms. (Asking every publisher in turn made the resolution a round
    of 16 queries, 5-10 ms; asking back to back took a core from the service on a 2-core machine.)"""
    frames: list[tuple[int, list[bytes], float]] = []
    total = 0
    for worker, frame in burst.frames:
        blocks = len(burst.sequences[len(frames)].local)
        if total + blocks > rate * LAG_SECONDS:
            break
        frames.append((worker, frame, total / rate))
        total += blocks
    sent_at = [0.0] * len(frames)
    first = next(i for i, (worker, _, _) in enumerate(frames) if worker == WATCHED)
    probe = [int(h) for h in burst.sequences[first].local]  # the watched publisher's first sequence
    reads: dict[str, Any] = {}
    with serving(side, burst, folder) as (server, publishers, queries), ExitStack() as stack:
        if side != "reference":  # filled when the stack closes
            reads = stack.enter_context(growth_reads(server.process.pid, probe, (WATCHED + 1, 0)))
        sockets = publishers.sockets
        ticks_before = process_ticks(server.process.pid)
        started = perf_counter()

        def pace() -> None:
            for i, (worker, frame, due) in enumerate(frames):
                while perf_counter() - started < due:
                    time.sleep(0.0002)
                sent_at[i] = perf_counter()
                sockets[worker].send_multipart(frame)

        sender = threading.Thread(target=pace)
        sender.start()
        pending: list[int] = []
        """The watched publisher's frames sent and not yet seen."""
        lags: list[float] = []
        next_frame = 0
        deadline = started + LAG_SECONDS + VISIBLE_TIMEOUT_S
        while next_frame < len(frames) or pending:
            while next_frame < len(frames) and sent_at[next_frame]:
                if frames[next_frame][0] == WATCHED:
                    pending.append(next_frame)
                next_frame += 1
            # a publisher's frames arrive in order: its latest seen, all before it are
            if pending and queries.shows(burst.sequences[pending[-1]], WATCHED + 1):
                now = perf_counter()
                lags += [(now - sent_at[i]) * 1e3 for i in pending]
                pending.clear()
            if perf_counter() > deadline:
                break
            time.sleep(QUERY_GAP_S)
        sender.join()
        cpu = (process_ticks(server.process.pid) - ticks_before) / os.sysconf("SC_CLK_TCK")
    behind = len(pending) + sum(1 for w, _, _ in frames[next_frame:] if w == WATCHED)
    return {
        "offered_blocks_per_s": rate,
        "sequences": len(frames),
        "watched": sum(1 for w, _, _ in frames if w == WATCHED),
        "lag_ms": percentiles(lags),
        "never_visible": behind,
        "cpu_s": cpu,
        "cpu_us_per_block": cpu / total * 1e6,
        **reads,
    }


def run_wire(
    repeats: int, seed: int, publisher_counts: Sequence[int], frames: int, rates: Sequence[int]
) -> dict[str, Any]:
    """Every side for every publisher count, the order alternated over ``repeats``; medians."""
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-wire-") as name:
        folder = Path(name)
        steady = Burst(publisher_counts[0], frames, seed)  # the steady runs use the first count's too
        for count in publisher_counts:
            burst = steady if count == publisher_counts[0] else Burst(count, frames, seed)
            medians = _alternated(repeats, partial(run_side, burst=burst, folder=folder))
            figures[str(count)] = {"blocks": burst.blocks, "entries": burst.entries, **medians}
        lag = {
            str(rate): _alternated(repeats, partial(run_lag, burst=steady, rate=rate, folder=folder)) for rate in rates
        }
    first = figures[str(publisher_counts[0])]
    reference = first["reference"]
    ratios = {
        "wire_burst_1": first["kvrouter-1"]["blocks_per_s"] / reference["blocks_per_s"],
        "wire_burst_2": first["kvrouter-2"]["blocks_per_s"] / reference["blocks_per_s"],
        "wire_bytes_per_block": reference["bytes_per_block"] / first["kvrouter-1"]["bytes_per_block"],
    }
    if str(LAG_RATIO_RATE) in lag:
        row = lag[str(LAG_RATIO_RATE)]
        ratios["wire_lag_p99_300k"] = _p99(row["reference"]) / _p99(row["kvrouter-1"])
    return {"wire": figures, "wire_lag": lag, "wire_ratios": ratios}


def _alternated(repeats: int, run: Callable[[str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``run`` for every side, ``repeats`` times, the order reversed every other time; each side's medians."""
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for repeat in range(repeats):
        for side in SIDES if repeat % 2 == 0 else tuple(reversed(SIDES)):
            runs[side].append(run(side))
    return {side: _median(samples) for side, samples in runs.items()}


def _p99(run: dict[str, Any]) -> float:
    """A steady run's p99 lag, infinite when some sequence never became visible (the service fell behind)."""
    return float("inf") if run["never_visible"] else float(run["lag_ms"]["p99"])


def _median(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the repeats (``query_ms`` per percentile)."""
    out: dict[str, Any] = {}
    for key, value in samples[0].items():
        if isinstance(value, dict):
            out[key] = {k: statistics.median(s[key][k] for s in samples) for k in value}
        else:
            out[key] = statistics.median(s[key] for s in samples)
    return out


def print_lag(result: dict[str, Any]) -> None:
    print("wire lag: frames at a steady offered rate, send → the publisher's latest sequence whole on /query")
    for rate, row in result["wire_lag"].items():
        for side in SIDES:
            run = row[side]
            lag = run["lag_ms"]
            behind = f", {run['never_visible']:.0f} never visible (fell behind)" if run["never_visible"] else ""
            print(  # counts are medians over the repeats
                f"  {int(rate):>9,} blocks/s {side:<11} p50 {lag['p50']:8.1f} p99 {lag['p99']:8.1f}"
                f" max {lag['max']:8.1f} ms, {run['watched']:.0f} of {run['sequences']:.0f} sequences timed{behind};"
                f" service CPU {run['cpu_s']:.2f} s, {run['cpu_us_per_block']:.2f} µs a block"
            )
            if "read_growth_us" in run:
                growth, steady = run["read_growth_us"], run["read_steady_us"]
                verdicts = ", ".join(f"{goal}: {'yes' if met else 'NO'}" for goal, met in goals(run).items())
                print(
                    f"    find_matches during a table's growth n={growth['n']:.0f} p50 {growth['p50']:.1f}"
                    f" p99.9 {growth['p99.9']:.1f} max {growth['max']:.0f} µs; steady n={steady['n']:.0f}"
                    f" p50 {steady['p50']:.1f} p99 {steady['p99']:.1f} max {steady['max']:.0f} µs;"
                    f" {run['read_wrong']:.0f} wrong; {verdicts}"
                )


def print_wire(result: dict[str, Any]) -> None:
    print("wire: vLLM frames over ZMQ into each service, clock to /query showing every last sequence")
    for count, row in result["wire"].items():
        print(f"  {count} publishers, {row['blocks']:,} blocks ({row['entries']:,} entries)")
        for side in SIDES:
            f = row[side]
            q = f["query_ms"]
            print(
                f"    {side:<11} {f['blocks_per_s'] / 1e6:5.2f} M blocks/s  (sent in {f['send_seconds']:.2f} s)"
                f"  /query p50 {q['p50']:6.2f} p99 {q['p99']:7.2f} max {q['max']:7.2f} ms"
                f"  PSS idle {f['pss_idle_mb']:6.0f} MB, {f['bytes_per_block']:5.0f} B/entry"
            )
