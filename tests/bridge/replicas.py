"""``kvrouter up`` replicas as real processes for the replica-sync tests, and the HTTP calls they take.

One engine per process is the rule, so replicas cannot share the test process: each is ``python -m
kvrouter up --router-replica-sync`` with one shard, no demo fleet and no ZMQ fast path, started in
parallel with its siblings (most of a start is loading numba kernels) and stopped by pid: SIGTERM, SIGKILL
after a bound, every process it started checked gone and /dev/shm left without its segments.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, Worker, stop_process

START_TIMEOUT_S = 300.0
"""A cold numba cache compiles every kernel first, on 2 shared cores."""
STOP_TIMEOUT_S = 20.0
URL_LINE = re.compile(r"kvrouter up: API at (http://\S+)")
READY_LINE = "kvrouter up: the index is up"
BLOCK = 16
MODEL = "m"


def call(url: str, method: str = "GET", body: object = None) -> tuple[int, Any]:
    """One HTTP request; (status, parsed JSON body), 4xx and 5xx included."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            text = exc.read()
            return exc.code, json.loads(text) if text else None


class Replica:
    """One ``kvrouter up --router-replica-sync`` process."""

    def __init__(
        self, name: str, nats_url: str, namespace: str, folder: Path, *extra: str, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        environ = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_") and k != "NATS_SERVER"}
        env = {**environ, **(env or {})}
        command = [sys.executable, "-m", "kvrouter", "up", "--port", "0", "--zmq-port", "0", "--shards", "1"]
        command += ["--mock-workers", "0", "--router-replica-sync", "--nats-url", nats_url, "--namespace", namespace]
        command += ["--model-name", MODEL, "--block-size", str(BLOCK), *extra]
        self.stderr_path = folder / f"{name}.err"
        self._stderr = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = ""

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_started(self) -> None:
        """Until the index is up (the URL line first); fails naming stderr's tail if it exits or times out."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.proc.poll() is not None and self.lines.empty()):
                tail = self.stderr_path.read_text()[-2000:]
                pytest.fail(f"replica {self.name} did not start (exit {self.proc.poll()}): {tail}")
            try:
                line = self.lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if match := URL_LINE.search(line):
                self.url = match.group(1)
            if line.startswith(READY_LINE):
                assert self.url
                return

    def get(self, path: str) -> Any:
        status, body = call(self.url + path)
        assert status == 200, (self.name, path, status, body)
        return body

    def post(self, path: str, body: object = None) -> Any:
        status, answer = call(self.url + path, "POST", body if body is not None else {})
        assert 200 <= status < 300, (self.name, path, status, answer)
        return answer

    def delete(self, path: str) -> Any:
        status, answer = call(self.url + path, "DELETE")
        assert 200 <= status < 300, (self.name, path, status, answer)
        return answer

    def register(self, worker_id: int, worker: Worker) -> None:
        self.post(
            "/register",
            {
                "instance_id": worker_id,
                "endpoint": worker.events[0],
                "replay_endpoint": worker.replay[0],
                "model_name": MODEL,
                "block_size": BLOCK,
                "http_endpoint": worker.http,
            },
        )

    def loads(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        """(worker_id, dp_rank) -> (prefill tokens, active blocks, active requests), every partition."""
        return {
            (row["worker_id"], row["dp_rank"]): (
                row["potential_prefill_tokens"],
                row["potential_decode_blocks"],
                row["active_requests"],
            )
            for partition in self.get("/loads")
            for row in partition["loads"]
        }

    def metrics(self) -> str:
        """``GET /metrics``' text."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text: str = response.read().decode()
            return text

    def sync(self) -> dict[str, Any]:
        """``/ready``'s replica_sync status (ready or not)."""
        status, body = call(self.url + "/ready")
        assert status in (200, 503), status
        sync: dict[str, Any] = body["replica_sync"]
        return sync

    def stop(self) -> None:
        """SIGTERM; after a bound, its stacks asked for, then SIGKILL; stdout and stderr closed. Idempotent."""
        stop_process(self.proc, STOP_TIMEOUT_S)
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


def shm_of(pid: int) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"kvrouter-{pid}-"))


@contextlib.contextmanager
def replicas(
    nats_url: str,
    namespace: str,
    folder: Path,
    names: list[str],
    *extra: str,
    env: dict[str, dict[str, str]] | None = None,
) -> Iterator[list[Replica]]:
    """Start ``names`` (the first alone, then the rest in parallel) and wait for each; on leaving stop them
    all and check /dev/shm is clean. ``env``: extra environment variables by replica name."""
    started: list[Replica] = []
    try:
        for i, name in enumerate(names):
            started.append(Replica(name, nats_url, namespace, folder, *extra, env=(env or {}).get(name)))
            if i == 0:  # on a cold numba cache the first compiles every kernel; the others then load them
                started[0].wait_started()
        for replica in started[1:]:
            replica.wait_started()
        yield started
    finally:
        for replica in started:
            replica.stop()
    for replica in started:
        assert replica.proc.returncode == 0, (replica.name, replica.proc.returncode, replica.stderr_path.read_text())
        assert shm_of(replica.proc.pid) == []
