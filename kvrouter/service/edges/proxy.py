"""``POST /v1/completions``: choose a worker, forward the request to it, and keep its load booked meanwhile.

A client that speaks OpenAI's completions needs no router protocol: the proxy does what a gateway does
around the select-and-reserve protocol — ``Service.select(reserve=True)`` (so the request counts in the
next decisions), forward the body to the chosen worker's ``http_endpoint`` + ``/v1/completions``,
``prefill_complete`` at the first streamed chunk (the first token; for a non-streamed answer, when the
answer arrives), ``free`` when the answer ends. The reservation is freed on every way out: the normal
end, a worker error status, the worker's connection dropping mid-stream (an error chunk then tells the
client; a stream that ends without ``data: [DONE]`` was cut, however it ended), the client going away, a
cancellation, an exception. The reservation's own expiry (300 s) is only the last net.

**Streaming** is passed through chunk by chunk (whatever ``readany`` returns, written as it arrives), not
re-parsed as SSE: the proxy adds no per-token cost and needs to know nothing of the worker's chunk
format. **A client that goes away** is noticed by a watcher polling the request's transport every
``DISCONNECT_POLL_S``: aiohttp does not cancel handlers on disconnect by default (turning that on
server-wide would also cancel every other route mid-write), and a streaming handler only notices when it
next writes, which for a long decode can be many seconds later. The watcher cancels the handler's
upstream read, which closes the worker's connection too, so the worker stops generating for nobody.

**A split request** (a disaggregated partition, ``routing/disagg.py``) runs two hops, as vLLM's disaggregated
proxy does with its NixlConnector: the prompt to the prefill worker with one output token, not streamed, and
``kv_transfer_params`` asking it to keep the KV for a remote decode (its booking ends with that answer); then
the original request to the decode worker with the ``kv_transfer_params`` the prefill worker returned (where
to pull the KV from). A prefill worker that refuses the connection is marked down and the request decided
again, once; refused again, the decode worker prefills the request itself. A failed pull shows as the decode
worker's error status, passed to the client like any other.

**A worker that refuses the connection** (nothing was sent, so retrying cannot duplicate work) is marked
down at once, as its health probe would after a few ticks, and the request is decided again among the
rest, once — the next decision's winner is the next-best worker, the fallback ``/select`` would have
listed. The health probe brings the worker back when it answers ``/health`` again. Any other upstream
failure before the answer's headers is a 502 without retry (the worker may have started the request).

**Text prompts** are tokenized only with ``ServiceConfig.tokenizer`` (a local ``tokenizer.json``, read
with the ``tokenizers`` package on first use); token-id prompts go through untouched. Rejected
alternatives: fetching tokenizers from a hub (a router must not reach the network to start), and
guessing a tokenizer from the model name.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any, Final, Protocol

import aiohttp
import numpy as np
import numpy.typing as npt
import orjson
from aiohttp import web

from ...errors import BadRequest, ServiceError, UpstreamFailed
from ..core.decision import Decision
from ..core.requests import SelectRequest, parse_body, parse_priority, token_array
from ..core.state import Core
from .chat_answer import ChatAnswer
from .routes import SESSION_HEADER, client_gone
from .tracing import RequestTrace, Tracing

__all__ = [
    "COMPLETIONS_ROUTE",
    "DISCONNECT_POLL_S",
    "OVERLAP_HEADER",
    "PRIORITY_HEADER",
    "WORKER_HEADER",
    "CompletionsProxy",
    "cache_salt",
    "priority",
]

log = logging.getLogger(__name__)

COMPLETIONS_ROUTE: Final = "/v1/completions"
WORKER_HEADER: Final = "X-Kvrouter-Worker"
SELECTION_HEADER: Final = "X-Kvrouter-Selection-Id"
PRIORITY_HEADER: Final = "X-Kvrouter-Priority"
"""A request's router-queue priority for clients that cannot add ``priority`` to the body."""
OVERLAP_HEADER: Final = "X-Kvrouter-Overlap-Tokens"
"""The prompt tokens the router found cached on the worker it chose: what it expects the engine to report
as ``cached_tokens`` (a client compares the two without asking ``/decisions``). For a split request, the
prefill worker's: the decode engine reports the KV it pulled as cached, which no index predicts (so the
index accuracy join skips split requests: ``Reservations.book``)."""
DISCONNECT_POLL_S: Final = 0.05
"""How often a request in flight checks that its client is still connected."""
CONNECT_TIMEOUT_S: Final = 5.0
USAGE_TAIL_BYTES: Final = 8192
"""The end of a streamed answer kept to read its usage chunk: the engine's reused tokens (``accuracy.py``)."""
ATTEMPTS: Final = 2
"""The chosen worker, then once more after a refused connection."""
PREFILL_HOP: Final = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""The ``kv_transfer_params`` of a prefill hop, as vLLM's disaggregated proxy sends them."""
JSON_TYPE: Final = {"Content-Type": "application/json"}
DONE: Final = b"data: [DONE]"
"""How an OpenAI stream ends; a stream that ends without it was cut (its worker died or dropped it)."""


class _Tokenizer(Protocol):
    def encode(self, text: str) -> Any: ...


class CompletionsProxy:
    """The ``/v1/completions`` route of one service: :meth:`add_to` adds it to the app."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.tracing = Tracing(core.config.otlp_endpoint)
        """Spans of the requests forwarded (``--otlp-endpoint``; ``tracing.py``)."""
        self._client: aiohttp.ClientSession | None = None
        self._tokenizer: _Tokenizer | None = None
        self.client_gone = 0
        """Requests whose client went away before the answer ended."""
        self.retried = 0
        """Requests decided again after their worker refused the connection."""
        self.upstream_failed = 0
        """Requests whose worker failed (refused twice, dropped, or broke mid-stream)."""

    def add_to(self, app: web.Application) -> None:
        """Add ``POST /v1/completions``; the proxy's client session closes with the app."""
        app.router.add_post(COMPLETIONS_ROUTE, self.handle)
        app.on_cleanup.append(self.close)

    async def close(self, _app: web.Application | None = None) -> None:
        self.tracing.close()
        if self._client is not None:
            await self._client.close()
            self._client = None

    def _session(self) -> aiohttp.ClientSession:
        if self._client is None:
            self._client = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
                auto_decompress=False,
            )
        return self._client

    # -- the request ---------------------------------------------------------------------------

    def _tokenize(self, text: str) -> list[int]:
        path = self.core.config.tokenizer
        if path is None:
            raise BadRequest("prompt: text prompts need --tokenizer (a local tokenizer.json); send token ids")
        if self._tokenizer is None:
            try:
                from tokenizers import Tokenizer  # only with --tokenizer: a heavy import
            except ImportError as exc:  # pragma: no cover - a dependency of the package
                raise ServiceError(f"--tokenizer needs the tokenizers package: {exc}") from exc
            try:
                self._tokenizer = Tokenizer.from_file(path)
            except Exception as exc:
                raise ServiceError(f"--tokenizer {path}: cannot load: {exc}") from exc
        return list(self._tokenizer.encode(text).ids)

    def _prompt(self, body: dict[str, Any], raw: bytes) -> tuple[npt.NDArray[np.uint32], bytes]:
        """The prompt's token ids, and the body to forward (``raw`` itself unless the prompt changed)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
            prompt = prompt[0]  # a batch of one
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            raise BadRequest(f"prompt: one prompt per request, got a batch of {len(prompt)}")
        if isinstance(prompt, str):
            tokens = token_array(self._tokenize(prompt), "prompt")
        elif isinstance(prompt, list):
            tokens = token_array(prompt, "prompt")
        else:
            raise BadRequest("prompt: expected a list of token ids (or text with --tokenizer)")
        if not len(tokens):
            raise BadRequest("prompt: empty")
        if prompt is not body["prompt"] or isinstance(prompt, str):  # the worker gets one flat list of ids
            raw = orjson.dumps({**body, "prompt": tokens.tolist()})
        return tokens, raw

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.core.lifecycle.require_index()
        body = parse_body(raw)
        tokens, forward = self._prompt(body, raw)
        model = body.get("model", self.core.config.model_name)
        if not isinstance(model, str) or not model:
            raise BadRequest("model: expected a non-empty string")
        base, adapter = self.core.registry.served_as(model)
        salt, klass = cache_salt(body), priority(request, body)
        return await self.forward(request, base, tokens, forward, COMPLETIONS_ROUTE, salt, klass, lora=adapter)

    async def forward(
        self,
        request: web.Request,
        model: str,
        tokens: npt.NDArray[np.uint32],
        forward: bytes,
        route: str,
        salt: str | None = None,
        klass: int = 0,
        *,
        lora: str | None = None,
        as_chat: bool = False,
    ) -> web.StreamResponse:
        """Route ``tokens`` in ``model``'s partition (hashed with the request's ``cache_salt``, ``salt``, and LoRA
        adapter, ``lora``, as ``/select`` hashes them; an adapter's request goes to the workers serving it),
        book them, and send ``forward`` (the body as the worker gets it) to the chosen worker's ``route`` (both
        hops of a split request); the answer is relayed (``as_chat``: a completion's turned into a chat's,
        ``chat_answer.py``, for ``--forward-tokens``). ``klass`` is its priority in the router queue.
        ``/v1/chat/completions`` comes here too, with the tokens of its rendered prompt."""
        core = self.core
        select = SelectRequest(
            model_name=model,
            routing_group=core.config.routing_group,
            token_ids=tokens,
            session_id=request.headers.get(SESSION_HEADER) or None,
            lora_name=lora,
            cache_salt=salt,
            priority=klass,
            fallbacks=1 if self.tracing.endpoint is not None else 0,  # the decision span names the runner-up
        )
        trace = self.tracing.request(request, route)
        if trace is None:
            return await self._forward(request, select, forward, route, as_chat, None)
        try:
            response = await self._forward(request, select, forward, route, as_chat, trace)
        except BaseException as exc:
            trace.failed(exc)
            raise
        trace.end(response.status)
        return response

    async def _forward(
        self,
        request: web.Request,
        select: SelectRequest,
        forward: bytes,
        route: str,
        as_chat: bool,
        trace: RequestTrace | None,
    ) -> web.StreamResponse:
        """:meth:`forward`'s work, its spans told to ``trace`` when tracing is on."""
        for attempt in range(ATTEMPTS):
            result, selection_id = await self._decide(request, select, trace)
            headers = JSON_TYPE if trace is None else trace.upstream(JSON_TYPE)
            decode_body = forward
            if result.split is not None and result.split.prefill is not None:
                try:
                    decode_body = await self._prefill_hop(result, forward, route, headers)
                except aiohttp.ClientConnectorError as exc:  # nothing was sent: decide again without it
                    self._free(selection_id)
                    self._mark_down(result, exc, prefill=True)
                    if attempt + 1 < ATTEMPTS:
                        self.retried += 1
                        continue
                    select = dataclasses.replace(select, whole=True)  # refused twice: the decode worker prefills
                    result, selection_id = await self._decide(request, select, trace)
                except BaseException:
                    self._free(selection_id)
                    raise
            try:
                upstream = await self._connect(result, decode_body, route, headers)
            except aiohttp.ClientConnectorError as exc:
                self._free(selection_id)
                self._mark_down(result, exc)
                if attempt + 1 < ATTEMPTS:
                    self.retried += 1
                    continue
                self.upstream_failed += 1
                raise UpstreamFailed(f"worker {_name(result)} refused the connection: {exc}") from exc
            except BaseException:
                self._free(selection_id)
                raise
            try:
                return await self._relay(request, upstream, result, ChatAnswer() if as_chat else None)
            finally:
                upstream.close()
                self._free(selection_id)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _decide(
        self, request: web.Request, select: SelectRequest, trace: RequestTrace | None
    ) -> tuple[Decision, str]:
        """A booked decision through the router queue (timed for ``trace``), and its selection id."""
        asked = time.time_ns()
        result = await self.core.queue.select(select, reserve=True, gone=client_gone(request))
        if trace is not None:
            trace.decided(result, asked, time.time_ns())
        assert result.selection_id is not None
        return result, result.selection_id

    async def _prefill_hop(self, result: Decision, forward: bytes, route: str, headers: dict[str, str]) -> bytes:
        """A split request's first hop, as vLLM's proxy sends it to the NixlConnector: the prompt with one output
        token, whole (not streamed), asking the prefill worker to keep its KV for a remote decode. Its answer's
        ``kv_transfer_params`` go to the decode worker with the original request (returned, as its body); the
        prefill worker's booking ends here. A refused connection is the caller's to retry elsewhere;
        :class:`UpstreamFailed` for any other failure.
        """
        split, selection_id = result.split, result.selection_id
        assert split is not None
        assert split.prefill is not None
        assert selection_id is not None
        name = _name(result, split.prefill.worker)
        if result.prefill_endpoint is None:
            raise UpstreamFailed(f"prefill worker {name} registered no http_endpoint to forward to")
        sent = orjson.loads(forward)  # the body as forwarded (its prompt as token ids)
        hop = {**sent, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_HOP}
        if "max_completion_tokens" in hop:  # chat's newer name, which vLLM reads first
            hop["max_completion_tokens"] = 1
        hop.pop("stream_options", None)
        url = result.prefill_endpoint.rstrip("/") + route
        try:
            async with self._session().post(url, data=orjson.dumps(hop), headers=headers) as answer:
                data = await answer.read()
        except aiohttp.ClientConnectorError:
            raise
        except aiohttp.ClientError as exc:
            self.upstream_failed += 1
            raise UpstreamFailed(f"prefill worker {name} failed before answering: {exc!r}") from exc
        params = _transfer_params(data) if answer.status < 400 else None
        if params is None:
            self.upstream_failed += 1
            detail = data[:200].decode(errors="replace")
            raise UpstreamFailed(f"prefill worker {name} answered {answer.status} without kv_transfer_params: {detail}")
        self.core.reservations.end_prefill_hop(selection_id)
        return orjson.dumps({**sent, "kv_transfer_params": params})

    async def _connect(
        self, result: Decision, body: bytes, route: str, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """Send the request to the chosen worker; its answer's headers. :class:`UpstreamFailed` for any
        failure but a refused connection (which the caller retries elsewhere)."""
        if result.endpoint is None:
            raise UpstreamFailed(f"worker {_name(result)} registered no http_endpoint to forward to")
        url = result.endpoint.rstrip("/") + route
        try:
            return await self._session().post(url, data=body, headers=headers)
        except aiohttp.ClientConnectorError:
            raise
        except aiohttp.ClientError as exc:
            self.upstream_failed += 1
            raise UpstreamFailed(f"worker {_name(result)} failed before answering: {exc!r}") from exc

    def _free(self, selection_id: str) -> None:
        with contextlib.suppress(ServiceError):  # expired meanwhile: nothing left to take back
            self.core.reservations.free(selection_id)

    def _mark_down(self, result: Decision, exc: Exception, *, prefill: bool = False) -> None:
        """The worker (a split request's prefill worker, with ``prefill``) refused a connection: skip it now, as
        its health probe would in a few ticks (which also brings it back once it answers)."""
        split = result.split
        worker = split.prefill.worker if prefill and split is not None and split.prefill else result.selection.worker
        endpoint = result.prefill_endpoint if prefill else result.endpoint
        self.core.registry.mark_down(result.partition, worker[0], "http_endpoint refused")
        log.warning("proxy worker refused worker=%s endpoint=%s error=%s", _name(result, worker), endpoint, exc)

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        result: Decision,
        convert: ChatAnswer | None = None,
    ) -> web.StreamResponse:
        """Pass the worker's answer on (through ``convert`` when given); prefill completes at its first chunk.
        Returns when the answer ended or the client went away."""
        selection_id = result.selection_id
        assert selection_id is not None
        prefill = result.split.prefill if result.split is not None else None
        overlap = (prefill or result.selection).overlap_blocks * result.partition.block_size
        headers = {WORKER_HEADER: _name(result), SELECTION_HEADER: selection_id, OVERLAP_HEADER: str(overlap)}
        task = asyncio.current_task()
        assert task is not None
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch(request, task, gone), name="kvrouter-proxy-watch")
        response: web.StreamResponse | None = None
        try:
            content_type = upstream.headers.get("Content-Type", "application/json")
            if not content_type.startswith("text/event-stream"):
                data = await upstream.read()
                if upstream.status < 400:
                    self.core.reservations.prefill_complete(selection_id, _reused(data))
                    if convert is not None:
                        data = convert.whole(data)
                headers["Content-Type"] = content_type
                return web.Response(body=data, status=upstream.status, headers=headers)
            headers["Content-Type"] = content_type
            headers["Cache-Control"] = "no-cache"
            response = web.StreamResponse(status=upstream.status, headers=headers)
            await response.prepare(request)
            first = True
            tail = b""
            try:
                async for chunk in upstream.content.iter_any():
                    if first:
                        first = False
                        self.core.reservations.prefill_complete(selection_id)
                    if convert is not None:
                        chunk = convert.stream(chunk)
                    await response.write(chunk)
                    tail = (tail + chunk)[-USAGE_TAIL_BYTES:]
                if convert is not None and (rest := convert.end()):
                    await response.write(rest)
                    tail = (tail + rest)[-USAGE_TAIL_BYTES:]
                if (reused := _reused_in_stream(tail)) is not None:
                    self.core.reservations.report_reuse(selection_id, reused)
                if upstream.status < 400 and DONE not in tail:  # closed without OpenAI's end: the worker died
                    raise aiohttp.ClientPayloadError("the stream ended before its data: [DONE]")
            except aiohttp.ClientError as exc:  # the worker dropped mid-stream: tell the client, in-band
                self.upstream_failed += 1
                log.warning("proxy stream broken worker=%s error=%r", _name(result), exc)
                error = {"error": {"message": f"worker {_name(result)} failed mid-stream: {exc!r}", "code": 502}}
                await response.write(b"data: " + orjson.dumps(error) + b"\n\n")
            await response.write_eof()
            return response
        except asyncio.CancelledError:
            if not gone.is_set():
                raise
            task.uncancel()
            self.client_gone += 1
            return response if response is not None else web.Response(status=499)
        except ConnectionResetError:  # a write to a client that left
            self.client_gone += 1
            assert response is not None
            return response
        finally:
            watcher.cancel()


def cache_salt(body: dict[str, Any]) -> str | None:
    """The body's ``cache_salt`` (vLLM's: a tenant's blocks shared only with requests of the same salt).

    Raises:
        BadRequest: not a non-empty string.
    """
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("cache_salt: expected a non-empty string", param="cache_salt")
    return salt


def priority(request: web.Request, body: dict[str, Any]) -> int:
    """The request's priority in the router queue: the body's ``priority`` (vLLM's field, which the engine
    gets too), else the ``X-Kvrouter-Priority`` header (for clients that cannot add a field), else 0.

    Raises:
        BadRequest: not an integer.
    """
    if body.get("priority") is not None:
        return parse_priority(body["priority"])
    header = request.headers.get(PRIORITY_HEADER)
    if header is None:
        return 0
    try:
        value = int(header)
    except ValueError:
        raise BadRequest(f"{PRIORITY_HEADER}: expected an integer, got {header!r}") from None
    return parse_priority(value, PRIORITY_HEADER)


async def _watch(request: web.Request, task: asyncio.Task[Any], gone: asyncio.Event) -> None:
    """Cancel ``task`` once the client's connection is gone."""
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        transport = request.transport
        if transport is None or transport.is_closing():
            gone.set()
            task.cancel()
            return


def _reused(answer: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a JSON answer, None when it has none."""
    if b'"cached_tokens"' not in answer:
        return None
    try:
        return _cached(orjson.loads(answer))
    except orjson.JSONDecodeError:
        return None


def _reused_in_stream(tail: bytes) -> int | None:
    """The same from a stream's last ``data:`` event that carries it (the usage chunk, before ``[DONE]``)."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data:") and b'"cached_tokens"' in line:
            return _reused(line[5:].strip())
    return None


def _cached(answer: Any) -> int | None:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if type(value) is int and value >= 0 else None


def _name(result: Decision, worker: tuple[int, int] | None = None) -> str:
    worker_id, rank = result.selection.worker if worker is None else worker
    return f"{worker_id}:{rank}"


def _transfer_params(answer: bytes) -> dict[str, Any] | None:
    """A prefill hop's ``kv_transfer_params``: where the decode worker pulls the KV; None when absent."""
    try:
        params = orjson.loads(answer).get("kv_transfer_params")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return params if isinstance(params, dict) and params.get("do_remote_prefill") is True else None
