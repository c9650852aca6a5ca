"""The live stack a drill runs against: ``kvrouter up`` and ``kvrouter mock-worker`` processes, or a running one.

**Real processes.** :class:`LocalStack` starts ``python -m kvrouter up --port 0 --mock-workers 0`` in its
own session (its stderr in a log file, temporary unless ``--keep-logs``, named when something fails),
then the mock engines (``demo/mocks.py``'s :func:`start_mock`, vLLM format with a replay socket,
``--exit-with-parent``) and registers them through ``POST /register`` with their ``http_endpoint``, as
an operator's engines join. Faults are then injected only through what an operator has: the mocks'
control routes, signals to processes, and the control segment ``kvrouter-<pid>-ctl`` read-only (which
applier writes which shard). Rejected: an in-process ``Service`` (an applier SIGKILL or a router restart
would then be simulated, not done) and ``kvrouter up``'s own demo mocks (their ports are printed, but
they die with the router, so a router restart could not keep them).

Every HTTP call, to the router and to the engines' control routes, goes through ``kvrouter.client``: the
typed methods for the router's routes, :meth:`Stack.call` (one :class:`~kvrouter.client.Client` per address,
its low-level ``request``) for the engines' ``/restart``, ``/faults``, ``/cache`` and ``/overlap``.

:class:`AttachedStack` (``--url``) knows only HTTP: the workers ``GET /workers`` lists with an
``http_endpoint`` that answers a mock's ``/cache``. Drills needing a process of their own are skipped.

**A clean start per run.** :meth:`reset` restarts every mock engine (empty cache, sequence from 0),
then unregisters and registers it again, so the index forgets the old blocks at once instead of at the
engine's next batch, and waits until every listener follows its engine again with nothing cached and
``/ready`` answers 200 (every shard up: the first run does not start while the appliers compile). Each
run of a drill and the baseline therefore start from the same empty fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from ..client import ApiError, Client, Worker
from ..demo.mocks import MockProcess, start_mock, stop_mocks
from ..engine import read_shards, read_workers
from ..errors import KvRouterError
from ..index.layout import Control, control_name
from ..index.sweep import sweep_leftovers
from ..ready_line import ready_line

__all__ = ["AttachedStack", "LocalStack", "Mock", "ReplayError", "Stack", "StackConfig"]

log = logging.getLogger(__name__)

URL_LINE: Final = re.compile(r"kvrouter up: API at (http://\S+)")
"""``kvrouter up``'s first stdout line (``cli/up.py``)."""

START_TIMEOUT_S: Final = 180.0
"""A cold numba cache compiles the appliers' and the mocks' kernels for minutes on 2 shared cores."""

STOP_TIMEOUT_S: Final = 15.0
"""SIGTERM to ``kvrouter up``, then this long (its drain is 5 s by default), then SIGKILL."""

RESET_TIMEOUT_S: Final = 30.0

RESTART_PORT_TRIES: Final = 3
"""A restarted router binds its old port again (clients keep their URL); after this many refusals, any port."""
HTTP_TIMEOUT_S: Final = 30.0
POLL_S: Final = 0.1


class ReplayError(KvRouterError):
    """The stack could not be started, attached or reset; the message says which part and why."""


@dataclass(frozen=True, slots=True)
class StackConfig:
    """What :class:`LocalStack` starts."""

    mock_workers: int = 4
    prefill_workers: int = 0
    """A disaggregated fleet: the first this many engines take role ``prefill`` and the rest role ``decode``
    (the prefill-kill drill's); 0: every engine is ``both``."""
    block_size: int = 16
    num_gpu_blocks: int = 4096
    """Per mock (``kvrouter up``'s demo default): the default workload's 400 requests need ~19,600 blocks, more than
    four of these hold, so engines evict (``Removed`` events are part of every drill)."""
    shards: int = 2
    speedup_ratio: float = 1.0
    model_name: str = "default"
    record: str | None = None
    """``--record FILE``: the router records its run there (``kvrouter up --record``); a router started
    again (``router-restart``) records to ``FILE.1``, ``FILE.2``... so no start overwrites another's."""
    router_seed: int | None = None
    """``--router-seed`` of the router started (None: its routers draw their own)."""
    router_args: tuple[str, ...] = ()
    """More ``kvrouter up`` flags (``--from --live``: the recorded router config; the slow-consumer drill's
    small subscriber queues)."""
    mock_args: tuple[tuple[int, tuple[str, ...]], ...] = ()
    """(worker id, more ``kvrouter mock-worker`` flags) for the engines started with them."""
    logs: str | None = None
    """A directory for the stack's logs (``up.log``: every router's stderr; ``nats.log``), made if missing
    and left in place (``--keep-logs``); None: a temporary directory, removed with the stack."""

    def role_of(self, worker_id: int) -> str:
        """Engine ``worker_id``'s role (ids count from 1)."""
        if not self.prefill_workers:
            return "both"
        return "prefill" if worker_id <= self.prefill_workers else "decode"


@dataclass(frozen=True, slots=True)
class Mock:
    """One engine of the stack, as a drill addresses it."""

    worker_id: int
    http: str
    events: str = ""
    replay: str | None = None
    role: str = "both"


class Stack:
    """What every stack offers a drill: the router's URL, its engines, HTTP calls, a reset."""

    local = False
    """Whether the stack's processes are ours (drills needing signals or segments run only then)."""

    def __init__(self, url: str, model_name: str, block_size: int) -> None:
        self.url = url.rstrip("/")
        self.model_name = model_name
        self.block_size = block_size
        self.mocks: list[Mock] = []
        """The engines registered now."""
        self.fleet: list[Mock] = []
        """The engines registered at the start: what :meth:`reset` brings back after a churn."""
        self.generation = 0
        """Bumped by every router restart: the worker rows' counters start again from 0 then."""
        self.departed: dict[int, float] = {}
        """Workers removed during the current run -> ``time.monotonic()`` just before their ``/unregister``."""
        self._clients: dict[str, Client] = {}

    def client(self, url: str | None = None) -> Client:
        """The client of the router (or engine) at ``url`` (default: :attr:`url`), made on first use and
        kept, with its connections, until :meth:`close`."""
        base = (self.url if url is None else url).rstrip("/")
        found = self._clients.get(base)
        if found is None:
            found = self._clients[base] = Client(base, timeout=HTTP_TIMEOUT_S)
        return found

    async def call(self, method: str, url: str, body: object = None) -> tuple[int, Any]:
        """One JSON call, (status, answer) whatever the status: the drills judge an engine's control route by
        its status. ``url`` is absolute or a path of the router.

        Raises:
            ServiceUnreachable: no answer (an ``OSError``).
        """
        if url.startswith("/"):
            url = self.url + url
        parts = urlsplit(url)
        base = f"{parts.scheme}://{parts.netloc}"
        try:
            response = await self.client(base).request(method, url[len(base) :], body)
        except ApiError as exc:
            return exc.status, exc.body
        return response.status, response.body

    @property
    def urls(self) -> list[str]:
        """Every router of the stack (replicas: each one); the first is :attr:`url`."""
        return [self.url]

    def request_url(self) -> str:
        """Where the next workload request goes (replicas: each in turn, as a round-robin balancer)."""
        return self.url

    def generation_of(self, url: str) -> int:
        """Bumped when the router at ``url`` was replaced: its rows' counters started again from 0."""
        return self.generation

    async def workers(self, url: str | None = None) -> list[Worker]:
        """``GET /workers`` of the stack's model, on ``url`` (default: :attr:`url`).

        Raises:
            ReplayError: the router refused. ServiceUnreachable: it did not answer.
        """
        client = self.client(url)
        try:
            return await client.workers(self.model_name)
        except ApiError as exc:
            raise ReplayError(f"GET {client.url}/workers answered {exc.status}: {exc.message[:200]}") from exc

    def registration(self, mock: Mock) -> dict[str, Any]:
        """The ``POST /register`` body of ``mock``: a vLLM-format engine with a replay socket."""
        return {
            "instance_id": mock.worker_id,
            "endpoint": mock.events,
            "replay_endpoint": mock.replay,
            "http_endpoint": mock.http,
            "format": "vllm",
            "model_name": self.model_name,
            "block_size": self.block_size,
            "dp_rank": 0,
            "role": mock.role,
        }

    async def register(self, mock: Mock, url: str | None = None) -> None:
        """``POST /register`` of one mock on ``url`` (default: every router of :attr:`urls`), retried while
        the router's engine is still starting (503).

        Raises:
            ReplayError: refused, or still 503 after :data:`START_TIMEOUT_S`.
        """
        body = self.registration(mock)
        for base in self.urls if url is None else [url]:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    await self.client(base).register(**body)
                    break
                except ApiError as exc:
                    if exc.status != 503 or time.monotonic() > deadline:
                        raise ReplayError(
                            f"{base}/register of mock engine {mock.worker_id} answered {exc.status}: {exc.message}"
                        ) from exc
                except OSError as exc:  # refused, reset: the router is not there
                    raise ReplayError(f"{base}/register of mock engine {mock.worker_id}: {exc}{self._gone()}") from exc
                await asyncio.sleep(0.25)

    def _gone(self) -> str:
        """What the stack knows of why its router did not answer (a local one: its exit status and log)."""
        return ""

    async def reset(self) -> None:
        """Every engine restarted and re-registered; returns once the index follows each with nothing cached.

        Raises:
            ReplayError: an engine refused the restart, or the index did not catch up in
                :data:`RESET_TIMEOUT_S`.
        """
        for extra in [mock for mock in self.mocks if mock not in self.fleet]:
            await self.remove(extra)
            await self.retire(extra)
        self.mocks = list(self.fleet)
        self.departed.clear()
        for mock in self.mocks:
            status, answer = await self.call("POST", mock.http + "/restart", {})
            if status != 200:
                raise ReplayError(f"POST {mock.http}/restart answered {status}: {answer}")
            for url in self.urls:
                await self._unregister(mock, url)
            await self.register(mock)
        deadline = time.monotonic() + RESET_TIMEOUT_S
        waiting = list(self.urls)
        while waiting:
            rows = await self.workers(waiting[0])
            empty = {
                row["instance_id"]
                for row in rows
                for listener in row.get("listeners", {}).values()
                if listener.get("cached_blocks") == 0 and listener.get("state") in ("exact", "unknown")
            }
            try:
                ready = (await self.client(waiting[0]).ready())["ready"]
            except ApiError:  # a status /ready does not give (200 or 503): not ready either
                ready = False
            if empty >= {mock.worker_id for mock in self.mocks} and ready:
                waiting.pop(0)
                continue
            if time.monotonic() > deadline:
                raise ReplayError(
                    f"{waiting[0]}: the index did not forget the restarted engines in {RESET_TIMEOUT_S:.0f}s "
                    f"(or /ready is not 200): {rows}"
                )
            await asyncio.sleep(POLL_S)

    async def remove(self, mock: Mock) -> None:
        """Unregister ``mock`` while routing; it leaves :attr:`mocks` (its process keeps running).

        Raises:
            ReplayError: ``/unregister`` refused it.
        """
        self.departed[mock.worker_id] = time.monotonic()
        await self._unregister(mock)
        if mock in self.mocks:
            self.mocks.remove(mock)

    async def _unregister(self, mock: Mock, url: str | None = None) -> None:
        """``POST /unregister`` of ``mock`` on ``url`` (default: :attr:`url`); one it never knew (404) is fine.

        Raises:
            ReplayError: any other refusal.
        """
        try:
            await self.client(url).unregister(mock.worker_id, self.model_name)
        except ApiError as exc:
            if exc.status != 404:
                raise ReplayError(
                    f"/unregister of worker {mock.worker_id} answered {exc.status}: {exc.message}"
                ) from exc

    async def add_mock(self) -> Mock:
        """Start one more engine and register it (:class:`LocalStack` only).

        Raises:
            ReplayError: always here: an attached stack starts no process.
        """
        raise ReplayError("adding an engine needs a local stack")

    async def retire(self, mock: Mock) -> None:
        """Stop an engine :meth:`add_mock` started; nothing for an attached stack."""

    async def kill_mock(self, mock: Mock) -> int:
        """SIGKILL an engine (:class:`LocalStack` only); returns its pid.

        Raises:
            ReplayError: always here: an attached stack's engines are not ours.
        """
        raise ReplayError("killing an engine needs a local stack")

    async def restart_mock(self, mock: Mock) -> Mock:
        """Start a killed engine again (:class:`LocalStack` only).

        Raises:
            ReplayError: always here: an attached stack starts no process.
        """
        raise ReplayError("restarting an engine needs a local stack")

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode engines: each run also checks that every client was answered and nothing stays booked."""
        return False

    async def restart_router(self) -> int:
        """Stop the router and start it again on the same port (:class:`LocalStack` only); returns the old pid.

        Raises:
            ReplayError: always here: an attached stack's router is not ours.
        """
        raise ReplayError("restarting the router needs a local stack")

    def router_pid(self) -> int:
        """The router's pid; 0 when it is not ours."""
        return 0

    def applier_pids(self) -> dict[int, int]:
        """Shard -> the pid of its applier; empty when the stack's segments are not ours to read."""
        return {}

    def shards_of(self) -> dict[int, int]:
        """Worker id -> the shard following it; empty when the stack's segments are not ours to read."""
        return {}

    async def loads(self, url: str | None = None) -> dict[str, list[int]]:
        """``GET /loads`` of the router at ``url`` (default: :attr:`url`): ``"worker:rank"`` -> [prefill tokens,
        active blocks, requests].

        Raises:
            ReplayError: the router refused. ServiceUnreachable: it did not answer.
        """
        client = self.client(url)
        try:
            body = await client.loads()
        except ApiError as exc:
            raise ReplayError(f"GET {client.url}/loads answered {exc.status}: {exc.message[:200]}") from exc
        return {
            f"{row['worker_id']}:{row['dp_rank']}": [
                int(row["potential_prefill_tokens"]),
                int(row["potential_decode_blocks"]),
                int(row["active_requests"]),
            ]
            for partition in body
            for row in partition["loads"]
        }

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()


class LocalStack(Stack):
    """``kvrouter up`` and its mock engines, started and stopped by this process (see the module docstring)."""

    local = True

    def __init__(self, config: StackConfig) -> None:
        super().__init__("", config.model_name, config.block_size)
        self.config = config
        self.up: asyncio.subprocess.Process | None = None
        self.processes: list[MockProcess] = []
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        if config.logs:
            self.folder = Path(config.logs)
            self.folder.mkdir(parents=True, exist_ok=True)
        else:
            self._dir = tempfile.TemporaryDirectory(prefix="kvrouter-replay-")
            self.folder = Path(self._dir.name)
        self.log_path = self.folder / "up.log"
        self._drainer: asyncio.Task[None] | None = None
        self._router_starts = 0
        """Routers started so far (each records to its own file with ``record``)."""

    async def start(self) -> None:
        """Start the router, then the engines, and register them.

        Raises:
            ReplayError: the router printed no URL in :data:`START_TIMEOUT_S` or exited; an engine did not start.
        """
        await self._start_router(0)
        await self._start_mocks()

    async def _start_mocks(self) -> None:
        """The engines, started together, then registered (on every router)."""
        try:
            await asyncio.gather(*(self._start_mock(worker_id) for worker_id in range(1, self.config.mock_workers + 1)))
        except KvRouterError as exc:
            raise ReplayError(str(exc)) from exc
        self.processes.sort(key=lambda p: p.worker_id)
        self.mocks = [self._mock(p) for p in self.processes]
        self.fleet = list(self.mocks)
        for mock in self.mocks:
            await self.register(mock)

    async def _start_mock(self, worker_id: int) -> MockProcess:
        """Engine ``worker_id`` with its role and its flags from the config.

        Raises:
            MockError: it did not start.
        """
        cfg = self.config
        return await start_mock(
            worker_id,
            self.processes,
            block_size=cfg.block_size,
            num_gpu_blocks=cfg.num_gpu_blocks,
            speedup_ratio=cfg.speedup_ratio,
            extra_args=("--role", cfg.role_of(worker_id), *dict(cfg.mock_args).get(worker_id, ())),
        )

    def _mock(self, process: MockProcess) -> Mock:
        role = self.config.role_of(process.worker_id)
        return Mock(process.worker_id, process.http, process.events, process.replay, role)

    async def kill_mock(self, mock: Mock) -> int:
        """SIGKILL engine ``mock`` (no drain, no goodbye: as a crash or an OOM kill ends it) and reap it; returns
        its pid. It stays registered: noticing it is the router's job."""
        (process,) = [p for p in self.processes if p.worker_id == mock.worker_id]
        with contextlib.suppress(ProcessLookupError):
            process.proc.kill()
        await process.proc.wait()
        log.info("mock engine killed worker=%d pid=%d", mock.worker_id, process.proc.pid)
        return process.proc.pid

    async def restart_mock(self, mock: Mock) -> Mock:
        """Start killed engine ``mock`` again, as its supervisor would: a new process of the same id, role and
        flags (new ports: the old ones may be taken meanwhile), registered again in place of the old
        registration. Returns the new engine, which replaces ``mock`` in :attr:`mocks` and :attr:`fleet`.

        Raises:
            ReplayError: it did not start, or the router refused it.
        """
        await self.retire(mock)
        try:
            process = await self._start_mock(mock.worker_id)
        except KvRouterError as exc:
            raise ReplayError(str(exc)) from exc
        fresh = self._mock(process)
        for url in self.urls:
            await self._unregister(mock, url)
        await self.register(fresh)
        self.mocks = [fresh if m.worker_id == mock.worker_id else m for m in self.mocks]
        self.fleet = [fresh if m.worker_id == mock.worker_id else m for m in self.fleet]
        log.info("mock engine restarted worker=%d pid=%d http=%s", fresh.worker_id, process.proc.pid, fresh.http)
        return fresh

    async def _start_router(self, port: int) -> None:
        """``kvrouter up`` on ``port`` (0: any), its URL read from its first line; stdout drained from then on."""
        cfg = self.config
        argv = [
            sys.executable, "-m", "kvrouter", "up", "--port", str(port), "--zmq-port", "0", "--mock-workers", "0",
            "--shards", str(cfg.shards), "--model-name", cfg.model_name, "--block-size", str(cfg.block_size),
            *cfg.router_args,
        ]  # fmt: skip
        if cfg.record is not None:
            starts = self._router_starts
            path = cfg.record if not starts else f"{cfg.record}.{starts}"
            argv += ["--record", path]
        if cfg.router_seed is not None:
            argv += ["--router-seed", str(cfg.router_seed)]
        self._router_starts += 1
        with self.log_path.open("ab") as stderr:
            self.up = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,
            )
        assert self.up.stdout is not None
        try:
            match = await ready_line(self.up.stdout, URL_LINE, START_TIMEOUT_S)
        except TimeoutError:
            raise ReplayError(f"kvrouter up printed no URL in {START_TIMEOUT_S:.0f}s (log: {self.log_path})") from None
        if match is None:
            code = await self.up.wait()
            raise ReplayError(f"kvrouter up exited with {code}; its log ends: {self._log_tail()}")
        self.url = match[1].rstrip("/")
        self._drainer = asyncio.create_task(self._drain(self.up.stdout))

    def _gone(self) -> str:
        up = self.up
        if up is None:
            return ""
        exited = "" if up.returncode is None else f" (kvrouter up exited with {up.returncode})"
        return f"{exited}; its log ends: {self._log_tail()}"

    def _log_tail(self, lines: int = 5) -> str:
        """The last lines of the routers' stderr (the file goes with the stack's temporary directory, unless
        ``logs`` named one to keep)."""
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError as exc:
            return f"(unreadable: {exc})"
        return " | ".join(text[-lines:]) or "(empty)"

    async def _stop_router(self) -> None:
        """SIGTERM, up to :data:`STOP_TIMEOUT_S`, then SIGKILL and a sweep of what a killed router leaves."""
        up = self.up
        if up is None or up.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            up.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(up.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            log.warning("kvrouter up did not stop on SIGTERM pid=%d; killing it (log: %s)", up.pid, self.log_path)
            with contextlib.suppress(ProcessLookupError):
                up.kill()
            await up.wait()
            sweep_leftovers()

    async def restart_router(self) -> int:
        """SIGTERM (the router drains, as an operator's restart does), then ``kvrouter up`` again on the same
        port, and every engine of :attr:`mocks` registered again (a new router knows no worker)."""
        assert self.up is not None
        old = self.up.pid
        port = int(self.url.rsplit(":", 1)[1])
        await self._stop_router()
        for attempt in range(RESTART_PORT_TRIES):
            try:
                await self._start_router(port)
                break
            except ReplayError as exc:  # the port was taken meanwhile (an outgoing connection's local port)
                log.info("router restart on its port failed port=%d attempt=%d error=%s", port, attempt, exc)
                await asyncio.sleep(1.0)
        else:
            await self._start_router(0)
            log.warning("router restarted on another port old_port=%d url=%s", port, self.url)
        self.generation += 1
        for mock in self.mocks:
            await self.register(mock)
        log.info("router restarted old_pid=%d pid=%d port=%d", old, self.up.pid, port)
        return old

    def router_pid(self) -> int:
        return 0 if self.up is None else self.up.pid

    @property
    def disaggregated(self) -> bool:
        return self.config.prefill_workers > 0

    async def add_mock(self) -> Mock:
        worker_id = max(p.worker_id for p in self.processes) + 1
        try:
            process = await self._start_mock(worker_id)
        except KvRouterError as exc:
            raise ReplayError(str(exc)) from exc
        mock = self._mock(process)
        await self.register(mock)
        self.mocks.append(mock)
        return mock

    async def retire(self, mock: Mock) -> None:
        gone = [p for p in self.processes if p.worker_id == mock.worker_id]
        await stop_mocks(gone)
        self.processes = [p for p in self.processes if p.worker_id != mock.worker_id]

    @staticmethod
    async def _drain(stream: asyncio.StreamReader) -> None:
        """Read ``kvrouter up``'s stdout to the end, so a full pipe never blocks it."""
        while await stream.readline():
            pass

    def applier_pids(self) -> dict[int, int]:
        if self.up is None:
            return {}
        control = Control.attach(control_name(self.up.pid))
        try:
            return {shard.shard: shard.pid for shard in read_shards(control)}
        finally:
            control.close()

    def shards_of(self) -> dict[int, int]:
        if self.up is None:
            return {}
        control = Control.attach(control_name(self.up.pid))
        try:
            return {worker: stats.shard for (worker, _rank), stats in read_workers(control).items()}
        finally:
            control.close()

    async def close(self) -> None:
        """Stop the engines and the router (SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`); every one reaped."""
        await super().close()
        await stop_mocks(self.processes)
        await self._stop_router()
        if self._dir is not None:
            self._dir.cleanup()


class AttachedStack(Stack):
    """A running router (``--url``): its workers with an ``http_endpoint`` are the engines drills address."""

    def __init__(self, url: str, model_name: str) -> None:
        super().__init__(url, model_name, 0)
        self._rows: dict[int, Worker] = {}

    async def attach(self) -> None:
        """Read the workers and their block size.

        Raises:
            ReplayError: the router does not answer, or lists no worker with an ``http_endpoint``.
        """
        try:
            rows = await self.workers()
        except OSError as exc:
            raise ReplayError(f"cannot reach {self.url}: {exc}") from exc
        for row in rows:
            http = row.get("http_endpoint")
            if isinstance(http, str) and http:
                self.mocks.append(Mock(int(row["instance_id"]), http.rstrip("/")))
                self._rows[int(row["instance_id"])] = row
                self.block_size = int(row["block_size"])
        self.fleet = list(self.mocks)
        if not self.mocks:
            raise ReplayError(f"{self.url} lists no worker of model {self.model_name!r} with an http_endpoint")

    async def register(self, mock: Mock, url: str | None = None) -> None:
        """Register again as it was registered (the row's endpoints); one router, so ``url`` is :attr:`url`."""
        row = self._rows[mock.worker_id]
        body: dict[str, Any] = {
            "instance_id": mock.worker_id,
            "endpoint": row["endpoints"].get("0"),
            "replay_endpoint": row.get("replay_endpoint"),
            "http_endpoint": mock.http,
            "format": row.get("format", "vllm"),
            "model_name": self.model_name,
            "block_size": self.block_size,
            "dp_rank": 0,
        }
        try:
            await self.client().register(**body)
        except ApiError as exc:
            raise ReplayError(f"/register of worker {mock.worker_id} answered {exc.status}: {exc.message}") from exc
