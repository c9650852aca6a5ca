"""``/select`` over HTTP: kvrouter's service against the reference's selection service, same workers, events, prompts.

    python tools/bench_service.py [--quick] [--seconds S] [--json FILE]

Setup, once per run. This process binds one XPUB socket per worker (16), standing in for 16 vLLM engines'
KV-event PUB sockets. Two servers start, each in its own process: the reference's selection service
(``python -m dynamo.select_service``, ai-dynamo-runtime, its default 4 threads) and kvrouter's
``Service`` (this file's ``_serve`` mode: ``Service(ServiceConfig(shards=1, fronts=F))`` with ``/metrics``
installed, on asyncio's loop; the same object ``kvrouter up --mock-workers 0 --fronts F`` runs; ``--fronts``
defaults to one per core, as an operator would run it on this machine, and ``--fronts 1`` measures one
process). Both
get the same 16 workers (the reference through ``POST /workers`` with ``kv_events_endpoints``, kvrouter
through ``POST /register``), both subscribe to the same sockets, and once every socket has read both
subscriptions (XPUB_VERBOSE, so no frame is lost to the slow joiner) the same vLLM 0.33 map-encoded
frames go out once, to both. The workload: 200 prompts of 1,024 token ids (64 blocks of 16), each one of
8 shared 512-token system prompts plus 512 tokens of its own; prompt i's blocks are stored on worker
i mod 16 for 80 % of the prompts (the rest match their system prompt only). Before any clock runs, both
servers must answer ``/select`` for sample prompts with the stored worker's full overlap (1,024 tokens),
so both are known to route on the same index content.

Load: ``wrk`` (``tools/install_wrk.sh`` installs it from the system's packages), one thread, a Lua script
cycling the 200 ``/select`` bodies (``{"model_name", "token_ids"}``, 5-6 KB each), at 1, 8 and 64
connections for ``--seconds`` each, the servers alternating point by point after a warm-up; the ratios'
points, concurrency 8 (throughput and p99) and concurrency 1 (the tail a lone client sees), are measured in
``--rounds`` rounds (5), the side that goes first alternating from round to round. Why rounds: on this
2-core VM one 10 s point's p99 of the same build ranged from 1.6 to 4.1 ms in consecutive runs (the VM's
speed shifts within minutes), so one pair of points decided the ratio by chance more than by the servers.
wrk is C and its thread's CPU time is measured (``wait4`` rusage): it is reported beside each point, so a
generator near one full core would show. Per point: requests/s, p50 and p99 latency (wrk's own histogram),
server CPU per request (the server's process and children, from ``/proc``), errors.

**The machine's floor.** Before any server starts, wrk at concurrency 1 against this file's ``_floor``
server (asyncio, answering each request at once with a fixed body, no work at all): the tail no server on
this machine can beat. On this VM it is about 3 ms at the p99 (and 0.1 ms at the p50), pinned to separate
cores or not: waking a sleeping vCPU for each request of a lone client is what the concurrency-1 p99 of
both servers is made of (issue 32's "where that tail comes from"; ``docs/http-api.md``, "Several fronts").

**Fronts.** ``--compare-fronts N`` (4) starts a second kvrouter with N fronts beside the first
(``--fronts``, one per core by default); its concurrency-8 rounds alternate with the others, and the server
CPU per ``/select`` of the two is compared (median over rounds of the ratio; goal: within 10 %). Beside
them, in the same rounds, the fronts' floors: this file's ``_floor --work`` with as many plain asyncio
processes as each kvrouter has fronts, on one port (``SO_REUSEPORT``: each connection one process's own,
no work shared between them), each request parsed by ``orjson`` and its tokens hashed into blocks with
kvrouter's hasher, a small JSON answer; once spawned, as kvrouter's fronts are, and once forked from a
process that has answered a request. The same CPU ratio for them is what more processes than cores cost
on this machine when each has its own copy of everything, and when they share their parent's memory
(``docs/http-api.md``, "Several fronts").

Where a kvrouter request's time goes: ``/metrics`` is scraped before and after the concurrency-8 point;
the routing-overhead histogram's per-phase sums over the requests between (of the front that answers
the scrape: each front counts its own) give the mean time per phase
(parse, hash, decide, serialise, as the service times them), beside the server CPU per request (the rest
is HTTP, the lane's (``service/lane.py``), and the event loop).

The ZMQ fast path (``docs/zmq-fast-path.md``): the same prompts as ``{"op": "select", ...}`` msgpack
bodies (token ids as msgpack bin of little-endian u32, ``--fastpath-tokens list`` for an array) over
DEALER sockets to the kvrouter server's ROUTER (``--zmq-port``), at concurrency 1 and 8
(``--fastpath-concurrency``: that many DEALER sockets, one request in flight each, as wrk's
connections). The generator is Python (``_zmq_load`` mode, its own process, one thread, bodies packed
before the clock starts, a reply checked for an error by a byte search, not unpacked); its CPU time over
the timed loop is reported beside each point as wrk's is, and before the kvrouter points it is run
against a ROUTER that answers at once (``_zmq_echo`` mode): that ceiling, far above the fast path's
figures, shows the generator is not what limits them. The reference has no fast path: no ratio.

Ratios (> 1: kvrouter better), at concurrency 8: ``select_throughput`` = kvrouter ÷ reference requests/s,
``select_p99`` = reference ÷ kvrouter p99; at concurrency 1: ``select_p99_c1`` = reference ÷ kvrouter p99;
each the median over the rounds of the ratio within a round (the two sides of a round ran seconds apart);
the table's rows are each side's medians, and the rounds are listed under it. Goals: ≥ 1 on the first two
(issue 11, kept by issue 32), and ``select_p99_c1`` ≥ 1/1.5 (kvrouter's p99 at concurrency 1 at most
1.5 times the reference's: issue 32). ``--quick`` is a smoke test for the test suite (32 prompts, 1 s
points, no timing meaning). The default run takes about 8 minutes.

HTTP outside the clock (waiting for a server, registering the workers, the routing check before any clock
runs, the ``/metrics`` scrapes) goes through ``kvrouter.SyncClient``, for both servers: the reference's
``/health``, ``/select`` and ``/metrics`` are wire-compatible, and its ``POST /workers`` goes through the
client's low-level ``request``. No Python HTTP client sits in a timed loop: the HTTP load is wrk's, the
fast path's load is ZMQ.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvrouter.client import ApiError, SyncClient
from kvrouter.events.codecs import vllm
from kvrouter.events.codecs.frames import encode_live
from kvrouter.events.model import EngineHash, EventBatch, LocalHash, Stored, StoredBlock
from kvrouter.hashing import sequence_hashes_array
from kvrouter.hashing.blocks import block_hashes_array

WORKERS: Final = 16
BLOCK: Final = 16
PROMPT_TOKENS: Final = 1024
PREFIX_TOKENS: Final = 512
PREFIXES: Final = 8
BODIES: Final = 200
STORED_SHARE: Final = 0.8
"""Prompts whose own blocks are stored on a worker; the rest match their system prompt only."""
CONCURRENCY: Final = (1, 8, 64)
RATIO_CONCURRENCY: Final = 8
SECONDS: Final = 10.0
WARMUP_SECONDS: Final = 3.0
ROUNDS: Final = 5
QUICK: Final = {"seconds": 1.0, "warmup": 0.5, "bodies": 32}
MODEL: Final = "bench"
VERIFY_SAMPLES: Final = 8
START_TIMEOUT: Final = 120.0
"""kvrouter's first start on a machine compiles numba kernels (tens of seconds on a small VM) [s]."""
FASTPATH_CONCURRENCY: Final = (1, 8)
ERROR_KEY: Final = b"\xa5error"
"""msgpack's ``"error"`` key (fixstr of 5): in a reply only when it is an error answer."""
GOALS: Final = {"select_throughput": 1.0, "select_p99": 1.0, "select_p99_c1": 1 / 1.5}
"""``select_p99_c1``: kvrouter's p99 at concurrency 1 at most 1.5 times the reference's (issue 32)."""
TAIL_CONCURRENCY: Final = 1
"""The other point measured in rounds, alternated with the reference: the tail a lone client sees."""
COMPARE_FRONTS: Final = 4
FRONTS_CPU_GOAL: Final = 1 / 1.1
"""Server CPU per ``/select`` at ``--compare-fronts`` within 10 % of ``--fronts`` (issue 32): their ratio."""
TOPIC: Final = b""
SIDES: Final = ("reference", "kvrouter")
SHM_LEFT: list[str] = []
"""Segments the kvrouter server left in /dev/shm after it stopped (must stay empty)."""

LUA: Final = """
local bodies = {}
for line in io.lines("%(bodies)s") do bodies[#bodies + 1] = line end
local i = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  i = i %% #bodies + 1
  return wrk.format(nil, "%(path)s", nil, bodies[i])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH {\\"requests\\": %%d, \\"duration_us\\": %%d, \\"socket_errors\\": %%d, \\"non_2xx\\": %%d, "
    .. "\\"p50_us\\": %%d, \\"p99_us\\": %%d, \\"mean_us\\": %%.1f}\\n",
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


# -- the workload -------------------------------------------------------------------------------


@dataclass
class Workload:
    prompts: list[list[int]]
    owner: list[int | None]
    """Per prompt, the worker holding all of it (None: only its system prompt is stored anywhere)."""
    frames: list[list[list[bytes]]]
    """Per worker, its live frames ``[topic, seq, payload]`` in order."""
    events: int


def build_workload(bodies: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 150_000) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    prompts = [
        prefixes[i % PREFIXES] + [rng.randrange(1, 150_000) for _ in range(PROMPT_TOKENS - PREFIX_TOKENS)]
        for i in range(bodies)
    ]
    stored = set(rng.sample(range(bodies), int(bodies * STORED_SHARE)))
    encoder = vllm.Encoder("map")
    frames: list[list[list[bytes]]] = [[] for _ in range(WORKERS)]
    events: list[list[Stored]] = [[] for _ in range(WORKERS)]
    has_prefix: set[tuple[int, int]] = set()
    owner: list[int | None] = []
    for i, prompt in enumerate(prompts):
        if i not in stored:
            owner.append(None)
            continue
        worker = i % WORKERS
        owner.append(worker)
        local = block_hashes_array(prompt, BLOCK)
        engine = sequence_hashes_array(local).tolist()  # engine hash = router sequence hash: unique per path
        split = PREFIX_TOKENS // BLOCK
        first = 0 if (worker, i % PREFIXES) not in has_prefix else split
        has_prefix.add((worker, i % PREFIXES))
        parent = None if first == 0 else EngineHash(engine[first - 1])
        blocks = tuple(
            StoredBlock(EngineHash(engine[j]), LocalHash(int(local[j])), tuple(prompt[j * BLOCK : (j + 1) * BLOCK]))
            for j in range(first, len(local))
        )
        events[worker].append(Stored(worker, parent, blocks, event_id=len(events[worker])))
    # the system prompts also sit on the workers that got none of their prompts (a realistic spread)
    for worker in range(WORKERS):
        for p in range(PREFIXES):
            if (worker, p) in has_prefix or (worker + p) % 4:
                continue
            local = block_hashes_array(prefixes[p], BLOCK)
            engine = sequence_hashes_array(local).tolist()
            blocks = tuple(
                StoredBlock(
                    EngineHash(engine[j]), LocalHash(int(local[j])), tuple(prefixes[p][j * BLOCK : (j + 1) * BLOCK])
                )
                for j in range(len(local))
            )
            events[worker].append(Stored(worker, None, blocks, event_id=len(events[worker])))
    for worker, stream in enumerate(events):
        for seq, event in enumerate(stream):
            payload = encoder.encode(EventBatch((event,), timestamp=time.time(), dp_rank=0))
            frames[worker].append(encode_live(TOPIC, seq, payload))
    return Workload(prompts, owner, frames, sum(len(s) for s in events))


class Publishers:
    """One XPUB per worker in this process: the engines' PUB sockets. Verbose, so every subscriber's
    subscription is read, and frames go out only once both servers listen."""

    def __init__(self, workers: int) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sockets: list[zmq.Socket[bytes]] = []
        try:
            for _ in range(workers):
                sock = self.context.socket(zmq.XPUB)
                self.sockets.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.XPUB_VERBOSE, 1)
                sock.setsockopt(zmq.SNDHWM, 100_000)
                sock.bind("tcp://127.0.0.1:*")
        except BaseException:
            self.close()
            raise
        self.endpoints = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in self.sockets]

    def wait_subscribed(self, subscribers: int, timeout: float) -> None:
        poller = zmq.Poller()
        for sock in self.sockets:
            poller.register(sock, zmq.POLLIN)
        seen = dict.fromkeys(self.sockets, 0)
        deadline = time.monotonic() + timeout
        while any(n < subscribers for n in seen.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                counts = sorted(seen.values())
                raise SystemExit(f"bench_service: not every worker socket got {subscribers} subscriptions: {counts}")
            for sock, _ in poller.poll(int(left * 1000) + 1):
                if sock.recv()[:1] == b"\x01":
                    seen[sock] += 1

    def send(self, frames: list[list[list[bytes]]]) -> None:
        for sock, stream in zip(self.sockets, frames, strict=True):
            for message in stream:
                sock.send_multipart(message)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.context.term()


# -- the servers --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    zmq: str | None = None
    """The fast path's endpoint (kvrouter only)."""
    client: SyncClient = field(init=False)
    """Every HTTP call of the setup and the checks (closed by :func:`stop`)."""

    def __post_init__(self) -> None:
        self.client = SyncClient(self.url, timeout=10.0)


def call(server: Server, path: str, *, timeout: float = 10.0) -> tuple[int, Any]:
    """``GET path``: (status, answer), refusals included (waiting for a server judges the status).

    Raises:
        ServiceUnreachable: no answer (an ``OSError``).
    """
    try:
        response = server.client.request("GET", path, timeout=timeout)
    except ApiError as exc:
        return exc.status, exc.body
    return response.status, response.body


def wait_http(
    server: Server, path: str, timeout: float, done: Callable[[int, Any], bool] = lambda status, _: status == 200
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.process.poll() is not None:
            raise SystemExit(f"bench_service: {server.name} exited ({server.process.returncode}): {tail(server.log)}")
        with contextlib.suppress(OSError):
            if done(*call(server, path, timeout=1.0)):
                return
        if time.monotonic() > deadline:
            raise SystemExit(
                f"bench_service: {server.name} did not answer {path} within {timeout}s: {tail(server.log)}"
            )
        time.sleep(0.05)


def tail(path: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def start_reference(folder: Path) -> Server:
    port = free_port()
    log = folder / "reference.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dynamo.select_service", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
        )
    server = Server("reference", f"http://127.0.0.1:{port}", process, log)
    with stopped_on_failure(server):
        wait_http(server, "/health", START_TIMEOUT)
    return server


def start_kvrouter(folder: Path, fronts: int, name: str = "kvrouter", model_paths: Sequence[str] = ()) -> Server:
    """``_serve`` in a process of its own, once it listens and its index is up; ``model_paths``: its
    ``--model-path`` values (chat's models)."""
    port, zmq_port = free_port(), free_port()
    log = folder / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "_serve",
                "--port",
                str(port),
                "--zmq-port",
                str(zmq_port),
                "--fronts",
                str(fronts),
                *(f"--model-path={path}" for path in model_paths),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Server(name, f"http://127.0.0.1:{port}", process, log, f"tcp://127.0.0.1:{zmq_port}")
    with stopped_on_failure(server):
        wait_http(server, "/health", START_TIMEOUT)  # listening; the index comes up after (kvrouter up's order)
        wait_http(
            server,
            "/ready",
            START_TIMEOUT,
            lambda status, body: (
                isinstance(body, dict) and "engine starting" not in body.get("reasons", ["engine starting"])
            ),
        )
    return server


@contextlib.contextmanager
def killed_on_failure(process: subprocess.Popen[bytes]) -> Iterator[None]:
    """A load generator the run waits on is killed if the run ends first (SIGTERM, Ctrl-C, a failure): a
    ``_zmq_load`` whose server was stopped under it waited for a reply for ever."""
    try:
        yield
    except BaseException:
        if process.poll() is None:
            process.kill()
            process.wait()
        raise


@contextlib.contextmanager
def stopped_on_failure(server: Server) -> Iterator[None]:
    """A server that does not come up is stopped here: the caller never gets it to stop (a kvrouter that
    never answered ``/health`` was left serving, with its segments, after the run had exited)."""
    try:
        yield
    except BaseException:
        stop(server)
        raise


def stop(server: Server) -> int:
    server.client.close()
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        return server.process.wait()


def register(server: Server, endpoints: Sequence[str], model: str = MODEL, http_endpoint: str | None = None) -> None:
    """One worker per KV-event endpoint, in ``model``; kvrouter's answer at ``http_endpoint`` (its proxy's)."""
    for worker, endpoint in enumerate(endpoints):
        try:
            if server.name.startswith("kvrouter"):
                server.client.register(
                    worker, endpoint, model_name=model, block_size=BLOCK, http_endpoint=http_endpoint
                )
            else:  # the reference's selection service registers on its own route
                body = {
                    "worker_id": worker,
                    "model_name": model,
                    "endpoint": f"http://127.0.0.1:{9000 + worker}",
                    "block_size": BLOCK,
                    "kv_events_endpoints": {"0": endpoint},
                }
                server.client.request("POST", "/workers", body)
        except ApiError as exc:
            raise SystemExit(f"bench_service: {server.name} registering worker {worker}: {exc}") from exc


def verify(server: Server, workload: Workload, timeout: float) -> None:
    """Wait until ``/select`` of sample stored prompts names their owner with the whole prompt matched."""
    samples = [i for i, owner in enumerate(workload.owner) if owner is not None][:VERIFY_SAMPLES]
    deadline = time.monotonic() + timeout
    while True:
        wrong = []
        for i in samples:
            got: Any
            try:
                answer: dict[str, Any] = dict(server.client.select(MODEL, token_ids=workload.prompts[i]))
                got = (answer.get("worker_id"), answer.get("overlap", {}).get("longest_matched"))
            except ApiError as exc:
                got = exc.status
            if got != (workload.owner[i], PROMPT_TOKENS):
                wrong.append((i, workload.owner[i], got))
        if not wrong:
            return
        if time.monotonic() > deadline:
            raise SystemExit(
                f"bench_service: {server.name} never routed on the events: (prompt, owner, got) {wrong[:4]}"
            )
        time.sleep(0.1)


# -- measuring ----------------------------------------------------------------------------------


def process_ticks(root: int) -> int:
    """CPU clock ticks (user + system) of ``root`` and every live descendant, threads included."""
    return sum(ticks for _, ticks in process_family(root).values())


def process_family(root: int) -> dict[int, tuple[int, int]]:
    """``root`` and every live descendant: pid → (parent pid, CPU clock ticks, user + system)."""
    stats: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        stats[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    family = {root}
    grew = True
    while grew:
        grew = False
        for pid, (parent, _) in stats.items():
            if parent in family and pid not in family:
                family.add(pid)
                grew = True
    return {pid: stats[pid] for pid in family if pid in stats}


def run_wrk(server: Server, script: Path, connections: int, seconds: float) -> dict[str, Any]:
    command = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency", "-s", str(script)]
    before = process_ticks(server.process.pid)
    started = time.perf_counter()
    process = subprocess.Popen([*command, server.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None
    assert process.stderr is not None
    with killed_on_failure(process):
        _, code, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(code)
    out, err = process.stdout.read().decode(), process.stderr.read().decode()
    process.stdout.close()
    process.stderr.close()
    wall = time.perf_counter() - started
    server_ticks = process_ticks(server.process.pid) - before
    line = next((x for x in out.splitlines() if x.startswith("BENCH ")), None)
    if process.returncode != 0 or line is None:
        raise SystemExit(f"bench_service: wrk failed ({process.returncode}): {out}\n{err}")
    figures: dict[str, Any] = json.loads(line[len("BENCH ") :])
    requests = max(1, figures["requests"])
    seconds_run = figures["duration_us"] / 1e6
    return {
        "connections": connections,
        "requests": figures["requests"],
        "rps": figures["requests"] / seconds_run,
        "p50_ms": figures["p50_us"] / 1e3,
        "p99_ms": figures["p99_us"] / 1e3,
        "errors": figures["socket_errors"] + figures["non_2xx"],
        "server_cpu_us": server_ticks / os.sysconf("SC_CLK_TCK") / requests * 1e6,
        "wrk_cpu_share": (usage.ru_utime + usage.ru_stime) / wall,
        "wrk_cpu_us": (usage.ru_utime + usage.ru_stime) / requests * 1e6,
    }


def run_zmq(
    endpoint: str, bodies: Path, connections: int, seconds: float, server: Server | None, tokens: str = "bin"
) -> dict[str, Any]:
    """One fast-path point: the ``_zmq_load`` generator in its own process; its CPU time over the timed loop
    (``process_time``: its start-up, imports and packing excluded)."""
    command = [sys.executable, __file__, "_zmq_load", "--endpoint", endpoint, "--bodies", str(bodies)]
    command += ["--connections", str(connections), "--seconds", str(seconds), "--tokens", tokens]
    before = process_ticks(server.process.pid) if server is not None else 0
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with killed_on_failure(process):
        out, err = (text.decode() for text in process.communicate())
    server_ticks = process_ticks(server.process.pid) - before if server is not None else 0
    line = next((x for x in out.splitlines() if x.startswith("BENCH ")), None)
    if process.returncode != 0 or line is None:
        raise SystemExit(f"bench_service: the fast-path generator failed ({process.returncode}): {out}\n{err}")
    figures: dict[str, Any] = json.loads(line[len("BENCH ") :])
    requests = max(1, figures["requests"])
    return {
        "connections": connections,
        "requests": figures["requests"],
        "rps": figures["requests"] / figures["seconds"],
        "p50_ms": figures["p50_us"] / 1e3,
        "p99_ms": figures["p99_us"] / 1e3,
        "errors": figures["errors"],
        "server_cpu_us": server_ticks / os.sysconf("SC_CLK_TCK") / requests * 1e6,
        "gen_cpu_share": figures["cpu_s"] / figures["seconds"],
        "gen_cpu_us": figures["cpu_s"] / requests * 1e6,
    }


def zmq_load(endpoint: str, bodies: Path, connections: int, seconds: float, tokens: str = "bin") -> int:
    """``_zmq_load``: ``connections`` DEALER sockets, one ``select`` in flight each, for ``seconds``; prints
    ``BENCH {json}`` (requests, seconds, p50/p99 µs, errors). Replies are not unpacked: an error reply is
    found by its ``"error"`` key's bytes. ``tokens``: ``bin`` sends the token ids as msgpack bin of
    little-endian u32 (the form ``docs/zmq-fast-path.md`` recommends), ``list`` as a msgpack array."""
    import msgpack

    def pack(body: dict[str, Any]) -> bytes:
        if tokens == "bin":
            body["token_ids"] = b"".join(t.to_bytes(4, "little") for t in body["token_ids"])
        return bytes(msgpack.packb({"op": "select", **body}))

    packed = [pack(json.loads(line)) for line in bodies.read_text().splitlines()]
    context = zmq.Context()
    sockets = []
    poller = zmq.Poller()
    for _ in range(connections):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        poller.register(sock, zmq.POLLIN)
        sockets.append(sock)
    sent: dict[zmq.Socket[bytes], int] = {}
    latencies: list[int] = []
    errors = 0
    i = 0
    clock = time.perf_counter_ns
    try:
        for sock in sockets:  # one request each, not timed: connects the sockets
            sock.send_multipart([b"kvr1", packed[i % len(packed)]])
            i += 1
        for sock in sockets:
            if not sock.poll(int(START_TIMEOUT * 1000)):
                raise SystemExit(f"bench_service _zmq_load: no reply from {endpoint} in {START_TIMEOUT:g} s")
            sock.recv_multipart()
        started = clock()
        cpu_started = time.process_time()
        deadline = started + int(seconds * 1e9)
        for sock in sockets:
            sent[sock] = clock()
            sock.send_multipart([b"kvr1", packed[i % len(packed)]], copy=False)
            i += 1
        now = started
        while now < deadline:
            for sock, _ in poller.poll(1000):
                _, reply = sock.recv_multipart()
                now = clock()
                latencies.append(now - sent[sock])
                if ERROR_KEY in reply:
                    errors += 1
                sent[sock] = now
                sock.send_multipart([b"kvr1", packed[i % len(packed)]], copy=False)
                i += 1
            now = clock()
        elapsed = (now - started) / 1e9
        cpu = time.process_time() - cpu_started
    finally:
        context.destroy(linger=0)
    latencies.sort()
    n = len(latencies)
    figures = {
        "requests": n,
        "seconds": elapsed,
        "p50_us": latencies[n // 2] / 1e3 if n else 0.0,
        "p99_us": latencies[min(n - 1, n * 99 // 100)] / 1e3 if n else 0.0,
        "errors": errors,
        "cpu_s": cpu,
    }
    print("BENCH " + json.dumps(figures), flush=True)
    return 0


def zmq_echo(port: int) -> int:
    """``_zmq_echo``: a ROUTER answering every message at once with a fixed reply (the generator's ceiling)."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    reply = b"\x81\xa6status\xa2ok"
    try:
        while True:
            frames = sock.recv_multipart(copy=True)
            sock.send_multipart([frames[0], b"kvr1", reply])
    finally:
        context.destroy(linger=0)


def echo_ceiling(bodies: Path, seconds: float) -> dict[str, Any]:
    """The generator against ``_zmq_echo`` at concurrency 8: what it can drive when the server costs nothing."""
    port = free_port()
    echo = subprocess.Popen([sys.executable, __file__, "_zmq_echo", "--port", str(port)])
    try:
        return run_zmq(f"tcp://127.0.0.1:{port}", bodies, RATIO_CONCURRENCY, seconds, None)
    finally:
        echo.terminate()
        echo.wait(10)


def scrape(server: Server) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = server.client.metrics()
    except ApiError:
        return {}
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def phases(before: dict[Any, float], after: dict[Any, float]) -> dict[str, float]:
    """Mean µs per phase between two scrapes of the routing-overhead histogram (and the HTTP handler)."""
    out: dict[str, float] = {}
    for (name, labels), value in after.items():
        if name != "kvrouter_routing_overhead_seconds_sum":
            continue
        count_key = ("kvrouter_routing_overhead_seconds_count", labels)
        count = after.get(count_key, 0.0) - before.get(count_key, 0.0)
        if count > 0:
            out[dict(labels).get("phase", "?")] = (value - before.get((name, labels), 0.0)) / count * 1e6
    return out


# -- kvrouter's side: the service in its own process ----------------------------------------------


def serve(port: int, shards: int, zmq_port: int | None, fronts: int, model_paths: Sequence[str] = ()) -> int:
    """``_serve``: kvrouter's Service with ``/metrics`` and the fast path, until SIGTERM/SIGINT."""
    import asyncio

    from kvrouter.cli import front
    from kvrouter.service.core.config import ServiceConfig
    from kvrouter.service.process.app import Service

    config = ServiceConfig(port=port, shards=shards, zmq_port=zmq_port, fronts=fronts, model_paths=tuple(model_paths))
    service = Service(config, front_main=front.run)  # the other fronts' life, as ``kvrouter up`` gives it
    service.start()  # forks the appliers (and the fronts' fork server): before any loop or thread
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: service.stop())
    # asyncio's own loop, as ``kvrouter up`` runs: uvloop measured no faster here (14:27 UTC 2026-11-30,
    # concurrency 8, two alternated pairs: asyncio 4,765 and 4,430 req/s, uvloop 4,316 and 3,680).
    print(f"bench_service: kvrouter serving on port {port} (asyncio, {shards} shard, {fronts} fronts)", flush=True)
    asyncio.run(service.run())
    return 0


# -- main ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def servers(folder: Path, sides: Sequence[str], fronts: int, compare: int | None) -> Iterator[list[Server]]:
    """The servers of a run: ``sides``, then (``compare``) a second kvrouter with that many fronts."""
    started: list[Server] = []
    try:
        for side in sides:
            started.append(start_reference(folder) if side == "reference" else start_kvrouter(folder, fronts))
        if compare is not None and "kvrouter" in sides:
            started.append(start_kvrouter(folder, compare, name=f"kvrouter-{compare}fronts"))
        yield started
    finally:
        for server in reversed(started):
            code = stop(server)
            if server.name.startswith("kvrouter") and code != 0:
                print(f"bench_service: {server.name} exited {code}: {tail(server.log)}", file=sys.stderr)
            if server.name.startswith("kvrouter"):
                prefix = f"kvrouter-{server.process.pid}-"
                SHM_LEFT.extend(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


FLOORS: Final = {"spawned": False, "forked": True}
"""The fronts' floors: their processes spawned (as kvrouter's fronts are), or forked from a warm one."""


@contextlib.contextmanager
def floors(fronts: int, compare: int | None) -> Iterator[list[Server]]:
    """The fronts' floors (with ``compare``): ``_floor --work`` as ``fronts`` processes on one port and as
    ``compare``, each connection one process's own, spawned and forked. The processes share no work, and
    each request costs them the same: what they pay for more of them is the machine's, and how they came
    to be."""
    counts = (fronts, compare) if compare is not None else ()
    wanted = [(f"floor-{n}{how}", n, fork) for how, fork in FLOORS.items() for n in counts]
    launched = [launch_floor(processes, work=True, fork=fork) for _, processes, fork in wanted]  # they start together
    started: list[Server] = []
    try:
        for (name, _, _), process in zip(wanted, launched, strict=True):
            started.append(floor_server(name, process))
        yield started
    finally:
        for server in started:
            stop(server)
        for process in launched[len(started) :]:  # not answering yet (or stopped already, a no-op)
            process.terminate()
            process.wait()


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    workload = build_workload(args.bodies, args.seed)
    bodies = folder / "bodies.jsonl"
    bodies.write_text("".join(json.dumps({"model_name": MODEL, "token_ids": p}) + "\n" for p in workload.prompts))
    script = folder / "select.lua"
    script.write_text(LUA % {"bodies": bodies, "path": "/select"})
    publishers = Publishers(WORKERS)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {side: {} for side in args.sides}
    fast: dict[int, dict[str, Any]] = {}
    ceiling: dict[str, Any] = {}
    breakdown: dict[str, float] = {}
    floor = floor_point(script, TAIL_CONCURRENCY, args.seconds)  # before any server: the machine's own tail
    compare = args.compare_fronts if args.compare_fronts and args.compare_fronts != args.fronts else None
    try:
        with servers(folder, args.sides, args.fronts, compare) as started, floors(args.fronts, compare) as floor_pair:
            for server in started:
                register(server, publishers.endpoints)
            publishers.wait_subscribed(len(started), START_TIMEOUT)
            publishers.send(workload.frames)
            for server in started:
                verify(server, workload, START_TIMEOUT)
            for server in [*started, *floor_pair]:
                run_wrk(server, script, RATIO_CONCURRENCY, args.warmup)
            kvrouter = next((s for s in started if s.name == "kvrouter"), None)
            compared = next((s for s in started if s.name.startswith("kvrouter-")), None)
            sides = [s for s in started if s is not compared]
            if kvrouter is not None and kvrouter.zmq is not None and args.fastpath_concurrency:
                ceiling = echo_ceiling(bodies, min(args.seconds, 3.0))
                run_zmq(kvrouter.zmq, bodies, RATIO_CONCURRENCY, args.warmup, kvrouter)
            for connections in sorted({*args.concurrency, *args.fastpath_concurrency}):
                if connections in args.concurrency:
                    rounds = args.rounds if connections in (TAIL_CONCURRENCY, RATIO_CONCURRENCY) else 1
                    ours = kvrouter if connections == RATIO_CONCURRENCY else None  # its phases are timed here
                    measured = (
                        [*sides, compared, *floor_pair] if connections == RATIO_CONCURRENCY and compared else sides
                    )
                    before = scrape(ours) if ours is not None else {}
                    for turn in range(rounds):  # who goes first alternates: neither side always follows the other
                        for server in measured if turn % 2 == 0 else measured[::-1]:
                            runs.setdefault(server.name, {}).setdefault(connections, []).append(
                                run_wrk(server, script, connections, args.seconds)
                            )
                    if ours is not None:
                        breakdown = phases(before, scrape(ours))
                if kvrouter is not None and kvrouter.zmq is not None and connections in args.fastpath_concurrency:
                    fast[connections] = run_zmq(
                        kvrouter.zmq, bodies, connections, args.seconds, kvrouter, args.fastpath_tokens
                    )
    finally:
        publishers.close()
    points = {name: {c: median_point(rs) for c, rs in by_c.items()} for name, by_c in runs.items()}
    ratios: dict[str, float] = {}
    for connections, pair_ratios in (
        (RATIO_CONCURRENCY, ("select_throughput", "select_p99")),
        (TAIL_CONCURRENCY, ("select_p99_c1",)),
    ):
        ours_runs, theirs_runs = (runs.get(side, {}).get(connections) for side in ("kvrouter", "reference"))
        if not (ours_runs and theirs_runs):
            continue
        pairs = list(zip(ours_runs, theirs_runs, strict=True))  # paired by round: the two ran seconds apart
        if "select_throughput" in pair_ratios:
            ratios["select_throughput"] = statistics.median(o["rps"] / t["rps"] for o, t in pairs)
            ratios["select_p99"] = statistics.median(t["p99_ms"] / o["p99_ms"] for o, t in pairs)
        else:
            ratios["select_p99_c1"] = statistics.median(t["p99_ms"] / o["p99_ms"] for o, t in pairs)
    fronts_cpu: dict[str, Any] = {}
    main_runs = runs.get("kvrouter", {}).get(RATIO_CONCURRENCY)
    other_runs = runs.get(f"kvrouter-{compare}fronts", {}).get(RATIO_CONCURRENCY) if compare else None
    if main_runs and other_runs:
        fronts_cpu = {
            "fronts": args.fronts,
            "compare": compare,
            "cpu_ratio": cpu_ratio(main_runs, other_runs),
            "floor_cpu_ratios": {
                how: cpu_ratio(*(runs[f"floor-{n}{how}"][RATIO_CONCURRENCY] for n in (args.fronts, compare)))
                for how in FLOORS
            },
            "goal": FRONTS_CPU_GOAL,
        }
    return {
        "points": {name: {str(c): p for c, p in by_c.items()} for name, by_c in points.items()},
        "rounds": {
            name: {str(c): list(by_c[c]) for c in (TAIL_CONCURRENCY, RATIO_CONCURRENCY) if c in by_c}
            for name, by_c in runs.items()
        },
        "floor": floor,
        "fronts_cpu": fronts_cpu,
        "fastpath": {
            "points": {str(c): p for c, p in fast.items()},
            "generator": "python DEALER sockets (tools/bench_service.py _zmq_load), one process, one thread",
            "tokens": args.fastpath_tokens,
            "generator_ceiling": ceiling,
        }
        if fast
        else {},
        "phases_us": breakdown,
        "ratios": ratios,
        "goals": GOALS,
        "ratio_basis": (
            f"concurrency {RATIO_CONCURRENCY} (select_p99_c1: {TAIL_CONCURRENCY}), {WORKERS} workers, "
            f"{PROMPT_TOKENS}-token prompts, {args.rounds} rounds"
        ),
        "kvrouter_fronts": args.fronts,
        "workload": {"workers": WORKERS, "prompts": len(workload.prompts), "events": workload.events},
        "generator": "wrk " + subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split()[1],
    }


def cpu_ratio(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> float:
    """Server CPU per request of ``first`` ÷ ``second``, the median over rounds of the ratio within a round."""
    return float(statistics.median(f["server_cpu_us"] / s["server_cpu_us"] for f, s in zip(first, second, strict=True)))


def floor_point(script: Path, connections: int, seconds: float) -> dict[str, Any]:
    """The machine's own tail: wrk against this file's ``_floor`` server, which answers every request at
    once from asyncio with no work at all (what no server on this machine can beat)."""
    server = floor_server("floor", launch_floor(1, work=False, fork=False))
    try:
        return run_wrk(server, script, connections, seconds)
    finally:
        stop(server)


def launch_floor(processes: int, work: bool, fork: bool) -> subprocess.Popen[bytes]:
    """``_floor`` in a process of its own (``processes`` > 1: with its children, on one port), started, not
    waited for (:func:`floor_server` waits): several start together."""
    return subprocess.Popen(floor_command(0, work, processes, fork), stdout=subprocess.PIPE)


def floor_server(name: str, floor: subprocess.Popen[bytes]) -> Server:
    """A launched ``_floor`` once it answers."""
    assert floor.stdout is not None
    line = floor.stdout.readline()  # the port it bound: chosen by its own bind, so no other process can take it first
    floor.stdout.close()
    server = Server(name, f"http://127.0.0.1:{line.decode().strip() or 0}", floor, Path(os.devnull))
    with stopped_on_failure(server):
        wait_http(server, "/health", START_TIMEOUT)
    return server


def floor_command(port: int, work: bool, processes: int = 1, fork: bool = False) -> list[str]:
    """``_floor``'s command line (``port`` 0: it binds one of its own and prints it)."""
    command = [sys.executable, __file__, "_floor", "--port", str(port), "--processes", str(processes)]
    return command + ["--work"] * work + ["--fork"] * fork


def serve_floor(port: int, processes: int, work: bool, fork: bool) -> int:
    """``_floor``: an asyncio HTTP/1.1 server answering every request at once, with a fixed JSON body, or
    (``work``) as a plain router would: the body parsed by ``orjson``, its tokens hashed into blocks by
    kvrouter's hasher, a small JSON answer. ``processes`` > 1: it binds with ``SO_REUSEPORT`` and starts
    ``processes`` - 1 more of itself on that port, which the kernel deals connections to, each process its
    own; they stop when it does. They are spawned (as kvrouter's fronts are), or (``fork``) forked from
    this process once it has answered one request, before any loop: they share its memory until they
    write it."""
    import asyncio

    import orjson

    fixed = b'{"status":"ok"}'

    def answer(body: bytes) -> bytes:
        out = fixed
        if work and body:
            hashes = block_hashes_array(orjson.loads(body)["token_ids"], BLOCK)
            out = orjson.dumps({"worker_id": int(hashes[-1] % WORKERS), "blocks": len(hashes)})
        return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(out), out)

    class Answering(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.transport, self.buffer = transport, b""

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
                length = 0
                for line in self.buffer[:end].split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if len(self.buffer) < end + 4 + length:
                    return
                body = self.buffer[end + 4 : end + 4 + length]
                self.buffer = self.buffer[end + 4 + length :]
                self.transport.write(answer(body))

    def listen(port: int) -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
        return listener

    async def serve(listener: socket.socket, listening: Callable[[], object]) -> None:
        server = await asyncio.get_running_loop().create_server(Answering, sock=listener)
        listening()
        await server.serve_forever()

    def forked(port: int) -> int:
        """A copy of this process serving its own listener on ``port``; returns once it listens."""
        readable, writable = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                asyncio.run(serve(listen(port), lambda: os.write(writable, b"l")))
            except SystemExit:  # SIGTERM: this process's handler, inherited
                code = 0
            finally:
                os._exit(code)  # not this function's caller's cleanup: its siblings are not this copy's
        os.close(writable)
        os.read(readable, 1)
        os.close(readable)
        return pid

    listener = listen(port)
    port = listener.getsockname()[1]
    if fork:
        answer(orjson.dumps({"token_ids": list(range(PROMPT_TOKENS))}))  # what the copies then share
    spawned: list[subprocess.Popen[bytes]] = []
    copies: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for _ in range(processes - 1):
            if fork:
                copies.append(forked(port))
            else:
                spawned.append(subprocess.Popen(floor_command(port, work), stdout=subprocess.PIPE))
        for process in spawned:  # started together; each prints its port once it listens
            assert process.stdout is not None
            process.stdout.readline()
            process.stdout.close()
        asyncio.run(serve(listener, lambda: print(port, flush=True)))
    finally:
        for process in spawned:
            process.terminate()
        for pid in copies:
            os.kill(pid, signal.SIGTERM)
        for process in spawned:
            process.wait()
        for pid in copies:
            os.waitpid(pid, 0)
    return 0


def median_point(points: list[dict[str, Any]]) -> dict[str, Any]:
    """One point from a point's rounds: the median of each figure, errors summed (a single round as it is)."""
    if len(points) == 1:
        return points[0]
    merged: dict[str, Any] = {"connections": points[0]["connections"], "rounds": len(points)}
    for key in ("rps", "p50_ms", "p99_ms", "server_cpu_us", "wrk_cpu_share", "wrk_cpu_us"):
        merged[key] = statistics.median(p[key] for p in points)
    merged["requests"] = sum(p["requests"] for p in points)
    merged["errors"] = sum(p["errors"] for p in points)
    return merged


def print_table(result: dict[str, Any]) -> None:
    header = ("server", "conns", "req/s", "p50 ms", "p99 ms", "srv CPU µs/req", "wrk CPU", "errors")
    print("{:<10} {:>5} {:>9} {:>8} {:>8} {:>15} {:>8} {:>6}".format(*header))
    for name, by_c in result["points"].items():
        for c, p in by_c.items():
            print(
                f"{name:<10} {c:>5} {p['rps']:>9.0f} {p['p50_ms']:>8.2f} {p['p99_ms']:>8.2f} "
                f"{p['server_cpu_us']:>15.0f} {p['wrk_cpu_share']:>7.0%} {p['errors']:>6}"
            )
    for name, by_c in result["rounds"].items():
        for c, rounds in by_c.items():
            if len(rounds) > 1:
                figures = "; ".join(f"{p['rps']:.0f} req/s p99 {p['p99_ms']:.2f} ms" for p in rounds)
                print(f"{name} at concurrency {c}, round by round (its row: medians): {figures}")
    if result.get("floor"):
        f = result["floor"]
        print(
            f"machine floor at concurrency {TAIL_CONCURRENCY} (an asyncio server answering at once, no work): "
            f"{f['rps']:.0f} req/s, p50 {f['p50_ms']:.2f} ms, p99 {f['p99_ms']:.2f} ms"
        )
    if result.get("fronts_cpu"):
        fc = result["fronts_cpu"]
        verdict = "met" if fc["cpu_ratio"] >= fc["goal"] else "not met"
        print(
            f"server CPU per /select at concurrency {RATIO_CONCURRENCY}, {fc['fronts']} fronts ÷ {fc['compare']} "
            f"fronts (median over rounds): {fc['cpu_ratio']:.2f}  goal ≥ {fc['goal']:.2f} (within 10 %): {verdict}"
        )
        for how, ratio in fc["floor_cpu_ratios"].items():
            print(
                f"the fronts' floor, {how}: the same ratio for {fc['fronts']} and {fc['compare']} plain asyncio "
                f"processes on one port (SO_REUSEPORT, each request parsed and hashed): {ratio:.2f}"
            )
    fast = result.get("fastpath") or {}
    for c, p in fast.get("points", {}).items():
        print(
            f"{'kvr-zmq':<10} {c:>5} {p['rps']:>9.0f} {p['p50_ms']:>8.2f} {p['p99_ms']:>8.2f} "
            f"{p['server_cpu_us']:>15.0f} {p['gen_cpu_share']:>7.0%} {p['errors']:>6}"
        )
    if fast.get("generator_ceiling"):
        ceiling = fast["generator_ceiling"]
        print(
            f"kvr-zmq: the generator column is the Python generator's CPU; against a ROUTER that answers at once "
            f"it drives {ceiling['rps']:.0f} req/s at {ceiling['connections']} sockets "
            f"(p50 {ceiling['p50_ms']:.3f} ms, {ceiling['gen_cpu_us']:.0f} µs CPU/req)"
        )
    if result["phases_us"]:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in result["phases_us"].items())
        print(f"kvrouter time per /select at concurrency {RATIO_CONCURRENCY} (µs, mean): {parts}")
    else:
        print("kvrouter time per phase: the service exports no kvrouter_routing_overhead_seconds histogram")
    if result["ratios"]:
        print(f"ratios ({result['ratio_basis']}):")
        for key, value in result["ratios"].items():
            goal = result["goals"][key]
            print(f"  {key:<18} {value:>6.2f}  goal ≥ {goal:g}: {'met' if value >= goal else 'not met'}")


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM ends a run as Ctrl-C does: the servers it started are stopped on the way out (by default the
    signal killed this process alone, and its servers went on serving, with their segments)."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_serve"]:
        serving = argparse.ArgumentParser(prog="bench_service.py _serve")
        serving.add_argument("--port", type=int, required=True)
        serving.add_argument("--shards", type=int, default=1)
        serving.add_argument("--zmq-port", type=int, default=None)
        serving.add_argument("--fronts", type=int, default=1)
        serving.add_argument("--model-path", dest="model_paths", action="append", default=[])
        options = serving.parse_args(argv[1:])
        return serve(options.port, options.shards, options.zmq_port, options.fronts, options.model_paths)
    if argv[:1] == ["_zmq_load"]:
        loading = argparse.ArgumentParser(prog="bench_service.py _zmq_load")
        loading.add_argument("--endpoint", required=True)
        loading.add_argument("--bodies", type=Path, required=True)
        loading.add_argument("--connections", type=int, required=True)
        loading.add_argument("--seconds", type=float, required=True)
        loading.add_argument("--tokens", choices=("bin", "list"), default="bin")
        options = loading.parse_args(argv[1:])
        return zmq_load(options.endpoint, options.bodies, options.connections, options.seconds, options.tokens)
    if argv[:1] == ["_zmq_echo"]:
        echoing = argparse.ArgumentParser(prog="bench_service.py _zmq_echo")
        echoing.add_argument("--port", type=int, required=True)
        return zmq_echo(echoing.parse_args(argv[1:]).port)
    if argv[:1] == ["_floor"]:
        flooring = argparse.ArgumentParser(prog="bench_service.py _floor")
        flooring.add_argument("--port", type=int, required=True)
        flooring.add_argument("--processes", type=int, default=1)
        flooring.add_argument("--work", action="store_true")
        flooring.add_argument("--fork", action="store_true")
        options = flooring.parse_args(argv[1:])
        return serve_floor(options.port, options.processes, options.work, options.fork)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=SECONDS, help="per measured point")
    parser.add_argument("--warmup", type=float, default=WARMUP_SECONDS, help="per server, at concurrency 8")
    parser.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help="measured rounds of the concurrency-1 and -8 points (the ratios' median)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument(
        "--fastpath-concurrency",
        type=int,
        nargs="*",
        default=list(FASTPATH_CONCURRENCY),
        help="DEALER sockets per ZMQ fast-path point (none: skip the fast path)",
    )
    parser.add_argument(
        "--fastpath-tokens",
        choices=("bin", "list"),
        default="bin",
        help="fast-path token ids as msgpack bin of little-endian u32, or as a msgpack array",
    )
    parser.add_argument(
        "--fronts",
        type=int,
        default=os.cpu_count() or 1,
        help="kvrouter's front processes (kvrouter up --fronts; default: one per core, as an operator would run it)",
    )
    parser.add_argument(
        "--compare-fronts",
        type=int,
        default=COMPARE_FRONTS,
        help="a second kvrouter with this many fronts, its concurrency-8 rounds alternated with the first's "
        "(server CPU per /select compared; 0: none)",
    )
    parser.add_argument("--bodies", type=int, default=BODIES, help="distinct prompts cycled")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--sides", nargs="+", choices=SIDES, default=list(SIDES), help="servers to measure (both for the ratios)"
    )
    parser.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK}")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    for needed in (TAIL_CONCURRENCY, RATIO_CONCURRENCY):
        if needed not in args.concurrency:
            args.concurrency.append(needed)
    load_before = os.getloadavg()
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, _terminated)
    with tempfile.TemporaryDirectory(prefix="bench_service-") as tmp:
        result = run(args, Path(tmp))
    result["machine"] = {
        "cpu_count": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
        "seconds_per_point": args.seconds,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    print_table(result)
    m = result["machine"]
    print(
        f"machine: {m['cpu_count']} CPUs; load average {m['loadavg_before']} before, {m['loadavg_after']} after; "
        f"python {m['python']}; {args.seconds:g} s per point; {result['generator']}; {m['wall_seconds']:.0f} s"
    )
    result["shm_left"] = SHM_LEFT
    print(f"shm: {'clean' if not SHM_LEFT else 'left behind: ' + ', '.join(SHM_LEFT)}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    errors = sum(p["errors"] for by_c in result["points"].values() for p in by_c.values())
    errors += sum(p["errors"] for p in (result.get("fastpath") or {}).get("points", {}).values())
    return 1 if errors or SHM_LEFT else 0


if __name__ == "__main__":
    sys.exit(main())
