"""A real service for the API tests: its engine's applier, two ``kvrouter mock-worker`` processes
(``--format vllm`` with replay sockets) registered through ``/register``, and plain HTTP on 127.0.0.1.

One service per module: starting the engine and the mock engines is most of a test's time, and one
engine per process is the rule, so the tests of a module share them and keep their state apart (their
own prompts, selection ids and partitions). Tearing the service down asserts the lifecycle's promise:
``stop()`` returns, the mock engines exit 0, and ``/dev/shm`` holds nothing of this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import kvrouter
from kvrouter.plane.registry import WorkerSpec
from kvrouter.routing.config import RouterConfig
from kvrouter.service import Service, ServiceConfig
from kvrouter.service.core.config import WorkerRole
from tests.conftest import MOCK_SPEEDUP, MOCK_TIMEOUT, STACKS_SHOWN, Worker, free_port, stop_mock_process

BLOCK = 16
MODEL = "m"
MOCK_IDS = (1, 2)
"""``serving``'s two mock engines' instance ids (their stderr: ``worker<id>.err``)."""
TOKEN = "s3cret"


def all_trusted(answer: dict[str, Any]) -> bool:
    """Every worker of an ``explain`` answer is trusted ``exact``: wait for it before comparing two answers,
    since a health tick may move a trust state between them (the explanation carries it)."""
    return set(answer["explain"]["trust"].values()) == {"exact"}


def http(
    url: str,
    method: str = "GET",
    body: object = None,
    *,
    token: str | None = TOKEN,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, dict[str, str]]:
    """One request; (status, parsed JSON body, headers), 4xx and 5xx included."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        with exc:
            text = exc.read()
            return exc.code, json.loads(text) if text else None, dict(exc.headers)


def start_mock(worker_id: int, err: Path, *args: str, speedup: str = MOCK_SPEEDUP) -> Worker:
    """A vLLM-format mock engine (``args``: more ``kvrouter mock-worker`` flags, ``--role`` say)."""
    command = [sys.executable, "-m", "kvrouter", "mock-worker", "--port", "0", "--worker-id", str(worker_id)]
    command += ["--zmq-kv-events-port", "0", "--zmq-replay-port", "0", "--speedup-ratio", speedup]
    command += ["--format", "vllm", "--block-size", str(BLOCK), "--num-gpu-blocks", "512", *args]
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            command, cwd=Path(kvrouter.__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=MOCK_TIMEOUT)
    except queue.Empty:
        proc.kill()
        proc.wait()
        pytest.fail(f"mock worker printed no ready line: {err.read_text()}")
    assert line.startswith("kvrouter-mock-worker ready "), line
    fields = dict(part.split("=", 1) for part in line.split()[2:])
    return Worker(proc, fields["http"], fields["events"].split(","), fields["replay"].split(","))


def stop_mock(worker: Worker) -> int:
    return stop_mock_process(worker.proc)


@dataclass
class Running:
    """A service serving on a thread of its own, and what the tests reach it by."""

    service: Service
    url: str
    workers: list[Worker] = field(default_factory=list)

    def call(self, method: str, path: str, body: object = None, **kwargs: Any) -> tuple[int, Any, dict[str, str]]:
        return http(self.url + path, method, body, **kwargs)

    def ok(self, method: str, path: str, body: object = None) -> Any:
        status, answer, _ = self.call(method, path, body)
        assert 200 <= status < 300, (status, answer)
        return answer

    def register(self, worker_id: int, worker: Worker, model: str = MODEL, **fields: Any) -> None:
        """``/register`` a mock engine in ``model``: its events, replay and HTTP endpoints, and ``fields``."""
        self.ok(
            "POST",
            "/register",
            {
                "instance_id": worker_id,
                "endpoint": worker.events[0],
                "replay_endpoint": worker.replay[0],
                "model_name": model,
                "block_size": BLOCK,
                "http_endpoint": worker.http,
                **fields,
            },
        )


@dataclass(frozen=True, slots=True)
class MockSpec:
    """One mock engine of a :func:`serving` fleet: its instance id, the model it registers in, more
    ``kvrouter mock-worker`` flags, its speed-up and more ``/register`` fields."""

    worker_id: int
    model: str = MODEL
    args: tuple[str, ...] = ()
    speedup: str = MOCK_SPEEDUP
    registration: Mapping[str, Any] = field(default_factory=dict)


SERVE_TIMEOUT = 240.0
"""Seconds to readiness: on a cold numba cache the service compiles every kernel first, beside two mock
engines compiling theirs, which took over a minute on a busy 2-core machine."""


def serve(service: Service) -> tuple[threading.Thread, str]:
    """Run ``service`` on a new thread's event loop; returns once it listens."""
    ready: queue.Queue[str] = queue.Queue()
    failed: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(service.run(on_ready=ready.put))
        except BaseException as exc:
            failed.append(exc)
            ready.put("")

    thread = threading.Thread(target=main, name="kvrouter-service", daemon=True)
    thread.start()
    url = ready.get(timeout=SERVE_TIMEOUT)
    assert not failed, failed
    assert url
    return thread, url


def stop_served(service: Service, thread: threading.Thread | None) -> None:
    """Stop a service :func:`serve` runs and join its thread; without a thread (``serve`` never returned),
    close the engine its ``start`` forked."""
    service.stop()
    if thread is not None:
        thread.join(30)
        assert not thread.is_alive(), "the service did not stop"
    else:
        service.engine.close()


def own_segments() -> list[str]:
    """This process's segments in ``/dev/shm``: none once its engine is closed."""
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"kvrouter-{os.getpid()}-"))


PROMPT = list(range(1, 70))
"""The prompt :meth:`Served.select` routes: four blocks and a partial one."""


class Served:
    """A service reached over HTTP whose workers are registered endpoints that publish nothing: all that
    registrations, roles and candidate filters need (the routing has no overlap to weigh)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def call(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        status, answer, _ = http(self.url + path, method, body)
        return status, answer

    def register(self, instance_id: int, model: str, **fields: Any) -> tuple[int, Any]:
        body = {
            "instance_id": instance_id,
            "endpoint": f"tcp://127.0.0.1:{free_port()}",
            "model_name": model,
            "block_size": BLOCK,
            **fields,
        }
        return self.call("POST", "/register", body)

    def select(self, model: str, **fields: Any) -> tuple[int, Any]:
        return self.call("POST", "/select", {"model_name": model, "token_ids": PROMPT, **fields})


@contextlib.contextmanager
def served_alone(router: RouterConfig, roles: Sequence[WorkerRole], worker_ids: Sequence[int]) -> Iterator[Served]:
    """A service routing with ``router`` on its own thread, with no engines: ``worker_ids`` configured (as
    ``--workers`` names them, in model ``configured``) with ``roles``; on leaving it stops and this process
    leaves nothing in ``/dev/shm``."""
    config = ServiceConfig(
        port=0,
        shards=1,
        health_interval_secs=0.1,
        drain_secs=2.0,
        router=router,
        model_name="configured",
        workers=tuple(WorkerSpec(wid, f"tcp://127.0.0.1:{free_port()}") for wid in worker_ids),
        worker_roles=tuple(roles),
    )
    service = Service(config)
    service.start()
    thread: threading.Thread | None = None
    try:
        thread, url = serve(service)
        yield Served(url)
    finally:
        stop_served(service, thread)
    assert own_segments() == []


@contextlib.contextmanager
def serving(
    config: ServiceConfig,
    folder: Path,
    run_type: type[Running] = Running,
    fleet: Sequence[MockSpec] = tuple(MockSpec(wid) for wid in MOCK_IDS),
) -> Iterator[Running]:
    """A service on ``config`` with vLLM-format mock engines (replay sockets) registered as ``fleet`` says
    (by default two in ``MODEL``); on leaving, the service stops, the mocks exit 0 and this process leaves
    nothing in ``/dev/shm``."""
    service = Service(config)
    service.start()  # forks the applier: before the service thread
    workers: list[Worker] = []
    thread: threading.Thread | None = None
    try:
        for spec in fleet:
            err = folder / f"worker{spec.worker_id}.err"
            workers.append(start_mock(spec.worker_id, err, *spec.args, speedup=spec.speedup))
        thread, url = serve(service)
        run = run_type(service, url, workers)
        for spec, worker in zip(fleet, workers, strict=True):
            run.register(spec.worker_id, worker, spec.model, **spec.registration)
        yield run
    finally:
        stop_served(service, thread)
        codes = [stop_mock(worker) for worker in workers]
        errors = {
            spec.worker_id: (folder / f"worker{spec.worker_id}.err").read_text()[-STACKS_SHOWN:]
            for spec, code in zip(fleet, codes, strict=False)  # none when a mock did not start
            if code
        }
        assert codes == [0] * len(workers), f"exit codes {codes}; stderr: {errors}"
    leftovers = own_segments()
    assert leftovers == [], leftovers


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    config = ServiceConfig(
        port=0, shards=1, auth_token=TOKEN, health_interval_secs=0.1, drain_secs=2.0, router=RouterConfig()
    )
    with serving(config, tmp_path_factory.mktemp("service")) as run:
        yield run
