"""The start/stop contract of ``kvrouter up``, tried as an operator's clients and supervisors try it.

- **Dynamo's client flow.** A supervisor waits for ``GET /health``, then registers its workers at once. On a
  warm start and on a cold one (an empty numba cache: the kernels compile for about a minute), every
  registration is answered 201 while ``/select`` still answers 503 with ``Retry-After``; the workers show
  ``pending`` and turn ``active`` once the index is up; ``/health`` answers throughout (the test's bound is a
  generous 5 s a call; 1 s is the documented goal).
- **A closed log pipe.** ``kvrouter up`` whose stdout and stderr are pipes nobody reads any more keeps
  serving (its writes are dropped and counted), and SIGTERM or SIGINT still stop it, its appliers, fronts
  and mock engines, leaving no process and no segment.
- **A dead front.** With ``--fronts 2``, a front SIGKILLed while it proxies a slow request leaves its
  client a reset (or an answer) at once, and the next request on a new connection is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvrouter.errors import EngineError
from kvrouter.plane.registry import WorkerSpec
from kvrouter.service import Service, ServiceConfig
from tests.conftest import ROOT, free_port
from tests.service.conftest import BLOCK, start_mock, stop_mock
from tests.service.test_up import (
    EXIT_BOUND_S,
    START_TIMEOUT_S,
    descendants,
    kill_survivors,
    other_fronts,
    still_there,
)

pytestmark = pytest.mark.timeout(420)

HEALTH_BOUND_S = 5.0
"""The test's bound on one ``/health`` call while the index starts (the documented goal is 1 s)."""
COLD_START_S = 300.0
"""A first run on an empty numba cache, beside the other test files on 2 cores: compiled and up by then."""
WORKERS = 4


@dataclass
class Answer:
    status: int
    body: Any
    headers: dict[str, str]
    seconds: float


@dataclass
class Router:
    """``python -m kvrouter up`` on a known port, its output wherever the test sends it."""

    port: int
    proc: subprocess.Popen[bytes]
    tree: list[tuple[int, str]] = field(default_factory=list)

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def call(self, method: str, path: str, body: object = None, timeout: float = 30.0) -> Answer:
        """One request on a new connection."""
        conn = http.client.HTTPConnection(*self.address, timeout=timeout)
        started = time.monotonic()
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            raw = response.read()
            text = raw.decode(errors="replace")
            parsed = json.loads(raw) if raw[:1] in (b"{", b"[") else text
            return Answer(response.status, parsed, dict(response.getheaders()), time.monotonic() - started)
        finally:
            conn.close()

    def listening(self, timeout: float) -> Answer:
        """The first ``/health`` that answers (connections are refused until the API listens)."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"kvrouter up exited with {self.proc.returncode}"
            try:
                return self.call("GET", "/health", timeout=HEALTH_BOUND_S)
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "kvrouter up never listened"
                time.sleep(0.05)

    def until(self, check: Any, what: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"kvrouter up exited with {self.proc.returncode} waiting for {what}"
            found = check()
            if found:
                return found
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)

    def stop(self, signum: int, shm: Callable[[int], list[str]]) -> None:
        """Signal it; it exits 0 within ``drain_secs`` + 5 s, leaving no process and no segment."""
        self.tree = descendants(self.proc.pid)
        self.proc.send_signal(signum)
        try:
            code = self.proc.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"kvrouter up still running {EXIT_BOUND_S}s after {signal.Signals(signum).name}")
        assert code == 0
        assert still_there(self.tree) == [], "processes kvrouter up started outlived it"
        assert shm(self.proc.pid) == []


@contextlib.contextmanager
def router(
    *args: str, stdout: int | None = None, stderr: int | None = None, env: dict[str, str] | None = None
) -> Iterator[Router]:
    port = free_port(2)  # the API and the ZMQ fast path beside it
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")} | (env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrouter", "up", "--port", str(port), "--shards", "1", *args],
        cwd=ROOT,
        env=environ,
        stdin=subprocess.DEVNULL,
        stdout=stdout if stdout is not None else subprocess.DEVNULL,
        stderr=stderr if stderr is not None else subprocess.DEVNULL,
    )
    running = Router(port, proc)
    try:
        yield running
    finally:
        tree = running.tree or descendants(proc.pid)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        kill_survivors(tree)


def registration(worker_id: int) -> dict[str, Any]:
    """A vLLM worker as Dynamo's supervisor registers it (its publisher need not be up yet)."""
    return {
        "instance_id": worker_id,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "model_name": "m",
        "block_size": BLOCK,
    }


def statuses(run: Router) -> dict[int, str]:
    answer = run.call("GET", "/workers")
    assert answer.status == 200, answer
    return {w["instance_id"]: w["status"] for w in answer.body}


class HealthWatch:
    """``/health`` every 0.2 s on a thread of its own, each call's status and time kept."""

    def __init__(self, run: Router) -> None:
        self.run = run
        self.seen: list[tuple[int, float]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            try:
                answer = self.run.call("GET", "/health", timeout=HEALTH_BOUND_S + 5)
            except OSError as exc:
                self.failures.append(repr(exc))
                continue
            self.seen.append((answer.status, answer.seconds))

    def stop(self) -> list[tuple[int, float]]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_dynamos_client_flow_registers_as_soon_as_health_answers(cache: str, tmp_path: Path, shm_entries: Any):
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "cold-cache")} if cache == "cold" else None
    with router("--mock-workers", "0", env=env) as run:
        first = run.listening(START_TIMEOUT_S)
        assert first.status == 200
        watch = HealthWatch(run)
        answers: dict[int, Answer] = {}

        def register(worker_id: int) -> None:
            answers[worker_id] = run.call("POST", "/register", registration(worker_id))

        threads = [threading.Thread(target=register, args=(wid,)) for wid in range(1, WORKERS + 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert {wid: a.status for wid, a in answers.items()} == dict.fromkeys(range(1, WORKERS + 1), 201), answers
        refused = run.call("POST", "/select", {"model_name": "m", "token_ids": list(range(64))})
        assert refused.status == 503, refused
        assert refused.headers.get("Retry-After") == "2"
        assert "the index is starting" in refused.body["error"]
        chat = run.call("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status == 503, chat  # OpenAI's clients get the same answer, in OpenAI's shape
        assert chat.headers.get("Retry-After") == "2"
        assert chat.body["error"]["type"] == "service_unavailable_error"
        assert "the index is starting" in chat.body["error"]["message"]
        assert statuses(run) == dict.fromkeys(range(1, WORKERS + 1), "pending")
        ready = run.call("GET", "/ready")
        assert ready.status == 503
        assert "engine starting" in ready.body["reasons"]
        during = [*answers.values(), refused, ready]
        for path in ("/loads", "/metrics", "/busy_threshold"):  # what they know, meanwhile
            known = run.call("GET", path)
            assert known.status == 200, path
            during.append(known)
        assert max(answer.seconds for answer in during) < HEALTH_BOUND_S  # every route answers meanwhile

        run.until(
            lambda: statuses(run) == dict.fromkeys(range(1, WORKERS + 1), "active"),
            "the workers followed once the index is up",
            COLD_START_S,
        )
        chosen = run.call("POST", "/select", {"model_name": "m", "token_ids": list(range(64))})
        assert chosen.status == 200, chosen
        assert chosen.body["worker_id"] in range(1, WORKERS + 1)
        health = watch.stop()
        assert not watch.failures, watch.failures
        assert health, "no /health while the index started"
        assert all(status == 200 for status, _ in health)
        assert max(seconds for _, seconds in health) < HEALTH_BOUND_S, max(health, key=lambda h: h[1])
        run.stop(signal.SIGTERM, shm_entries)


def test_a_sigterm_3_s_into_a_first_runs_compile_stops_everything(tmp_path: Path, shm_entries: Any):
    """A supervisor that gives up on a first run (a cold numba cache compiling) stops it cleanly."""
    with router("--mock-workers", "0", env={"NUMBA_CACHE_DIR": str(tmp_path / "cold-cache")}) as run:
        run.listening(START_TIMEOUT_S)
        assert run.call("GET", "/ready").status == 503  # still compiling
        time.sleep(3.0)  # the fault: the signal comes 3 s after /health first answered
        run.stop(signal.SIGTERM, shm_entries)


def dropped_writes(run: Router, stream: str) -> float:
    """``kvrouter_output_dropped_writes_total{stream}`` of front 0 (the process the test started)."""
    for _ in range(20):
        answer = run.call("GET", "/metrics")
        if answer.headers.get("X-Kvrouter-Front", "0") != "0":
            continue  # another front's own figure
        for line in answer.body.splitlines():
            if line.startswith(f'kvrouter_output_dropped_writes_total{{stream="{stream}"}}'):
                return float(line.split()[1])
        return 0.0
    pytest.fail("no /metrics answer from front 0")


def decisions(run: Router) -> float:
    for line in run.call("GET", "/metrics").body.splitlines():
        if line.startswith("kvrouter_decisions_total "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("fronts", ["1", "2"], ids=["demo", "demo-2-fronts"])
def test_a_closed_log_pipe_keeps_it_serving_and_a_signal_still_stops_everything(
    fronts: str, signum: int, shm_entries: Any
):
    reader, writer = os.pipe()
    os.close(reader)  # the reader has exited: every write to the pipe fails (EPIPE)
    try:
        demo = ("--mock-workers", "2", "--client-rate", "8", "--status-secs", "0.3", "--fronts", fronts)
        with router(*demo, stdout=writer, stderr=writer) as run:
            os.close(writer)
            writer = -1
            run.listening(START_TIMEOUT_S)
            run.until(lambda: decisions(run) >= 5, "the demo's client deciding", START_TIMEOUT_S)
            dropped = run.until(lambda: dropped_writes(run, "stdout"), "a write to the closed pipe", 60)
            run.until(  # the status line goes on, each line dropped and counted, and the service serves
                lambda: dropped_writes(run, "stdout") >= dropped + 3, "more status lines, dropped", 60
            )
            assert run.call("GET", "/health").status == 200
            run.stop(signum, shm_entries)
    finally:
        if writer >= 0:
            os.close(writer)


def front_of(conn: http.client.HTTPConnection) -> str:
    conn.request("GET", "/health")
    response = conn.getresponse()
    response.read()
    return response.getheader("X-Kvrouter-Front", "?")


def test_a_front_killed_mid_request_leaves_its_client_a_reset_and_the_next_request_is_answered(
    tmp_path: Path, shm_entries: Any
):
    engine = start_mock(1, tmp_path / "slow-engine.err", speedup="0.002")  # a completion takes seconds
    try:
        with router("--fronts", "2", "--mock-workers", "0", "--drain-secs", "2") as run:
            run.listening(START_TIMEOUT_S)
            body = {**registration(1), "endpoint": engine.events[0], "http_endpoint": engine.http}
            assert run.call("POST", "/register", body).status == 201
            run.until(
                lambda: (ready := run.call("GET", "/ready")).status == 200 and ready.body["fronts"].get("ready") == 2,
                "both fronts ready",
                START_TIMEOUT_S,
            )
            run.until(lambda: statuses(run) == {1: "active"}, "the worker followed", START_TIMEOUT_S)
            conn = None
            deadline = time.monotonic() + 30
            while conn is None and time.monotonic() < deadline:  # the front that reads a /health owns it
                candidate = http.client.HTTPConnection(*run.address, timeout=60)
                if front_of(candidate) == "1":
                    conn = candidate
                else:
                    candidate.close()
            assert conn is not None, "no connection owned by front 1"
            request = {"model": "m", "prompt": list(range(4 * BLOCK)), "max_tokens": 200}
            conn.request("POST", "/v1/completions", body=json.dumps(request))
            try:
                run.until(
                    lambda: any(load["active_requests"] for g in run.call("GET", "/loads").body for load in g["loads"]),
                    "the slow request booked",
                    30,
                )
            except AssertionError:
                assert conn.sock is not None
                conn.sock.settimeout(1)
                answer = conn.getresponse()
                raise AssertionError(f"not booked; its answer: {answer.status} {answer.read()[:300]!r}") from None
            fronts = other_fronts(run.proc.pid)
            assert len(fronts) == 1
            os.kill(fronts[0], signal.SIGKILL)
            killed = time.monotonic()
            with contextlib.suppress(http.client.HTTPException, ConnectionError):  # a reset, or an answer
                conn.getresponse().read()
            waited = time.monotonic() - killed
            conn.close()
            assert waited < EXIT_BOUND_S, f"the client waited {waited:.1f}s after its front died"
            assert run.call("GET", "/health").status == 200  # a new connection is answered
            chosen = run.call("POST", "/select", {"model_name": "m", "token_ids": list(range(64))})
            assert chosen.status == 200, chosen
            run.stop(signal.SIGTERM, shm_entries)
    finally:
        assert stop_mock(engine) == 0


def test_registrations_that_waited_for_an_index_that_never_came_up_are_reported_failed(
    caplog: pytest.LogCaptureFixture, shm_entries: Any
):
    """The start fails (here: the start thread's work raises, as an applier that cannot start does): the
    workers that waited are ``failed`` with the reason, the log says so, and ``run`` raises (``kvrouter up``
    then exits 1)."""
    config = ServiceConfig(port=0, shards=1, zmq_port=None, workers=(WorkerSpec(5, "tcp://127.0.0.1:1"),))
    service = Service(config)

    def broken() -> None:
        raise EngineError("applier 0 did not start")

    service._finish_start = broken  # type: ignore[method-assign]  # the start thread's work
    service.start()
    with pytest.raises(EngineError, match="did not start"):
        asyncio.run(service.run())
    instance = service.core.registry.partition("default").instances[5]
    assert instance.status == "failed"
    assert instance.failure is not None
    assert "applier 0 did not start" in instance.failure
    assert "registration failed worker=5" in caplog.text
    assert service.core.lifecycle.phase == "failed"
    assert shm_entries(os.getpid()) == []
