"""``MockEngine``: the simulator's ``WorkerModel`` run against a real-time clock, publishing real KV events.

The router's event plane can only be tested end to end against something that caches, evicts and
publishes like an engine, without a GPU. Rather than a second model, the mock engine drives the very
model the routing simulator uses (``scheduler.py``, ``kv_cache.py``), unchanged: one engine thread per
dp rank steps it and sleeps each iteration's simulated duration divided by ``speedup_ratio``, then
publishes that iteration's events as one batch, as vLLM publishes one batch per engine step
(``spec/wire-formats.md`` §1.1). The cost of reusing the model is translation at the edge, below.

**Block ids.** The model names a block by one int. For a prompt block the mock uses the router's
chained sequence hash of the prompt's local hashes (``block_hashes`` + ``sequence_hashes``), masked
below :data:`~kvrouter.worker.GENERATED_ID_BASE` as the model requires, so equal prefixes share blocks
exactly as in a prefix cache. The same int is the block's engine hash on the wire: opaque to the
router, as vLLM's are (§1.8). A generated block keeps the model's own id (per request and position,
never shared); its tokens are the prompt's tail plus synthetic output tokens derived from the request's
serial and position (:func:`output_token`), so every stored block carries real token ids the router can
re-hash. The one thing this does not model: a later prompt that repeats an earlier request's output is
not a cache hit here (vLLM's would be), because the generated block's id is not the prompt block's
id. The mock never returns its output tokens, so a client cannot build such a prompt by accident.

**Time.** Virtual milliseconds are tied to the wall clock (``(now - start) * 1000 * speedup``). An
idle engine starts an iteration at the earliest arrival among the requests it picks up; a busy one
chains iterations back to back in virtual time and sleeps until each one's end on the wall clock, so
a slow machine lags instead of stretching the simulated numbers. A lone request's simulated TTFT is
therefore exactly the prefill polynomial whatever the speedup (``timing.py``, §2.3 of the routing
benchmark). ``ttft_ms`` and ``finish_ms`` are virtual milliseconds from the request's arrival.

**Threads.** Each rank's engine thread owns its model and its publisher (neither is thread-safe):
HTTP threads only queue commands (a request, a cache snapshot, a fault, a restart) and wake the
thread through a pipe it polls together with the replay / query socket. Commands run between
iterations, so ``GET /cache`` always shows a state whose events have all been published (or are held
by a pause, which the snapshot reports).

**Faults.** ``drop_batches`` N: the next N batches are published with ``send=False`` (a seq or event-id
gap on the wire, recoverable by replay / query). ``pause``: batches are held back, in order, and
published when publishing resumes; replay and query requests are still answered meanwhile (from what
was published before the pause). ``restart``: a fresh model (empty cache), a new publisher incarnation
(seq / event ids from 0), faults cleared; requests in flight fail.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import logging
import math
import os
import queue
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

import zmq

from ..errors import ConfigError, RequestFailed
from ..events.model import U64_MAX, EngineHash, EventBatch, KvEvent, LocalHash, Removed, Stored, StoredBlock
from ..hashing import block_hashes, sequence_hashes
from .engine_publisher import DEFAULT_HWM, EnginePublisher
from .kv_transfer import TransferServer
from .publisher import KvPublisher
from .scheduler import GENERATED_ID_BASE, WorkerConfig, WorkerModel, generated_block_id

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_NUM_GPU_BLOCKS",
    "FORMATS",
    "MockEngine",
    "MockEngineConfig",
    "output_token",
]

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE: Final = 16
"""Tokens per block: vLLM's default ``--block-size`` and Dynamo's mocker's."""

DEFAULT_NUM_GPU_BLOCKS: Final = 4096
"""KV blocks per dp rank: Dynamo's mocker's ``--num-gpu-blocks`` default."""

FORMATS: Final = ("vllm", "kvrouter")
"""Wire formats the mock publishes: vLLM frames with a vLLM replay socket, or kvrouter's with a local indexer."""

MODEL_WORKER_ID: Final = 0
"""The worker id the model itself is given. It only salts generated block ids, which need to be unique
within one rank's cache; the configured worker id is what events and ``/cache`` carry, so it may be any
u64 (the model's id field is 12 bits)."""

_PROMPT_ID_MASK: Final = GENERATED_ID_BASE - 1
_REQUEST_SHIFT: Final = (generated_block_id(0, 1, 0) ^ generated_block_id(0, 0, 0)).bit_length() - 1
"""Where the request serial sits in a generated block id, read off :func:`generated_block_id` itself."""
MAX_REQUEST_BLOCKS: Final = 1 << _REQUEST_SHIFT
"""A generated block id has room for this many block positions per request."""

_IDLE_POLL_MS: Final = 20
"""Longest poll when the publisher's socket cannot be polled directly (kvrouter format): query latency."""

_WAKE: Final = b"w"


def output_token(serial: int, position: int) -> int:
    """The synthetic token the mock "generates" at ``position`` of its ``serial``-th request (splitmix64).

    Deterministic, so a generated block re-stored after a preemption carries the same tokens, and
    spread over u31 so two requests' outputs never share a block by chance.
    """
    x = (serial * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x94D049BB133111EB) & U64_MAX
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64_MAX
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64_MAX
    return (x ^ (x >> 31)) & 0x7FFF_FFFF


@dataclass(frozen=True, slots=True)
class MockEngineConfig:
    """Everything ``kvrouter mock-worker`` takes, named after Dynamo's mocker where it has a name."""

    worker_id: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    num_gpu_blocks: int = DEFAULT_NUM_GPU_BLOCKS
    speedup_ratio: float = 1.0
    dp_size: int = 1
    format: Literal["vllm", "kvrouter"] = "vllm"
    host: str = "127.0.0.1"
    zmq_kv_events_port: int = 5557
    """Rank r publishes on this port + r; 0 = an ephemeral port per rank."""
    zmq_replay_port: int | None = None
    """Rank r answers replays (vllm) or queries (kvrouter) on this port + r; None = none; 0 = ephemeral."""
    topic: bytes = b""
    kv_events_hwm: int = DEFAULT_HWM
    """The vllm-format PUB's send high-water mark per subscriber (vLLM's ``KVEventsConfig.hwm``): past it,
    a subscriber that does not read loses messages, which it sees as a gap."""
    kv_events_sndbuf: int = 0
    """The vllm-format PUB's kernel send buffer per subscriber, bytes; 0 = the OS's autotuned default."""
    nats_url: str | None = None
    """kvrouter format: also publish every event on NATS core, as the reference's workers do (``RouterEvent``
    JSON on ``nats_subject``, ``docs/nats-bridge.md`` "Events over NATS"); None = ZMQ only."""
    nats_subject: str = ""
    """The ``kv-events`` subject of the router's namespace and component."""
    role: Literal["prefill", "decode", "both"] = "both"
    """Disaggregated serving (``kv_transfer.py``): a prefill engine offers its prompts' KV after a prefill hop, a
    decode engine pulls it before a decode hop; ``both`` does either, and every engine serves plain requests."""
    kv_bytes_per_token: int = 131_072
    kv_transfer_gbps: float = 25.0
    kv_transfer_port: int = 0
    """Where a prefill engine serves pulls; 0 = an ephemeral port."""
    kv_hold_secs: float = 30.0
    """How long an offered prompt's KV waits for its pull (wall seconds)."""
    lora_adapters: tuple[str, ...] = ()
    """The LoRA adapters it serves (vLLM's ``--lora-modules`` names): a request whose ``model`` names one is
    computed with it, so its blocks are hashed with the name and stored with ``lora_name``, as vLLM's."""

    def validate(self) -> None:
        """Raises ConfigError naming the first field out of range."""
        checks = (
            (0 <= self.worker_id <= U64_MAX, "worker_id", "in [0, 2**64)"),
            (self.block_size >= 1, "block_size", ">= 1"),
            (self.num_gpu_blocks >= 1, "num_gpu_blocks", ">= 1"),
            (self.speedup_ratio > 0, "speedup_ratio", "> 0"),
            (self.dp_size >= 1, "dp_size", ">= 1"),
            (self.format in FORMATS, "format", f"one of {FORMATS}"),
            (0 <= self.zmq_kv_events_port <= 65535, "zmq_kv_events_port", "in [0, 65535]"),
            (self.zmq_replay_port is None or 0 <= self.zmq_replay_port <= 65535, "zmq_replay_port", "in [0, 65535]"),
            (self.kv_events_hwm >= 1, "kv_events_hwm", ">= 1"),
            (self.kv_events_sndbuf >= 0, "kv_events_sndbuf", ">= 0"),
            (self.nats_url is None or self.format == "kvrouter", "format", "'kvrouter' to publish on NATS"),
            (self.nats_url is None or bool(self.nats_subject), "nats_subject", "set with nats_url"),
            (self.role in ("prefill", "decode", "both"), "role", "prefill, decode or both"),
            (self.kv_bytes_per_token >= 1, "kv_bytes_per_token", ">= 1"),
            (self.kv_transfer_gbps > 0, "kv_transfer_gbps", "> 0"),
            (0 <= self.kv_transfer_port <= 65535, "kv_transfer_port", "in [0, 65535]"),
            (self.kv_hold_secs > 0, "kv_hold_secs", "> 0"),
            (all(1 <= len(name) <= 256 for name in self.lora_adapters), "lora_adapters", "names of 1..256 characters"),
        )
        for ok, name, rule in checks:
            if not ok:
                raise ConfigError(f"mock engine: {name} must be {rule}, got {getattr(self, name)!r}")

    def endpoint(self, port: int | None, rank: int) -> str | None:
        """vLLM's dp-rank port rule (``spec/wire-formats.md`` §1.7): port + rank, port 0 unchanged."""
        if port is None:
            return None
        return f"tcp://{self.host}:{port + rank if port else 0}"


# -- one request ---------------------------------------------------------------------------------


class Update(enum.Enum):
    """What a request's waiter is told, in order: FIRST_TOKEN once, then DONE or FAILED."""

    FIRST_TOKEN = "first_token"
    DONE = "done"
    FAILED = "failed"


@dataclass(slots=True, eq=False)
class Completion:
    """One request inside the mock, and what the HTTP side reads back from it."""

    prompt: array[int]
    max_tokens: int
    dp_rank: int
    arrival_ms: float
    """Virtual ms when the request arrived; clamped to its first iteration's start."""
    serial: int = -1
    """The model's admission serial on this rank (its generated block ids carry it)."""
    locals: list[int] = field(default_factory=list)
    """Local hashes of the request's full blocks: the prompt's, then generated ones as they are stored."""
    ids: list[int] = field(default_factory=list)
    """The prompt's block ids (masked sequence hashes)."""
    cached_tokens: int = 0
    """Prompt tokens reused from the cache at first admission."""
    ttft_ms: float | None = None
    finish_ms: float | None = None
    error: RequestFailed | None = None
    received: tuple[int, ...] | None = None
    """The prompt's block ids pulled from a prefill engine (a decode hop): stored before it is admitted."""
    lora_name: str | None = None
    """The LoRA adapter it runs with: part of every one of its blocks' hashes (and so of their ids)."""
    cache_salt: str | None = None
    """Its cache salt (vLLM's and SGLang's ``cache_salt``): likewise, so only requests of the same salt
    share its blocks."""
    updates: queue.SimpleQueue[Update] = field(default_factory=queue.SimpleQueue)
    """FIRST_TOKEN, then DONE or FAILED, pushed by the engine thread."""

    @property
    def request_id(self) -> str:
        return f"{self.dp_rank}-{self.serial}"

    def tokens(self, index: int, block_size: int) -> tuple[int, ...]:
        """Block ``index``'s token ids: prompt tokens, then synthetic output tokens."""
        start = index * block_size
        prompt = len(self.prompt)
        return tuple(
            self.prompt[p] if p < prompt else output_token(self.serial, p) for p in range(start, start + block_size)
        )

    def fail(self, error: RequestFailed) -> None:
        self.error = error
        self.updates.put(Update.FAILED)


@dataclass(frozen=True, slots=True)
class _Call:
    """A command for the engine thread (a snapshot, a fault, a restart) and where its answer goes."""

    command: Callable[[], Any]
    future: Future[Any]

    def run(self) -> None:
        try:
            self.future.set_result(self.command())
        except Exception as exc:  # handed to the waiter, which re-raises it
            self.future.set_exception(exc)


@dataclass(frozen=True, slots=True)
class _Block:
    """A cached block as ``/cache`` shows it: its parent and its path of local hashes."""

    parent: int | None
    path_owner: list[int]
    """A request's ``locals`` list; this block's path is its first ``depth`` entries (shared, not copied)."""
    depth: int


# -- publishers ----------------------------------------------------------------------------------


class _Sink(Protocol):
    """The one publisher a rank owns, whatever its format."""

    poll_socket: zmq.Socket[bytes] | None
    """A socket to poll for replay / query requests, when the publisher exposes it."""
    needs_serving: bool
    """Whether ``serve`` must run even when nothing polls readable (no ``poll_socket`` exposed)."""

    def publish(self, events: Sequence[KvEvent], dp_rank: int, *, send: bool) -> None: ...
    def serve(self) -> None: ...
    def reset(self) -> None: ...
    def close(self) -> None: ...
    def position(self) -> dict[str, int | None]: ...
    def endpoints(self) -> tuple[str, str | None]: ...


class _VllmSink:
    def __init__(self, config: MockEngineConfig, rank: int, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        events = config.endpoint(config.zmq_kv_events_port, rank)
        assert events is not None
        self._pub = EnginePublisher(
            events,
            replay_endpoint=config.endpoint(config.zmq_replay_port, rank),
            topic=config.topic,
            hwm=config.kv_events_hwm,
            sndbuf=config.kv_events_sndbuf,
            context=context,
        )
        self.poll_socket = self._pub.replay_socket
        self.needs_serving = False

    def publish(self, events: Sequence[KvEvent], dp_rank: int, *, send: bool) -> None:
        self._pub.publish(EventBatch(tuple(events), dp_rank=dp_rank), send=send)

    def serve(self) -> None:
        self._pub.serve()

    def reset(self) -> None:
        self._pub.reset()

    def close(self) -> None:
        self._pub.close()

    def position(self) -> dict[str, int | None]:
        return {"last_seq": self._pub.last_seq}

    def endpoints(self) -> tuple[str, str | None]:
        return self._pub.endpoint, self._pub.replay_endpoint


class _KvrouterSink:
    """kvrouter's format through :class:`~kvrouter.worker.publisher.KvPublisher`: the replay port serves
    its local-indexer queries. It does not expose its query socket, so the engine thread serves it at
    least every :data:`_IDLE_POLL_MS`."""

    def __init__(self, config: MockEngineConfig, rank: int, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        events = config.endpoint(config.zmq_kv_events_port, rank)
        assert events is not None
        self._sink: Any = None
        if config.nats_url is not None:
            from ..bridge.events import NatsEventSink  # here: nats-py is loaded only by the engines that use it

            self._sink = NatsEventSink(config.nats_url, config.nats_subject)
        try:
            self._pub = KvPublisher(
                config.worker_id,
                block_size=config.block_size,
                endpoint=events,
                query_endpoint=config.endpoint(config.zmq_replay_port, rank),
                dp_rank=rank,
                topic=config.topic,
                context=context,
                nats=self._sink,
            )
        except BaseException:
            if self._sink is not None:
                self._sink.close()
            raise
        self.poll_socket: zmq.Socket[bytes] | None = None
        self.needs_serving = True

    def publish(self, events: Sequence[KvEvent], dp_rank: int, *, send: bool) -> None:
        pub = self._pub
        for event in events:
            if isinstance(event, Stored):
                tokens = [token for block in event.blocks for token in block.token_ids or ()]
                engine = [block.engine_hash for block in event.blocks]
                pub.store(engine, tokens, parent=event.parent, lora_name=event.lora_name, cache_salt=event.cache_salt)
            elif isinstance(event, Removed):
                pub.remove(event.engine_hashes)
            else:
                pub.clear()
        pub.publish(send=send)

    def serve(self) -> None:
        self._pub.serve()

    def reset(self) -> None:
        self._pub.reset()

    def close(self) -> None:
        try:
            self._pub.close()
        finally:
            if self._sink is not None:
                self._sink.close()  # publishes what is queued, flushes, disconnects

    def position(self) -> dict[str, int | None]:
        return {"last_event_id": self._pub.last_event_id}

    def endpoints(self) -> tuple[str, str | None]:
        return self._pub.endpoint, self._pub.query_endpoint


def _make_sink(config: MockEngineConfig, rank: int, context: zmq.Context[zmq.Socket[bytes]]) -> _Sink:
    if config.format == "vllm":
        return _VllmSink(config, rank, context)
    return _KvrouterSink(config, rank, context)


# -- one dp rank ---------------------------------------------------------------------------------


class _Rank:
    """One dp rank: a model, a publisher and the engine thread that owns both."""

    def __init__(self, config: MockEngineConfig, rank: int, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.config = config
        self.rank = rank
        self.sink = _make_sink(config, rank, context)
        self._commands: deque[Completion | _Call] = deque()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self.failed = False
        """The engine thread died of an unexpected error (logged); ``/health`` reports it."""
        self._start_wall = time.monotonic()
        self._ms_per_s = 1000.0 * config.speedup_ratio
        self._thread = threading.Thread(target=self._run, name=f"mock-engine-dp{rank}", daemon=True)
        self._new_incarnation()

    def _new_incarnation(self) -> None:
        cfg = self.config
        self.model = WorkerModel(
            MODEL_WORKER_ID,
            WorkerConfig(block_size=cfg.block_size, num_blocks=cfg.num_gpu_blocks),
            dp_rank=self.rank,
        )
        self._serials = itertools.count()
        self._live: dict[str, Completion] = {}
        self._prompt_blocks: dict[int, tuple[Completion, int, int]] = {}
        """Prompt block id -> (a live request holding it, its index there, live requests holding it)."""
        self._cached: dict[int, _Block] = {}
        """What the engine caches: every block stored and not yet removed."""
        self._held: list[list[KvEvent]] = []
        self._drop = 0
        self._paused = False
        self._end_ms = self.now_ms()

    # -- called from any thread -----------------------------------------------------------------

    def now_ms(self) -> float:
        """Virtual milliseconds since this rank started."""
        return (time.monotonic() - self._start_wall) * self._ms_per_s

    def call(self, command: Callable[[], Any]) -> Future[Any]:
        """Run ``command`` on the engine thread between iterations; its result or exception in the future."""
        call = _Call(command, Future())
        self._post(call)
        return call.future

    def submit(self, request: Completion) -> None:
        self._post(request)

    def _post(self, command: Completion | _Call) -> None:
        with self._lock:
            if self._stopping:
                raise RequestFailed(f"dp rank {self.rank}: the engine is shutting down", 503)
            self._commands.append(command)
        with contextlib.suppress(BlockingIOError):  # a full pipe already means "wake up"
            os.write(self._wake_w, _WAKE)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the engine thread; False if it did not end within ``timeout``."""
        with self._lock:
            self._stopping = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, _WAKE)
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif not self._thread.ident:  # never started: the sockets are still ours to close
            self.sink.close()
        if self._thread.is_alive():
            log.error("mock engine thread did not stop dp=%d timeout_s=%.1f", self.rank, timeout)
            return False
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        return True

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self.sink.poll_socket is not None:
            poller.register(self.sink.poll_socket, zmq.POLLIN)
        pending: tuple[float, list[Completion], list[Completion], list[KvEvent]] | None = None
        try:
            while True:
                if pending is None:
                    timeout: int | None = _IDLE_POLL_MS if self.sink.needs_serving else None
                else:
                    timeout = max(0, math.ceil((pending[0] - time.monotonic()) * 1000.0))
                    if self.sink.needs_serving:
                        timeout = min(timeout, _IDLE_POLL_MS)
                ready = dict(poller.poll(timeout))
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                if self.sink.needs_serving or (self.sink.poll_socket is not None and self.sink.poll_socket in ready):
                    self.sink.serve()
                with self._lock:
                    if self._stopping:
                        break
                if pending is not None:
                    if time.monotonic() < pending[0]:
                        continue
                    self._finish_iteration(*pending[1:])
                    pending = None
                self._run_commands()
                if self.model.has_work():
                    pending = self._start_iteration()
        except Exception:
            # A bug, not an input: stop taking work so no request waits on a dead thread.
            log.exception("mock engine thread failed dp=%d", self.rank)
            self.failed = True
            with self._lock:
                self._stopping = True
            raise
        finally:
            error = RequestFailed(f"dp rank {self.rank}: the engine {'failed' if self.failed else 'stopped'}", 503)
            for request in pending[2] if pending is not None else ():
                request.fail(error)  # finished in the model, not yet told: gone from the live set
            self._fail_all(error)
            self.sink.close()

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                command = self._commands.popleft()
            if isinstance(command, Completion):
                self._add(command)
            else:
                command.run()

    def _add(self, request: Completion) -> None:
        """Queue ``request`` in the model; runs on the engine thread."""
        size = self.config.block_size
        request.locals = block_hashes(
            request.prompt, size, lora_name=request.lora_name, cache_namespace=request.cache_salt
        )
        request.ids = [h & _PROMPT_ID_MASK for h in sequence_hashes(request.locals)]
        if request.received is not None and list(request.received) != request.ids:
            request.fail(
                RequestFailed("the pulled KV is another prompt's: its block ids differ from this prompt's", 502)
            )
            return
        serial = next(self._serials)
        request.serial = serial
        try:
            self.model.add_request(
                request.request_id,
                len(request.prompt),
                request.max_tokens,
                request.ids,
                received=request.received is not None,
            )
        except ValueError as exc:
            self._serials = itertools.count(serial)  # the model did not take a serial either
            request.fail(RequestFailed(str(exc), 400))
            return
        if not self._live:  # idle until now: the next iteration starts at this arrival
            self._end_ms = max(self._end_ms, request.arrival_ms)
        request.arrival_ms = min(request.arrival_ms, self._end_ms)
        self._live[request.request_id] = request
        for index, block in enumerate(request.ids):
            entry = self._prompt_blocks.get(block)
            holder, at, count = entry if entry is not None else (request, index, 0)
            self._prompt_blocks[block] = (holder, at, count + 1)
        if request.received is not None:  # the pulled KV is stored, and published, before the request runs
            events = [self._translate(event) for event in self.model.receive(request.ids)]
            if events:
                if self._paused:
                    self._held.append(events)
                else:
                    self._send(events)

    def _start_iteration(self) -> tuple[float, list[Completion], list[Completion], list[KvEvent]]:
        """Step the model once; returns the wall deadline, who got a first token, who finished, the events."""
        it = self.model.step()
        self._end_ms += it.duration_ms
        for request_id, cached in it.admitted:
            self._live[request_id].cached_tokens = cached
        events = [self._translate(event) for event in it.events]
        first = [self._live[request_id] for request_id in it.first_tokens]
        finished = [self._live.pop(request_id) for request_id in it.finished]
        for request in finished:
            self._forget_prompt(request)
        return self._start_wall + self._end_ms / self._ms_per_s, first, finished, events

    def _finish_iteration(self, first: list[Completion], finished: list[Completion], events: list[KvEvent]) -> None:
        """The iteration's end: publish its events as one batch, tell the waiters."""
        if events:
            if self._paused:
                self._held.append(events)
            else:
                self._send(events)
        end = self._end_ms
        for request in first:
            request.ttft_ms = end - request.arrival_ms
            request.updates.put(Update.FIRST_TOKEN)
        for request in finished:
            request.finish_ms = end - request.arrival_ms
            request.updates.put(Update.DONE)

    def _send(self, events: list[KvEvent]) -> None:
        send = self._drop == 0
        self._drop = max(0, self._drop - 1)
        self.sink.publish(events, self.rank, send=send)

    # -- translating the model's events ---------------------------------------------------------

    def _translate(self, event: KvEvent) -> KvEvent:
        """A model event (ids as both hashes) as the wire has it: real local hashes and tokens; records /cache."""
        worker = self.config.worker_id
        if isinstance(event, Removed):
            for gone in event.engine_hashes:
                self._cached.pop(gone, None)
            return Removed(worker, event.engine_hashes, dp_rank=self.rank)
        assert isinstance(event, Stored), f"the model emits Stored and Removed only, got {event!r}"
        parent: int | None = event.parent
        blocks = []
        owner = None
        for stored in event.blocks:
            block = int(stored.engine_hash)
            owner, index = self._owner(block)
            local = self._local(owner, index)
            self._cached[block] = _Block(parent, owner.locals, index + 1)
            blocks.append(StoredBlock(EngineHash(block), LocalHash(local), owner.tokens(index, self.config.block_size)))
            parent = block
        # one store is one chain, and a chain's ids carry its adapter and salt: all its owners share them
        lora, salt = (None, None) if owner is None else (owner.lora_name, owner.cache_salt)
        lora_id = None if lora is None else self.config.lora_adapters.index(lora) + 1  # vLLM numbers from 1
        return Stored(
            worker, event.parent, tuple(blocks), dp_rank=self.rank, lora_name=lora, lora_id=lora_id, cache_salt=salt
        )

    def _owner(self, block: int) -> tuple[Completion, int]:
        """The live request a stored block belongs to, and the block's index in it."""
        if block < GENERATED_ID_BASE:
            holder, index, _count = self._prompt_blocks[block]
            return holder, index
        serial = (block ^ GENERATED_ID_BASE) >> _REQUEST_SHIFT  # the model's worker id bits are 0
        index = block & (MAX_REQUEST_BLOCKS - 1)
        owner = self._live.get(f"{self.rank}-{serial}")
        if owner is None or generated_block_id(MODEL_WORKER_ID, serial, index) != block:
            raise AssertionError(f"dp rank {self.rank}: generated block {block:#x} belongs to no live request")
        return owner, index

    def _local(self, owner: Completion, index: int) -> int:
        """The local hash of ``owner``'s block ``index``, hashing generated blocks up to it on first use."""
        size = self.config.block_size
        while len(owner.locals) <= index:
            tokens = owner.tokens(len(owner.locals), size)
            owner.locals.append(
                block_hashes(tokens, size, lora_name=owner.lora_name, cache_namespace=owner.cache_salt)[0]
            )
        return owner.locals[index]

    def _forget_prompt(self, request: Completion) -> None:
        for block in request.ids:
            holder, at, count = self._prompt_blocks[block]
            if count == 1:
                del self._prompt_blocks[block]
            else:
                self._prompt_blocks[block] = (holder, at, count - 1)

    # -- commands -------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """``GET /cache`` for this rank (engine thread)."""
        blocks = [
            {
                "engine_hash": block,
                "parent": info.parent,
                "local_hashes": info.path_owner[: info.depth],
                "tier": "device",
            }
            for block, info in self._cached.items()
        ]
        return {
            "dp_rank": self.rank,
            **self.sink.position(),
            "held_batches": len(self._held),
            "preemptions": self.model.preemptions,
            "evictions": self.model.kv.evictions,
            "blocks": blocks,
        }

    def overlaps(self, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
        """``POST /overlap`` for this rank (engine thread): per prompt, how many of its leading full blocks
        this rank's cache holds, as ``/cache`` would show them, without shipping every block."""
        found = []
        for ids in prompts:
            held = 0
            for block in ids:
                if block not in self._cached:
                    break
                held += 1
            found.append(held)
        return {"dp_rank": self.rank, **self.sink.position(), "overlaps": found}

    def set_faults(self, drop_batches: int | None, pause: bool | None) -> dict[str, Any]:
        """``POST /faults`` for this rank (engine thread)."""
        if drop_batches is not None:
            self._drop = drop_batches
        if pause is not None:
            self._paused = pause
            if not pause:
                held, self._held = self._held, []
                for events in held:
                    self._send(events)
        return self.faults()

    def faults(self) -> dict[str, Any]:
        return {
            "dp_rank": self.rank,
            "drop_batches": self._drop,
            "paused": self._paused,
            "held_batches": len(self._held),
        }

    def restart(self) -> dict[str, Any]:
        """``POST /restart`` for this rank (engine thread): empty cache, new publisher incarnation."""
        self._fail_all(RequestFailed(f"dp rank {self.rank}: the engine restarted", 503))
        self.sink.reset()
        self._new_incarnation()
        log.info("mock engine restarted dp=%d", self.rank)
        return {"dp_rank": self.rank, **self.sink.position()}

    def _fail_all(self, error: RequestFailed) -> None:
        """Fail every request in the model; when stopping, every queued command too."""
        for request in self._live.values():
            request.fail(error)
        self._live.clear()
        with self._lock:
            queued = list(self._commands) if self._stopping else []
            if self._stopping:
                self._commands.clear()
        for command in queued:
            if isinstance(command, Completion):
                command.fail(error)
            else:
                command.future.set_exception(error)


class MockEngine:
    """Every dp rank of one mock worker; the HTTP front calls these methods from its threads.

    Raises:
        ConfigError: a setting out of range, or an endpoint that cannot be bound.
    """

    def __init__(self, config: MockEngineConfig) -> None:
        config.validate()
        self.config = config
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._ranks: list[_Rank] = []
        self._next_rank = itertools.count()
        self.transfers: TransferServer | None = None
        """Where decode engines pull this prefill engine's KV (role prefill or both)."""
        try:
            for rank in range(config.dp_size):
                self._ranks.append(_Rank(config, rank, self._context))
            if config.role != "decode":
                try:
                    self.transfers = TransferServer(
                        config.host,
                        config.kv_transfer_port,
                        kv_bytes_per_token=config.kv_bytes_per_token,
                        gbps=config.kv_transfer_gbps,
                        speedup=config.speedup_ratio,
                        hold_secs=config.kv_hold_secs,
                    )
                except OSError as exc:
                    raise ConfigError(
                        f"mock engine: cannot serve KV pulls on {config.host}:{config.kv_transfer_port}: {exc}"
                    ) from exc
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[tuple[str, str | None]]:
        """Per rank: the event endpoint and the replay / query endpoint (None without one)."""
        return [rank.sink.endpoints() for rank in self._ranks]

    def start(self) -> None:
        for rank in self._ranks:
            rank.start()

    def positions(self) -> list[dict[str, int | None]]:
        """Per rank, the last sequence number (vllm) or event id (kvrouter) published: read without the
        engine thread (an int attribute), so a caller can watch publishing while the engine runs."""
        return [{"dp_rank": rank.rank, **rank.sink.position()} for rank in self._ranks]

    def failed_ranks(self) -> list[int]:
        """Ranks whose engine thread died of an unexpected error; they answer 503 from then on."""
        return [rank.rank for rank in self._ranks if rank.failed]

    def close(self) -> None:
        """Stop every engine thread, close its sockets, fail what is still running."""
        if self.transfers is not None:
            self.transfers.close()
        stopped = [rank.stop() for rank in self._ranks]
        if all(stopped):
            self._context.term()
        else:  # an engine thread did not stop: close its sockets from here rather than hang
            self._context.destroy(linger=0)

    def __enter__(self) -> MockEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------------

    def submit(
        self,
        prompt: array[int],
        max_tokens: int,
        dp_rank: int | None = None,
        received: Sequence[int] | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> Completion:
        """Queue a completion; wait on its ``updates``. ``dp_rank`` None takes the ranks round robin; ``received``:
        the prompt's block ids a decode hop pulled (``kv_transfer.py``); ``lora_name``: the adapter it runs with;
        ``cache_salt``: its salt.

        Raises:
            RequestFailed: (400) a rank out of range or a request too large for the cache; (503)
                shutting down.
        """
        cfg = self.config
        rank = next(self._next_rank) % cfg.dp_size if dp_rank is None else dp_rank
        if not 0 <= rank < cfg.dp_size:
            raise RequestFailed(f"dp_rank {rank} is out of range for dp_size {cfg.dp_size}", 400)
        blocks = -(-(len(prompt) + max_tokens) // cfg.block_size)
        limit = min(cfg.num_gpu_blocks, MAX_REQUEST_BLOCKS)
        if blocks > limit:
            raise RequestFailed(
                f"prompt plus max_tokens need {blocks} blocks of {cfg.block_size} tokens; a request may use {limit}",
                400,
            )
        target = self._ranks[rank]
        request = Completion(prompt, max_tokens, rank, target.now_ms(), lora_name=lora_name, cache_salt=cache_salt)
        if received is not None:
            request.received = tuple(received)
        target.submit(request)
        return request

    # -- control --------------------------------------------------------------------------------

    def cache(self, timeout: float) -> dict[str, Any]:
        """``GET /cache``: every rank's cached blocks and last published seq / event id."""
        ranks = [rank.call(rank.snapshot) for rank in self._ranks]
        return {
            "worker_id": self.config.worker_id,
            "block_size": self.config.block_size,
            "format": self.config.format,
            "ranks": [future.result(timeout) for future in ranks],
        }

    def overlaps(
        self, prompts: Sequence[array[int]], timeout: float, lora_name: str | None = None, cache_salt: str | None = None
    ) -> list[Any]:
        """``POST /overlap``: every rank's overlap (leading cached blocks) with each prompt (run with the LoRA
        adapter ``lora_name`` and the salt ``cache_salt``).

        The prompts are hashed here, once, into the ids the ranks name prompt blocks by (masked sequence
        hashes); each rank then only looks them up between iterations.
        """
        size = self.config.block_size
        ids = [
            [
                h & _PROMPT_ID_MASK
                for h in sequence_hashes(block_hashes(prompt, size, lora_name=lora_name, cache_namespace=cache_salt))
            ]
            for prompt in prompts
        ]
        futures = [rank.call(functools.partial(rank.overlaps, ids)) for rank in self._ranks]
        return [future.result(timeout) for future in futures]

    def faults(self, drop_batches: int | None, pause: bool | None, dp_rank: int | None, timeout: float) -> list[Any]:
        """``POST /faults`` on one rank or all; returns each rank's fault state."""
        futures = [rank.call(functools.partial(rank.set_faults, drop_batches, pause)) for rank in self._select(dp_rank)]
        return [future.result(timeout) for future in futures]

    def restart(self, dp_rank: int | None, timeout: float) -> list[Any]:
        """``POST /restart`` on one rank or all."""
        futures = [rank.call(rank.restart) for rank in self._select(dp_rank)]
        return [future.result(timeout) for future in futures]

    def _select(self, dp_rank: int | None) -> list[_Rank]:
        if dp_rank is None:
            return self._ranks
        if not 0 <= dp_rank < len(self._ranks):
            raise RequestFailed(f"dp_rank {dp_rank} is out of range for dp_size {len(self._ranks)}", 400)
        return [self._ranks[dp_rank]]
