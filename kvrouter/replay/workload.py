"""The workload a drill drives: a Mooncake trace turned into token prompts, sent through the router's proxy.

**Scaled, not invented.** A trace request is a list of chained hash ids, each naming a 512-token block
(``sim/trace.py``). Each id becomes :data:`TOKENS_PER_HASH` token ids derived from the id alone, so two
requests share exactly the prefix the trace says they share; the uncached tail and the output are
scaled by the same 1/16. The sharing structure, the arrival order and the relative sizes are the
trace's; the absolute sizes are small enough for 2 cores to drive a few hundred requests a minute
through a router and four mock engines (the sample's mean prompt, 13,700 tokens, becomes about 860).
Rejected: full-size prompts (100 KB of JSON per request, and four mocks would hold ten prompts each,
so eviction would dominate every drill) and a synthetic workload (the issue asks for a trace, and the
simulator's numbers are on this one).

**Through the proxy.** Each request is one streamed ``POST /v1/completions`` to ``kvrouter up``
(``kvrouter.client``'s ``stream_completions``, one client per router address): the
router chooses, books, marks prefill complete at the first chunk and frees at the end, as for any
OpenAI client, so the drill measures the public path. The mock's answer carries what the drill reports:
``usage.prompt_tokens_details.cached_tokens`` (the engine's own hit) and ``kvrouter.ttft_ms`` (its
simulated time to first token).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from ..client import ApiError, Client, ServiceUnreachable
from ..sim.trace import TRACE_BLOCK_SIZE, Trace

__all__ = ["TOKENS_PER_HASH", "Outcome", "ReplayRequest", "drive", "requests_from_trace"]

log = logging.getLogger(__name__)

TOKENS_PER_HASH: Final = 32
"""Tokens standing for one 512-token trace block: the trace scaled by 1/16 (see the module docstring)."""

MAX_IN_FLIGHT: Final = 64
"""Requests in flight at most; an arrival beyond it waits (and is late), so an overload cannot snowball."""

REQUEST_TIMEOUT_S: Final = 60.0

_TAIL_BASE: Final = 1 << 30
"""Token ids of a request's own tail start here, far above any hash id's tokens (ids < 2**25 here)."""


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request of the workload."""

    at: float
    """Seconds after the run's start, at the chosen speed."""
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Outcome:
    """What one request came back with."""

    sent: float
    """``time.monotonic()`` when it was sent."""
    prompt_tokens: int
    worker: str = ""
    """The router's ``X-Kvrouter-Worker`` (``id:rank``)."""
    cached_tokens: int = 0
    ttft_ms: float | None = None
    error: str | None = None
    answered: bool = False
    """An answer came, a refusal (a status, an in-band error) included; False: the connection failed or the
    request timed out (a client left hanging)."""


def _hash_tokens(hash_id: int) -> list[int]:
    base = hash_id * TOKENS_PER_HASH + 1
    return list(range(base, base + TOKENS_PER_HASH))


def requests_from_trace(trace: Trace, *, count: int, speed: float) -> list[ReplayRequest]:
    """The first ``count`` requests of ``trace`` as prompts, arriving ``speed`` times faster than recorded.

    Raises:
        ValueError: ``count`` < 1, ``speed`` not positive, or the trace has fewer than ``count`` requests.
    """
    if count < 1:
        raise ValueError(f"requests must be >= 1, got {count}")
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    if len(trace.requests) < count:
        raise ValueError(f"trace {trace.name} has {len(trace.requests)} requests; {count} were asked for")
    scale = TOKENS_PER_HASH / TRACE_BLOCK_SIZE
    chosen = trace.requests[:count]
    start = chosen[0].arrival
    out = []
    for serial, request in enumerate(chosen):
        prompt = [token for hash_id in request.local_hashes for token in _hash_tokens(hash_id)]
        tail = max(int((request.input_tokens % TRACE_BLOCK_SIZE) * scale), 0 if prompt else 1)
        prompt.extend(_TAIL_BASE + serial * TOKENS_PER_HASH + i for i in range(tail))
        max_tokens = max(1, int(request.output_tokens * scale))
        out.append(ReplayRequest((request.arrival - start) / speed, prompt, max_tokens))
    return out


async def _one(client: Client, model: str, request: ReplayRequest, outcome: Outcome) -> None:
    """One request through the proxy, what it came back with written to ``outcome``.

    Raises:
        ApiError: the router or the engine refused it, or a payload did not parse.
        ServiceUnreachable: no answer, or the stream broke.
    """
    async with client.stream_completions(request.prompt, model=model, max_tokens=request.max_tokens) as stream:
        outcome.worker = stream.worker
        async for chunk in stream:
            if "error" in chunk:
                outcome.error = "engine error"
                continue
            extra = chunk.get("kvrouter") or {}
            if outcome.ttft_ms is None and isinstance(extra.get("ttft_ms"), int | float):
                outcome.ttft_ms = float(extra["ttft_ms"])
            usage = chunk.get("usage")
            if usage:
                outcome.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def drive(
    url: Callable[[], str],
    model: str,
    requests: Sequence[ReplayRequest],
    *,
    on_sent: Callable[[int], None] | None = None,
    on_done: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Send every request at its time (at most :data:`MAX_IN_FLIGHT` at once) and wait for every answer.

    ``url()`` is the router's address when a request goes out (a restarted router may have moved).

    A failed request is an :class:`Outcome` with ``error`` set, never an exception: a drill injects faults,
    and requests failing meanwhile (a restarted engine fails its requests in flight) are part of what it
    reports. ``on_sent(i)`` is called as request ``i`` goes out (the drills time their fault on it).
    """
    outcomes: list[Outcome] = []
    errors_logged: set[str] = set()
    limit = asyncio.Semaphore(MAX_IN_FLIGHT)
    tasks: list[asyncio.Task[None]] = []

    clients: dict[str, Client] = {}

    def client() -> Client:
        address = url()
        found = clients.get(address)
        if found is None:
            found = clients[address] = Client(address, timeout=REQUEST_TIMEOUT_S, connections=MAX_IN_FLIGHT)
        return found

    async def send(client: Client, request: ReplayRequest, outcome: Outcome) -> None:
        try:
            await _one(client, model, request, outcome)
            outcome.answered = True
        except ApiError as exc:  # refused (its status), or a payload that did not parse (that error's name)
            outcome.worker = outcome.worker or exc.headers.get("X-Kvrouter-Worker", "")
            outcome.error = f"status {exc.status}" if exc.__cause__ is None else type(exc.__cause__).__name__
            outcome.answered = True
        except ServiceUnreachable as exc:  # named by aiohttp's error (refused, disconnected, timed out)
            outcome.error = type(exc.__cause__ or exc).__name__
        finally:
            limit.release()
        if outcome.error is not None and outcome.error not in errors_logged:
            errors_logged.add(outcome.error)
            log.info("replay request failed error=%s worker=%s (logged once per kind)", outcome.error, outcome.worker)
        if on_done is not None:
            on_done(outcome)

    start = time.monotonic()
    try:
        for i, request in enumerate(requests):
            delay = start + request.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await limit.acquire()
            outcome = Outcome(time.monotonic(), len(request.prompt))
            outcomes.append(outcome)
            tasks.append(asyncio.create_task(send(client(), request, outcome)))
            if on_sent is not None:
                on_sent(i)
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        for each in clients.values():
            await each.aclose()
    return outcomes
