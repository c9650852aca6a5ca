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
   connection, for each publisher's last sequence until every one answers it whole on its instance; the
   clock stops. Each of those queries is timed: the ``/query`` latency while the service ingests;
5. the PSS is read again; the index's bytes per block is its growth over the (publisher, block) entries
   the burst stored.

Both services parse the frames, hash the token ids and build their index; kvrouter's 2-shard run splits
the publishers over two appliers. This process sends on one core while the service has the other.
Ratios (above 1: kvrouter better): ``wire_burst_1`` and ``wire_burst_2`` (blocks/s with 16 publishers,
kvrouter with 1 or 2 shards ÷ the reference) and ``wire_bytes_per_block`` (the reference's ÷ kvrouter's,
16 publishers, 1 shard). Send-to-visible lag at steady offered rates is not measured here yet.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter
from typing import Any, Final

from bench_ingest import BLOCK_SIZE, HWM_MARGIN, SUBSCRIBE_TIMEOUT_S, TOPIC, Publishers, build_sequences, stored_event
from bench_service import START_TIMEOUT, Server, free_port, stop, stopped_on_failure, tail, wait_http

from kvrouter.events.codecs import vllm
from kvrouter.events.codecs.frames import encode_live
from kvrouter.events.model import EventBatch

MODEL: Final = "bench"
VISIBLE_TIMEOUT_S: Final = 300.0
WIRE_GOALS: Final = {"wire_burst_1": 1.5, "wire_burst_2": 2.5, "wire_bytes_per_block": 1.0}
"""Issue 33's goals (the bytes per block: "at or below the reference's")."""
SIDES: Final = ("kvrouter-1", "kvrouter-2", "reference")
"""Each service of a repeat: kvrouter with that many shards, and the reference's indexer."""


class Burst:
    """One publisher count's frames, and what each publisher's last sequence must answer."""

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
        last = {s.worker: s for s in made}
        self.last = {worker: (s.tokens.ravel().tolist(), len(s.local)) for worker, s in last.items()}
        self.most = max(sum(1 for w, _ in self.frames if w == worker) for worker in range(publishers))


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
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(text[text.rindex(")") + 2 :].split()[1])
    family, grew = {root}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in family and pid not in family:
                family.add(pid)
                grew = True
    total = 0
    for pid in family:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


class Queries:
    """``POST /query`` over one kept-alive connection, each call timed."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=30)
        self.latencies_ms: list[float] = []

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


def run_side(side: str, burst: Burst, folder: Path) -> dict[str, Any]:
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
        idle = tree_pss(server.process.pid)
        sockets = publishers.sockets
        started = perf_counter()
        for worker, frame in burst.frames:  # hot path: the whole burst, as fast as this core sends
            sockets[worker].send_multipart(frame)
        sent = perf_counter() - started
        waiting = dict(burst.last)
        deadline = started + VISIBLE_TIMEOUT_S
        while waiting:
            for worker, (tokens, blocks) in list(waiting.items()):
                if queries.matched(tokens, worker + 1) in (blocks, blocks * BLOCK_SIZE):
                    del waiting[worker]
            if perf_counter() > deadline:
                raise SystemExit(f"bench_ingest --wire: {side} never showed {len(waiting)} publishers' last sequence")
        seconds = perf_counter() - started
        grown = tree_pss(server.process.pid) - idle
    except BaseException:
        print(tail(server.log), file=sys.stderr)
        raise
    finally:
        queries.close()
        publishers.close()
        code = stop(server)
    if side != "reference" and code != 0:
        raise SystemExit(f"bench_ingest --wire: {side} exited {code}: {tail(server.log)}")
    latencies = sorted(queries.latencies_ms)
    return {
        "blocks_per_s": burst.blocks / seconds,
        "seconds": seconds,
        "send_seconds": sent,
        "query_ms": {
            "n": len(latencies),
            "p50": statistics.median(latencies),
            "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "max": latencies[-1],
        },
        "pss_idle_mb": idle / 2**20,
        "bytes_per_block": grown / burst.entries,
    }


@contextmanager
def _folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bench-wire-") as name:
        yield Path(name)


def run_wire(repeats: int, seed: int, publisher_counts: Sequence[int], frames: int) -> dict[str, Any]:
    """Every side for every publisher count, the order alternated over ``repeats``; medians."""
    figures: dict[str, Any] = {}
    with _folder() as folder:
        for count in publisher_counts:
            burst = Burst(count, frames, seed)
            runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
            for repeat in range(repeats):
                order = SIDES if repeat % 2 == 0 else tuple(reversed(SIDES))
                for side in order:
                    runs[side].append(run_side(side, burst, folder))
            figures[str(count)] = {
                "blocks": burst.blocks,
                "entries": burst.entries,
                **{side: _median(samples) for side, samples in runs.items()},
            }
    first = figures[str(publisher_counts[0])]
    reference = first["reference"]
    return {
        "wire": figures,
        "wire_ratios": {
            "wire_burst_1": first["kvrouter-1"]["blocks_per_s"] / reference["blocks_per_s"],
            "wire_burst_2": first["kvrouter-2"]["blocks_per_s"] / reference["blocks_per_s"],
            "wire_bytes_per_block": reference["bytes_per_block"] / first["kvrouter-1"]["bytes_per_block"],
        },
    }


def _median(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the repeats (``query_ms`` per percentile)."""
    out: dict[str, Any] = {}
    for key, value in samples[0].items():
        if isinstance(value, dict):
            out[key] = {k: statistics.median(s[key][k] for s in samples) for k in value}
        else:
            out[key] = statistics.median(s[key] for s in samples)
    return out


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
