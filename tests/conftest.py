"""Shared fixtures: the reference data in ``../shared/fixtures``, resolved once.

Tests never open fixture paths themselves; they take these fixtures and use case / scenario names as
test ids (see ``pytest_generate_tests``).
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import strategies as st

import kvrouter
from kvrouter.events.codecs import BatchDecoder
from kvrouter.events.codecs.frames import ReplayFrame, parse_live, parse_replay_reply
from kvrouter.events.model import (
    Cleared,
    EngineHash,
    EventBatch,
    KvEvent,
    LocalHash,
    Removed,
    StorageTier,
    Stored,
    StoredBlock,
    parse_tier,
)
from kvrouter.hashing import block_hashes
from tests.clock import FakeClock
from tests.strategies import u32, u64

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
ENGINES = ("vllm-0.33.0", "vllm-0.23.0", "sglang-0.5.23")


def _load_json(name: str) -> Any:
    with (FIXTURES / name).open() as fh:
        return json.load(fh)


_cache: dict[str, Any] = {}


def _cached(name: str) -> Any:
    if name not in _cache:
        _cache[name] = _load_json(name)
    return _cache[name]


@pytest.fixture(scope="session")
def hash_vectors() -> list[dict[str, Any]]:
    """Cases of ``hash_vectors.json``: ``{name, inputs, block_hashes, sequence_hashes}``."""
    return list(_cached("hash_vectors.json")["cases"])


@pytest.fixture(scope="session")
def radix_contract() -> list[dict[str, Any]]:
    """Scenarios of ``radix_contract.json`` (kvrouter's index contract)."""
    return list(_cached("radix_contract.json")["scenarios"])


@pytest.fixture(scope="session")
def router_view() -> dict[str, Any]:
    """``engine_frames/router_view.json``: per engine, converted events and the scores after each batch."""
    return dict(_cached("engine_frames/router_view.json")["engines"])


def load_engine_frames(engine: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(captured msgpack file, its JSON twin) for one engine name of ``ENGINES``."""
    with (FIXTURES / "engine_frames" / f"{engine}.msgpack").open("rb") as fh:
        captured = msgpack.unpackb(fh.read(), raw=False, strict_map_key=False)
    return captured, _cached(f"engine_frames/{engine}.json")


@pytest.fixture(scope="session", params=ENGINES)
def engine_frames(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(engine name, captured msgpack content, JSON twin), once per captured engine."""
    captured, twin = load_engine_frames(request.param)
    return request.param, captured, twin


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise ``hash_case`` and ``contract_scenario`` by their fixture names, for readable ids."""
    if "hash_case" in metafunc.fixturenames:
        cases = _cached("hash_vectors.json")["cases"]
        metafunc.parametrize("hash_case", cases, ids=[c["name"] for c in cases])
    if "contract_scenario" in metafunc.fixturenames:
        scenarios = _cached("radix_contract.json")["scenarios"]
        metafunc.parametrize("contract_scenario", scenarios, ids=[s["name"] for s in scenarios])


VLLM_ARRAY_LAYOUT = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
"""vLLM 0.23.0's positional events (``spec/wire-formats.md`` §1.3), written out independently of the codec."""


def twin_fields(event: Any) -> Mapping[str, Any]:
    """A twin event as a map, whichever encoding the engine used (maps, or vLLM's tag-first arrays)."""
    if isinstance(event, dict):
        return event
    tag, *values = event
    return {"type": tag, **dict(zip(VLLM_ARRAY_LAYOUT[tag], values, strict=False))}


def expected_engine_event(twin_event: Any, *, worker_id: int, dp_rank: int, event_id: int, block_size: int) -> KvEvent:
    """What an engine event of a JSON twin (either encoding) must decode to, derived from the twin
    alone: hashes cast to u64, blocks of another block size dropped, token ids split into blocks and
    hashed with the event's ``lora_name``, tier from ``medium``."""
    twin_event = twin_fields(twin_event)
    if twin_event["type"] == "AllBlocksCleared":
        return Cleared(worker_id, dp_rank=dp_rank, event_id=event_id)
    tier = parse_tier(twin_event.get("medium"))
    hashes = [EngineHash(h % (1 << 64)) for h in twin_event["block_hashes"]]
    if twin_event["type"] == "BlockRemoved":
        return Removed(worker_id, tuple(hashes), dp_rank=dp_rank, event_id=event_id, tier=tier)
    parent = twin_event.get("parent_block_hash")
    tokens = twin_event["token_ids"]
    blocks: list[StoredBlock] = []
    if twin_event["block_size"] == block_size:
        local = block_hashes(tokens, block_size, lora_name=twin_event.get("lora_name"))
        blocks = [
            StoredBlock(h, LocalHash(local[j]), tuple(tokens[j * block_size : (j + 1) * block_size]))
            for j, h in enumerate(hashes)
        ]
    engine_parent = None if parent is None else EngineHash(parent % (1 << 64))
    return Stored(worker_id, engine_parent, tuple(blocks), dp_rank=dp_rank, event_id=event_id, tier=tier)


def captured_payloads(captured: Mapping[str, Any], twin: Mapping[str, Any]) -> list[tuple[bytes, Mapping[str, Any]]]:
    """(payload, twin message) of every captured live message and replayed batch of one engine."""
    pairs = [
        (parse_live(frames).payload, expected)
        for group, twin_group in zip(captured["live"], twin["live"], strict=True)
        for frames, expected in zip(group["messages"], twin_group["messages"], strict=True)
    ]
    for replay, twin_replay in zip(captured["replay"], twin["replay"], strict=True):
        for frames, expected in zip(replay["replies"], twin_replay["replies"], strict=True):
            reply = parse_replay_reply(frames)
            if isinstance(reply, ReplayFrame):
                pairs.append((reply.payload, expected))
    return pairs


def with_twin_lora(batch: EventBatch, twin_events: Sequence[Any]) -> EventBatch:
    """A decoded batch with each store's LoRA adapter as its twin event has it (``lora_name``, ``lora_id``): the
    decoder keeps only the local hashes it makes with the name, and the engine encoders write the adapter."""
    stores = iter([fields for fields in map(twin_fields, twin_events) if fields["type"] == "BlockStored"])

    def named(event: KvEvent) -> KvEvent:
        if not isinstance(event, Stored):
            return event
        fields = next(stores)
        return replace(event, lora_name=fields.get("lora_name"), lora_id=fields.get("lora_id"))

    events = tuple(map(named, batch.events))
    assert next(stores, "ended") == "ended", "a twin store the decoder did not keep"
    return replace(batch, events=events)


def decode_in_router_view_order(
    decoder: BatchDecoder, captured: Mapping[str, Any], view: Mapping[str, Any]
) -> Iterator[tuple[EventBatch, Mapping[str, Any]]]:
    """Decode an engine's captured live batches in ``router_view.json``'s order (rank 0, then rank 1),
    numbering event ids on across batches as the view does; yields each batch with its view entry."""
    payloads = {
        (group["dp_rank"], live.seq): live.payload
        for group in captured["live"]
        for live in map(parse_live, group["messages"])
    }
    next_event_id = 0
    for entry in view["batches"]:
        batch = decoder.decode(payloads[entry["dp_rank"], entry["seq"]], first_event_id=next_event_id)
        next_event_id += len(batch.events)
        yield batch, entry


@st.composite
def engine_batches(
    draw: st.DrawFn, *, worker_id: int, block_size: int, tiers: Sequence[StorageTier], max_blocks: int
) -> EventBatch:
    """Batches an engine wire can carry whole, so ``decode(encode(batch)) == batch``: one worker and
    rank, ids from 0, a timestamp, every block with ``block_size`` tokens and its plain local hash."""
    dp_rank = draw(st.integers(0, 7))
    kinds = draw(st.lists(st.sampled_from(["stored", "removed", "cleared"]), max_size=5))
    events: list[KvEvent] = []
    for event_id, kind in enumerate(kinds):
        if kind == "cleared":
            events.append(Cleared(worker_id, dp_rank=dp_rank, event_id=event_id))
            continue
        tier = draw(st.sampled_from(tiers))
        if kind == "removed":
            hashes = tuple(draw(st.lists(u64.map(EngineHash), max_size=4)))
            events.append(Removed(worker_id, hashes, dp_rank=dp_rank, event_id=event_id, tier=tier))
            continue
        count = draw(st.integers(0, max_blocks))
        tokens = draw(st.lists(u32, min_size=count * block_size, max_size=count * block_size))
        local = block_hashes(tokens, block_size)
        blocks = tuple(
            StoredBlock(
                EngineHash(draw(u64)), LocalHash(local[j]), tuple(tokens[j * block_size : (j + 1) * block_size])
            )
            for j in range(count)
        )
        parent = draw(st.none() | u64.map(EngineHash))
        events.append(Stored(worker_id, parent, blocks, dp_rank=dp_rank, event_id=event_id, tier=tier))
    timestamp = draw(st.floats(min_value=0, max_value=2e9, allow_nan=False))
    return EventBatch(tuple(events), timestamp=timestamp, dp_rank=dp_rank)


# -- the shared-memory engine's process tests ------------------------------------------------------


def _wait_until(condition: Callable[[], object], *, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``condition`` with a short backoff until it is true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


@pytest.fixture
def wait_until() -> Callable[..., None]:
    """``wait_until(condition, timeout=30.0, what="...")``: wait on a condition, never sleep-then-assert."""
    return _wait_until


@pytest.fixture
def shm_entries() -> Callable[[int], list[str]]:
    """``shm_entries(pid)``: what ``/dev/shm`` holds under an owner's prefix ``kvrouter-<pid>-``."""

    def entries(pid: int) -> list[str]:
        return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"kvrouter-{pid}-"))

    return entries


@pytest.fixture
def clock() -> FakeClock:
    """Injected time that moves only when the test sets ``clock.now``."""
    return FakeClock()


# -- mock workers as real processes ----------------------------------------------------------------

ROOT = Path(kvrouter.__file__).resolve().parents[1]
MOCK_WORKER_ID = 7
MOCK_SPEEDUP = "10000"
"""A high ``--speedup-ratio`` keeps simulated iterations to microseconds of wall time."""
MOCK_TIMEOUT = 30.0


@dataclass
class Worker:
    """One running mock worker and what its ready line said."""

    proc: subprocess.Popen[str]
    http: str
    events: list[str]
    replay: list[str]

    def call(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        request = urllib.request.Request(self.http + path, data=data, method=method)
        try:
            with urllib.request.urlopen(request, timeout=MOCK_TIMEOUT) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, json.loads(exc.read())

    def complete(self, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
        status, answer = self.call("POST", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **extra})
        assert status == 200, answer
        return answer  # type: ignore[no-any-return]

    def cache(self) -> dict[str, Any]:
        status, answer = self.call("GET", "/cache")
        assert status == 200, answer
        return answer  # type: ignore[no-any-return]


FIRST_FIXED_PORT = 10_000
"""The lowest port :func:`free_port` hands out."""


def _first_ephemeral_port() -> int:
    """The low end of the kernel's ephemeral range, where ``bind(port 0)`` and outgoing connections take theirs."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port(span: int = 1) -> int:
    """A port p with p .. p + span - 1 free right now, drawn at random below the kernel's ephemeral range.

    Why below it: a test probes a port, then a server it starts binds it seconds later. A port the kernel
    handed out to the probe is one it may hand out again meanwhile, to any socket on the machine bound to
    port 0 (the mock engines a demo starts, another test's server, an outgoing connection); and the next
    free ephemeral port, p + 1 for a span of two, is the likeliest of all. Below the range only another
    explicit choice can take it: another test's draw of the same port in the same seconds."""
    last = _first_ephemeral_port() - span
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(FIRST_FIXED_PORT, last)
        try:
            for offset in range(span):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port
    pytest.fail("no run of free ports found")


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """``start_worker(*args)``: a mock worker on free ports; stopped with SIGTERM, which must exit 0."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str, events_port: int = 0, replay_port: int = 0, worker_id: int = MOCK_WORKER_ID) -> Worker:
        command = [sys.executable, "-m", "kvrouter", "mock-worker", "--port", "0", "--worker-id", str(worker_id)]
        command += ["--zmq-kv-events-port", str(events_port), "--zmq-replay-port", str(replay_port)]
        command += ["--speedup-ratio", MOCK_SPEEDUP, *args]
        stderr = (tmp_path / f"worker{len(procs)}.err").open("w")
        proc = subprocess.Popen(
            command, cwd=Path(kvrouter.__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=stderr, text=True
        )
        stderr.close()
        procs.append(proc)
        lines: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None
        stdout = proc.stdout
        threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=MOCK_TIMEOUT)
        except queue.Empty:
            pytest.fail(f"mock worker printed no ready line: {(tmp_path / 'worker0.err').read_text()}")
        fields = dict(part.split("=", 1) for part in line.split()[2:])
        assert line.startswith("kvrouter-mock-worker ready "), line
        return Worker(proc, fields["http"], fields["events"].split(","), fields["replay"].split(","))

    yield start
    codes = [stop_mock_process(proc) for proc in procs]
    errors = [(tmp_path / f"worker{i}.err").read_text()[-STACKS_SHOWN:] for i, code in enumerate(codes) if code]
    assert codes == [0] * len(procs), f"exit codes {codes}; stderr: {errors}"


STACKS_SHOWN = 6000
"""Characters of a failed kvrouter process's stderr an assertion shows: its thread stacks, when it hung."""


def wait_for_stacks(stderr: Path, frames: Sequence[str], timeout: float) -> str:
    """What a process wrote to ``stderr`` once it holds every one of ``frames`` (SIGUSR1's thread stacks,
    written a frame at a time); fails showing the tail of ``stderr``. Not "Current thread": faulthandler
    marks the thread the kernel delivered the signal to, which may be none of Python's (a libzmq I/O
    thread), and then marks none."""
    deadline = time.monotonic() + timeout
    while True:
        written = stderr.read_text()
        if all(frame in written for frame in frames):
            return written
        if time.monotonic() > deadline:
            pytest.fail(f"no stacks with {list(frames)} after {timeout}s; stderr: {written[-STACKS_SHOWN:]}")
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen[str], timeout: float) -> int:
    """SIGTERM, which must end a kvrouter process within ``timeout``; one that does not is asked for its
    thread stacks (SIGUSR1, written to its stderr: ``kvrouter/cli/stacks.py``) before it is killed, so the
    failure says where it hung. Its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        proc.kill()
        return proc.wait()


def stop_mock_process(proc: subprocess.Popen[str]) -> int:
    """``stop_process`` for a mock worker, its stdout closed."""
    code = stop_process(proc, MOCK_TIMEOUT)
    if proc.stdout is not None:
        proc.stdout.close()
    return code
