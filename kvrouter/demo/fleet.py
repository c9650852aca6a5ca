"""The embedded demo of ``kvrouter up``: mock engines, a gentle client, a status line.

A newcomer runs one command and sees routing, overlap and load move, with no GPU and no external
service. Everything here goes through the public surfaces a real deployment uses, so the demo also
exercises them end to end:

- **Mock engines** are ``python -m kvrouter mock-worker`` subprocesses (``mocks.py``: block size 16,
  4,096 blocks each). They join through ``POST /register`` with ``http_endpoint``, as an operator's
  engines would.
- **The client** is an asyncio task in the front's own loop (``kvrouter.client.Client``, as an operator's
  script would use it; a thread or process would cost more than the few requests a second it sends).
  It speaks OpenAI's chat to the router, as the clients of a fleet do: each request is one streamed
  ``POST /v1/chat/completions``, which the router renders with the demo model's template
  (``kvrouter/chat``), routes on those tokens, books, forwards to the chosen engine (both hops of a split
  request) and frees. The workload is synthetic multi-turn chat: a few shared system prompts (popular ones
  more often), sessions of 2-6 turns whose messages grow by the previous turn and its answer
  (``workload.py``).
- **The status line** every few seconds: decisions per second, the hit rate the router predicted (the
  ``X-Kvrouter-Overlap-Tokens`` of each answer over its prompt tokens) beside the one the engines reported
  (``cached_tokens``), and each worker's active blocks from ``GET /loads``.

Rejected: an in-process mock engine (its threads would share the front's GIL and skew what the demo
shows) and driving the mocks without the router (the demo would then show nothing routed). The router's
own protocol (``/select_and_reserve`` and the reservation routes) is what the banner's ``curl`` lines show.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, TextIO

import orjson

from ..chat import DEMO_MODEL, ChatModel
from ..client import ApiError, Client, ServiceUnreachable
from ..errors import KvRouterError
from ..options import Panel, derived, option, shared
from .mocks import MockProcess, start_mock, stop_mocks
from .workload import Session, Workload

__all__ = ["Embedded", "EmbeddedConfig", "EmbeddedError"]

log = logging.getLogger(__name__)

HTTP_TIMEOUT_S: Final = 30.0


class EmbeddedError(KvRouterError):
    """The demo fleet could not start (a mock engine died, or the service refused a registration)."""


DEFAULT_MOCK_WORKERS: Final = 4
"""Mock engines ``kvrouter up`` starts when no ``--workers`` are given and ``--mock-workers`` is not set."""
DOCUMENTS: Final = 0.3
"""The disaggregated demo's share of sessions that open with a fresh long document (``Workload``)."""


@dataclass(frozen=True, slots=True)
class EmbeddedConfig:
    """What ``kvrouter up`` starts when no workers are given (see the module docstring).

    A field's ``metadata`` declares the ``kvrouter up`` option that sets it (``kvrouter/options.py``), or the
    service's option it shares (``block_size``, ``model_name``, ``routing_group``).
    """

    mock_workers: int = field(
        default=DEFAULT_MOCK_WORKERS,
        metadata=option(
            "--mock-workers",
            help=f"Mock engines to start and route to, with a gentle client (0 = none). Default "
            f"{DEFAULT_MOCK_WORKERS} without --workers, 0 with.",
            panel=Panel.DEMO,
            min=0,
            max=64,
            show_default=False,
            optional=True,
        ),
    )
    """Unset, ``kvrouter up`` starts none when it is given workers or a disaggregated demo, else this default."""
    mock_prefill_workers: int = field(
        default=0,
        metadata=option(
            "--mock-prefill-workers",
            help="Mock engines of role prefill, for a disaggregated demo (with --mock-decode-workers; they replace "
            "the default engines, and --mock-workers adds role both ones only when given).",
            panel=Panel.DEMO,
            min=0,
            max=64,
        ),
    )
    mock_decode_workers: int = field(
        default=0,
        metadata=option(
            "--mock-decode-workers",
            help="Mock engines of role decode, for a disaggregated demo.",
            panel=Panel.DEMO,
            min=0,
            max=64,
        ),
    )
    block_size: int = field(default=16, metadata=shared("block_size"))
    num_gpu_blocks: int = field(
        default=4096,
        metadata=option(
            "--mock-num-gpu-blocks", help="[blocks] KV capacity of each mock engine.", panel=Panel.DEMO, min=16
        ),
    )
    model_name: str = field(default="default", metadata=shared("model_name"))
    routing_group: str = field(default="default", metadata=shared("routing_group"))
    client_rate: float = field(
        default=3.0,
        metadata=option(
            "--client-rate",
            help="[requests/s] The built-in client's request rate (0 = mock engines, no client).",
            panel=Panel.DEMO,
            min=0.0,
            max=1000.0,
        ),
    )
    """Requests a second (Poisson arrivals); 0: no client."""
    status_secs: float = field(
        default=5.0,
        metadata=option("--status-secs", help="[secs] Period of the status line.", panel=Panel.DEMO, min=0.1),
    )
    seed: int = field(default=0, metadata=option("--seed", help="Seed of the synthetic workload.", panel=Panel.DEMO))
    first_worker_id: int = field(default=1, metadata=derived("after the highest --workers id: mock ids never collide"))
    max_in_flight: int = 32

    @property
    def roles(self) -> tuple[str, ...]:
        """Each mock engine's role, in worker-id order: prefill, then decode, then both."""
        return (
            ("prefill",) * self.mock_prefill_workers
            + ("decode",) * self.mock_decode_workers
            + ("both",) * self.mock_workers
        )


@dataclass(slots=True)
class Stats:
    """What the client saw since the last status line (and in total)."""

    decisions: int = 0
    prompt_tokens: int = 0
    predicted_tokens: int = 0
    cached_tokens: int = 0
    """Engine-reported cached prompt tokens of the requests completed (``usage.prompt_tokens_details``)."""
    completed_prompt_tokens: int = 0
    completed: int = 0
    errors: int = 0
    total_decisions: int = 0
    per_worker: Counter[int] = field(default_factory=Counter)
    error_kinds: set[str] = field(default_factory=set)

    def error(self, kind: str, detail: str) -> None:
        self.errors += 1
        if kind not in self.error_kinds:
            self.error_kinds.add(kind)
            log.warning("demo client request failed kind=%s detail=%s (logged once per kind)", kind, detail)


class Embedded:
    """The demo fleet of ``kvrouter up``: :meth:`start` once the API listens, :meth:`stop_client` on a
    signal (synchronous, from the signal handler), :meth:`close` after the service stopped."""

    def __init__(
        self, config: EmbeddedConfig, out: TextIO | None = None, *, decisions: Callable[[], int] | None = None
    ) -> None:
        """``decisions``: the service's decision counter (every client's, not only this one's) for the
        status line's decisions/s; None counts this client's own."""
        self.config = config
        self.out = out if out is not None else sys.stdout
        self._decisions = decisions if decisions is not None else self._own_decisions
        self.mocks: list[MockProcess] = []
        self.stats = Stats()
        self.workload = Workload(config.seed, documents=DOCUMENTS if config.mock_prefill_workers else 0.0)
        self._tasks: list[asyncio.Task[None]] = []
        self._requests: set[asyncio.Task[None]] = set()
        self._client: Client | None = None
        self._roles: dict[int, str] = {}
        """Each mock engine's role by worker id (``EmbeddedConfig.roles``)."""
        self._stopped = False
        self.url = ""

    def _own_decisions(self) -> int:
        return self.stats.total_decisions

    def print(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    async def start(self, url: str) -> None:
        """Start the mock engines, register them, print the banner, start the client and the status line.

        Raises:
            EmbeddedError: a mock engine did not start, or ``/register`` refused one.
        """
        self.url = url
        cfg = self.config
        roles = cfg.roles
        self.print(f"kvrouter up: starting {len(roles)} mock engines (block size {cfg.block_size}, "
                   f"{cfg.num_gpu_blocks} blocks each)...")  # fmt: skip
        self._roles = dict(zip(range(cfg.first_worker_id, cfg.first_worker_id + len(roles)), roles, strict=True))
        await asyncio.gather(
            *(
                start_mock(
                    worker_id,
                    self.mocks,
                    block_size=cfg.block_size,
                    num_gpu_blocks=cfg.num_gpu_blocks,
                    extra_args=("--role", role),
                )
                for worker_id, role in self._roles.items()
            )
        )
        self._client = client = Client(url, timeout=HTTP_TIMEOUT_S)
        for mock in self.mocks:
            body: dict[str, Any] = {
                "instance_id": mock.worker_id,
                "endpoint": mock.events,
                "replay_endpoint": mock.replay,
                "http_endpoint": mock.http,
                "format": "vllm",
                "model_name": cfg.model_name,
                "routing_group": cfg.routing_group,
                "block_size": cfg.block_size,
                "dp_rank": 0,
                "total_kv_blocks": cfg.num_gpu_blocks,
                "role": self._roles[mock.worker_id],
            }
            try:
                await client.register(**body)
            except ApiError as exc:
                raise EmbeddedError(
                    f"/register of mock engine {mock.worker_id} answered {exc.status}: {exc.message}"
                ) from exc
        if self._stopped:
            return
        self.print(self.banner())
        if cfg.client_rate > 0:
            self._tasks.append(asyncio.create_task(self._drive(), name="demo-client"))
            self._tasks.append(asyncio.create_task(self._status(), name="demo-status"))

    def banner(self) -> str:
        """What to try next, printed once the fleet is registered."""
        cfg, url = self.config, self.url
        chat_model = ChatModel.from_directory(cfg.model_name, DEMO_MODEL)
        sample = chat_model.encode(self.workload.system_prompts[0])[: 2 * cfg.block_size]
        select = orjson.dumps({"model_name": cfg.model_name, "token_ids": sample, "explain": True}).decode()
        ask = [{"role": "user", "content": "Which worker holds my prefix?"}]
        chat = orjson.dumps({"model": cfg.model_name, "messages": ask, "max_tokens": 16}).decode()
        workers = ", ".join(
            f"{m.worker_id}={m.http}" + ("" if self._roles[m.worker_id] == "both" else f" ({self._roles[m.worker_id]})")
            for m in self.mocks
        )
        client = (f"a client sends ~{cfg.client_rate:g} requests/s of multi-turn chat with shared system prompts"
                  if cfg.client_rate > 0 else "no client (--client-rate 0)")  # fmt: skip
        return "\n".join([
            f"kvrouter up: routing for model {cfg.model_name!r} across {len(self.mocks)} mock engines ({workers});",
            f"  {client}.",
            "Try:",
            f"  curl -s {url}/health",
            f"  curl -s {url}/workers",
            f"  curl -s {url}/loads",
            f"  curl -s {url}/v1/chat/completions -d '{chat}'   # OpenAI's chat, routed and forwarded",
            f"  curl -s {url}/select -d '{select}'",
            f"  curl -s '{url}/decisions?since=0'   # the last decisions, each candidate's cost terms",
            "  kvrouter top   # in another terminal (from a checkout: .venv/bin/kvrouter top): the live dashboard",
            "Status every few seconds: decisions/s, hit rate (router-predicted / engine-reported), active blocks per "
            "worker. Ctrl-C stops everything.",
        ])  # fmt: skip

    def stop_client(self) -> None:
        """Cancel the client and the status line (signal-handler safe: it only cancels tasks)."""
        self._stopped = True
        for task in [*self._tasks, *self._requests]:
            task.cancel()

    async def close(self) -> None:
        """Stop the client if still running, close its connections, stop and reap every mock engine."""
        self.stop_client()
        pending = [*self._tasks, *self._requests]
        if pending:
            await asyncio.wait(pending, timeout=2.0)
        if self._client is not None:
            await self._client.aclose()
        await stop_mocks(self.mocks)

    # -- internals ---------------------------------------------------------------------------------

    async def _drive(self) -> None:
        """Poisson arrivals at ``client_rate``; each takes an idle session (a new one when none is idle)."""
        cfg = self.config
        rng = random.Random(cfg.seed + 1)
        sessions: list[Session] = []
        while True:
            await asyncio.sleep(rng.expovariate(cfg.client_rate))
            if len(self._requests) >= cfg.max_in_flight:
                continue
            sessions = [s for s in sessions if s.turns_left > 0 or s.busy]
            idle = [s for s in sessions if not s.busy and s.turns_left > 0]
            if idle and rng.random() < 0.7:
                session = rng.choice(idle)
            else:
                session = self.workload.session()
                sessions.append(session)
            messages, max_tokens = self.workload.turn(session)
            session.busy = True
            task = asyncio.create_task(self._request(session, messages, max_tokens))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)

    async def _request(self, session: Session, messages: list[dict[str, Any]], max_tokens: int) -> None:
        """One turn through ``POST /v1/chat/completions``, streamed; the router books, splits and frees it."""
        stats, client = self.stats, self._client
        assert client is not None
        try:
            cached, prompt_tokens = 0, 0
            stream = client.stream_chat_completions(
                messages, model=self.config.model_name, max_tokens=max_tokens, stream_options={"include_usage": True}
            )
            content: list[str] = []
            async with stream:
                async for chunk in stream:
                    if "error" in chunk:
                        raise ValueError(f"engine error: {chunk['error']}")
                    for choice in chunk.get("choices") or ():
                        content.append((choice.get("delta") or {}).get("content") or "")
                    usage = chunk.get("usage") or {}
                    prompt_tokens = int(usage.get("prompt_tokens", prompt_tokens) or 0)
                    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached) or 0)
            session.answered("".join(content))
            stats.decisions += 1
            stats.total_decisions += 1
            if stream.worker:
                stats.per_worker[int(stream.worker.split(":")[0])] += 1
            stats.prompt_tokens += prompt_tokens
            stats.predicted_tokens += stream.overlap_tokens
            stats.cached_tokens += cached
            stats.completed_prompt_tokens += prompt_tokens
            stats.completed += 1
        except asyncio.CancelledError:
            raise
        except (ApiError, ServiceUnreachable, KeyError, ValueError, TypeError) as exc:
            stats.error(type(exc).__name__, str(exc)[:200])
        finally:
            session.busy = False

    async def _status(self) -> None:
        """One line every ``status_secs``: decisions/s, hit rates, active blocks per worker. A line that fails
        is skipped, and the first failure of each kind is logged: the status line goes on while the service
        serves (its writes never raise: ``kvrouter/stdio.py``)."""
        stats = self.stats
        start = last = time.monotonic()
        counted = self._decisions()
        failed: set[str] = set()
        while True:
            await asyncio.sleep(self.config.status_secs)
            try:
                now, total = time.monotonic(), self._decisions()
                rate = (total - counted) / (now - last)
                self.print(self.status_line(now - start, rate, total, await self._active_blocks()))
                last, counted = now, total
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if type(exc).__name__ not in failed:
                    failed.add(type(exc).__name__)
                    log.warning("demo status line skipped error=%r (logged once per kind)", exc)
            stats.decisions = stats.prompt_tokens = stats.predicted_tokens = 0
            stats.cached_tokens = stats.completed_prompt_tokens = 0

    def status_line(self, uptime: float, rate: float, decisions: int, active: dict[int, int] | None) -> str:
        """``rate`` and ``decisions``: the service's decisions per second and in total; hit rates over this
        client's requests since the last line."""
        s = self.stats

        def pct(part: int, whole: int) -> str:
            return f"{100 * part / whole:.0f}%" if whole else "-"

        blocks = (
            "?" if active is None else " ".join(f"{w}:{active.get(w, 0)}" for w in (m.worker_id for m in self.mocks))
        )
        predicted = pct(s.predicted_tokens, s.prompt_tokens)
        engine = pct(s.cached_tokens, s.completed_prompt_tokens)
        return (
            f"[{uptime:6.0f}s] {rate:5.1f} decisions/s | hit {predicted} predicted, {engine} engine"
            f" | active blocks {blocks} | {decisions} decisions, {s.errors} errors"
        )

    async def _active_blocks(self) -> dict[int, int] | None:
        """Per worker, active (decode) blocks summed over dp ranks, from ``GET /loads``; None when unreadable."""
        if self._client is None:
            return None
        try:
            groups = await self._client.loads()
        except (ApiError, ServiceUnreachable):
            return None
        blocks: Counter[int] = Counter()
        for group in groups:
            if group["model_name"] != self.config.model_name:
                continue
            for load in group["loads"]:
                blocks[int(load["worker_id"])] += int(load["potential_decode_blocks"])
        return dict(blocks)
