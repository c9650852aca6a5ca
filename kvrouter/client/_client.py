"""``Client``: the service's HTTP API (``docs/http-api.md``) as one asyncio method per route, over aiohttp.

Thin on purpose: a typed method builds the route's JSON body from keyword arguments named as its fields
(a ``None`` argument is left out, so the service's own default applies), sends it through
:meth:`Client.request`, and returns the parsed answer as the ``TypedDict`` of ``_answers.py``. Everything
a caller handles goes through :meth:`~Client.request`'s two exits: an answer outside 2xx raises
:class:`~kvrouter.errors.ApiError` (status, the ``{"error": ...}`` message, ``Retry-After``), and no answer
at all raises :class:`~kvrouter.errors.ServiceUnreachable`, aiohttp's own errors mapped at that one
boundary (STYLE.md §5). aiohttp keeps the connections alive between calls (one pool per client), which is
most of what a client costs per call against a local router.

Rejected: retrying inside the client. Whether a refused or timed-out write may be sent again is the
caller's to know (a ``/select_and_reserve`` that timed out may have booked), and a drill counting failures
must see each one; ``ApiError.retry_after`` says when the service asked for a retry.

A :class:`Client` belongs to the event loop it first sends on (its connections do); threads and scripts
without a loop use :class:`~kvrouter.client.SyncClient`.
"""

from __future__ import annotations

import email.utils
import enum
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Literal, cast
from urllib.parse import quote

import aiohttp
import orjson

from ..errors import ApiError, ServiceUnreachable
from ._answers import (
    BusyThresholds,
    DecisionDetail,
    Decisions,
    DumpPartition,
    Events,
    Health,
    PartitionLoads,
    QueryAnswer,
    Ready,
    Selection,
    Status,
    Thresholds,
    Unregistered,
    Worker,
)

__all__ = [
    "DEFAULT_CONNECTIONS",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_URL",
    "KEEP",
    "Client",
    "CompletionStream",
    "Keep",
    "Response",
]

log = logging.getLogger(__name__)

DEFAULT_URL: Final = "http://127.0.0.1:8490"
"""Where ``kvrouter up`` listens unless told otherwise (``--host``, ``--port``)."""
DEFAULT_TIMEOUT_S: Final = 30.0
"""Seconds a call may take, its whole answer read (a streamed completion's too); the service's own waits
(the router queue, 60 s by default) can be longer: raise it for those."""
DEFAULT_CONNECTIONS: Final = 100
"""Connections a client keeps open at most: aiohttp's own default pool limit."""
MESSAGE_CHARS: Final = 300
"""How much of a non-JSON error body an ``ApiError`` message keeps."""
SESSION_HEADER: Final = "X-Dynamo-Session-ID"
"""The reference's session header, read by the proxy (``docs/http-api.md``, "Session affinity")."""

Format = Literal["vllm", "sglang", "kvrouter"]
Transport = Literal["zmq", "nats"]
Role = Literal["prefill", "decode", "both"]
Prompt = Sequence[int] | str | Sequence[Sequence[int]] | Sequence[str]


class Keep(enum.Enum):
    """The type of :data:`KEEP`."""

    KEEP = "keep"


KEEP: Final = Keep.KEEP
"""``set_busy_threshold``'s "leave this threshold as it is" (``None`` there means: no threshold)."""


@dataclass(frozen=True, slots=True)
class Response:
    """A 2xx answer of :meth:`Client.request`: ``body`` is the parsed JSON, the text of a non-JSON answer
    (``/metrics``), or None when empty."""

    status: int
    headers: Mapping[str, str]
    body: Any


def _drop_none(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not None}


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds from now: delta-seconds or an HTTP date (RFC 9110 §10.2.3); None if absent
    or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _message(body: Any, raw: bytes, reason: str | None) -> str:
    """The refusal's text: the service's ``{"error": "..."}``, an engine's ``{"error": {"message": ...}}``
    passed through the proxy, else the start of the body, else the reason phrase."""
    if isinstance(body, dict) and "error" in body:
        error = body["error"]
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        return error if isinstance(error, str) else orjson.dumps(error).decode()
    text = raw[:MESSAGE_CHARS].decode(errors="replace").strip()
    return text or reason or "no message"


def _parse(raw: bytes, content_type: str) -> Any:
    """JSON when the answer says so (or looks like it), else text; None when empty.

    Raises:
        ValueError: JSON that does not parse.
    """
    if not raw:
        return None
    if "json" in content_type or (not content_type and raw[:1] in (b"{", b"[")):
        return orjson.loads(raw)
    return raw.decode(errors="replace")


class Client:
    """The service's HTTP API, one coroutine per route (see the module docstring).

    Use as ``async with Client(url) as c: await c.workers()``; or call methods on it and :meth:`aclose` it
    at the end. Every method raises :class:`~kvrouter.errors.ApiError` for an answer outside 2xx (``ready``
    excepted: not ready is an answer there) and :class:`~kvrouter.errors.ServiceUnreachable` when there is
    no answer.

    Args:
        url: the service's base URL, e.g. ``http://127.0.0.1:8490`` (a path prefix is kept).
        token: the bearer token of a service started with one (``auth_token``); sent on every request.
        timeout: seconds per call, whole answer included; None waits for ever.
        connections: connections kept open at most (aiohttp's pool limit); more calls at once wait.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        connections: int = DEFAULT_CONNECTIONS,
    ) -> None:
        self.url = url.rstrip("/")
        self._headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the kept-alive connections; a later call opens new ones."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _open_session(self) -> aiohttp.ClientSession:
        """The session, made on first use: aiohttp ties it to the running loop."""
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._connections)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, headers=self._headers)
        return self._session

    # -- the low level ----------------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Mapping[str, str | int] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Response:
        """One call of any route: what the typed methods do not cover, or a service newer than them.

        Args:
            method: ``GET``, ``POST``, ``DELETE``...
            path: the route with its leading slash, e.g. ``/decisions/abc``; appended to the base URL.
            body: sent as JSON (numpy arrays too) when not None.
            params: the query string.
            headers: more headers for this call.
            timeout: this call's timeout in seconds instead of the client's.

        Returns:
            The 2xx answer.

        Raises:
            ApiError: any other status, or a JSON answer that does not parse.
            ServiceUnreachable: no answer (refused, reset, timed out).
        """
        request = f"{method} {path}"
        async with self._send(method, path, body, params, headers, timeout) as response:
            try:
                raw = await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise self._unreachable(request, exc) from exc
        return self._answer(request, response, raw)

    def _send(
        self,
        method: str,
        path: str,
        body: Any,
        params: Mapping[str, str | int] | None,
        headers: Mapping[str, str] | None,
        timeout: float | None,
    ) -> _Sending:
        data = None if body is None else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        sent = dict(headers or {})
        if data is not None:
            sent["Content-Type"] = "application/json"
        return _Sending(self, method, path, data, params, sent, timeout)

    def _unreachable(self, request: str, exc: BaseException) -> ServiceUnreachable:
        cause = str(exc) or type(exc).__name__
        if isinstance(exc, TimeoutError):
            cause = f"no whole answer within the timeout ({type(exc).__name__})"
        return ServiceUnreachable(f"{cause} ({request} to {self.url})")

    def _answer(self, request: str, response: aiohttp.ClientResponse, raw: bytes) -> Response:
        """The parsed answer, or the ``ApiError`` it stands for."""
        try:
            body = _parse(raw, response.content_type if response.headers.get("Content-Type") else "")
        except ValueError as exc:
            if response.ok:
                raise ApiError(
                    response.status, f"the answer is not JSON: {exc}", headers=response.headers, request=request
                ) from exc
            body = raw.decode(errors="replace")
        if not response.ok:
            raise ApiError(
                response.status,
                _message(body, raw, response.reason),
                retry_after=_retry_after(response.headers.get("Retry-After")),
                body=body,
                headers=response.headers,
                request=request,
            )
        return Response(response.status, response.headers, body)

    async def _json(
        self, method: str, path: str, body: Any = None, *, params: Mapping[str, str | int] | None = None
    ) -> Any:
        return (await self.request(method, path, body, params=params)).body

    # -- liveness and the registry -----------------------------------------------------------------------

    async def health(self) -> Health:
        """``GET /health``: the process serves (even while its index starts)."""
        answer: Health = await self._json("GET", "/health")
        return answer

    async def ready(self) -> Ready:
        """``GET /ready``, ready or not: ``answer["ready"]``, and ``answer["reasons"]`` when not. The
        service's 503 for "not ready" comes back as an answer here, not as an ``ApiError``: a caller
        polling for readiness reads the reasons, it does not catch them."""
        try:
            answer: Ready = await self._json("GET", "/ready")
        except ApiError as exc:
            if exc.status == 503 and isinstance(exc.body, dict) and "ready" in exc.body:
                return cast(Ready, exc.body)  # /ready's own shape, known by its key
            raise
        return answer

    async def register(
        self,
        instance_id: int,
        endpoint: str | None = None,
        *,
        model_name: str | None = None,
        block_size: int | None = None,
        dp_rank: int | None = None,
        routing_group: str | None = None,
        replay_endpoint: str | None = None,
        format: Format | None = None,
        topic: str | None = None,
        query_endpoint: str | None = None,
        http_endpoint: str | None = None,
        total_kv_blocks: int | None = None,
        transport: Transport | None = None,
        role: Role | None = None,
        topology_domain: str | None = None,
        lora_adapters: Sequence[str] | None = None,
    ) -> Status:
        """``POST /register``: one (instance, dp rank) joins; the first of a partition fixes its block size.

        ``endpoint`` is the rank's KV-event PUB (``tcp://host:port``); ``http_endpoint`` what ``/select``
        returns and what the proxy forwards to; ``role`` the hops it takes (``both`` when not given), the
        same for every rank, as are ``lora_adapters``, the LoRA adapters it serves. Other fields as
        ``docs/http-api.md`` lists them.

        Raises:
            ApiError: 409 a rank already registered elsewhere or a block-size mismatch, 400 a bad field.
        """
        body = _drop_none(
            {
                "instance_id": instance_id,
                "endpoint": endpoint,
                "model_name": model_name,
                "block_size": block_size,
                "dp_rank": dp_rank,
                "routing_group": routing_group,
                "replay_endpoint": replay_endpoint,
                "format": format,
                "topic": topic,
                "query_endpoint": query_endpoint,
                "http_endpoint": http_endpoint,
                "total_kv_blocks": total_kv_blocks,
                "transport": transport,
                "role": role,
                "topology_domain": topology_domain,
                "lora_adapters": None if lora_adapters is None else list(lora_adapters),
            }
        )
        answer: Status = await self._json("POST", "/register", body)
        return answer

    async def unregister(
        self,
        instance_id: int,
        model_name: str | None = None,
        *,
        routing_group: str | None = None,
        dp_rank: int | None = None,
    ) -> Unregistered:
        """``POST /unregister``: every group of the model unless ``routing_group``, every rank unless ``dp_rank``.

        Raises:
            ApiError: 404 when nothing matched.
        """
        body = _drop_none(
            {"instance_id": instance_id, "model_name": model_name, "routing_group": routing_group, "dp_rank": dp_rank}
        )
        answer: Unregistered = await self._json("POST", "/unregister", body)
        return answer

    async def workers(self, model_name: str | None = None, routing_group: str | None = None) -> list[Worker]:
        """``GET /workers``: every registered instance (of the model and group, when given) with its streams."""
        params = _drop_none({"model_name": model_name, "routing_group": routing_group})
        answer: list[Worker] = await self._json("GET", "/workers", params=params)
        return answer

    # -- the index and decisions -------------------------------------------------------------------------

    async def query(
        self,
        model_name: str,
        token_ids: Sequence[int],
        *,
        routing_group: str | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> QueryAnswer:
        """``POST /query``: which workers hold how much of a prompt, in matched tokens.

        Raises:
            ApiError: 404 unknown model or group, 400 a token id outside u32.
        """
        body = _drop_none(
            {
                "model_name": model_name,
                "token_ids": token_ids,
                "routing_group": routing_group,
                "lora_name": lora_name,
                "cache_salt": cache_salt,
            }
        )
        answer: QueryAnswer = await self._json("POST", "/query", body)
        return answer

    async def query_by_hash(
        self,
        model_name: str,
        block_hashes: Sequence[int],
        *,
        routing_group: str | None = None,
        lora_name: str | None = None,
    ) -> QueryAnswer:
        """``POST /query_by_hash``: as :meth:`query`, the prompt given as Dynamo's local block hashes
        (``kvrouter.block_hashes``), not the engine's."""
        body = _drop_none(
            {
                "model_name": model_name,
                "block_hashes": block_hashes,
                "routing_group": routing_group,
                "lora_name": lora_name,
            }
        )
        answer: QueryAnswer = await self._json("POST", "/query_by_hash", body)
        return answer

    async def select(
        self,
        model_name: str,
        *,
        token_ids: Sequence[int] | None = None,
        block_hashes: Sequence[int] | None = None,
        sequence_hashes: Sequence[int] | None = None,
        isl_tokens: int | None = None,
        routing_group: str | None = None,
        selection_id: str | None = None,
        session_id: str | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        explain: bool = False,
        fallbacks: int = 0,
        probe: bool = False,
    ) -> Selection:
        """``POST /select``: where a prompt should go; nothing is booked.

        Give the prompt as ``token_ids`` or as ``block_hashes`` (then ``isl_tokens``, its length in tokens).
        ``explain`` adds every candidate's cost terms, ``fallbacks`` the next-best workers, ``probe`` explains
        without counting the decision anywhere (``kvrouter top``'s pinned prompt).

        Raises:
            ApiError: 404 unknown model or group, 503 no schedulable worker, 529 (or 429) every worker busy.
        """
        body = self._select_body(
            model_name, token_ids, block_hashes, sequence_hashes, isl_tokens, routing_group, selection_id,
            session_id, lora_name, cache_salt, explain, fallbacks,
        )  # fmt: skip
        if probe:
            body["probe"] = True
        answer: Selection = await self._json("POST", "/select", body)
        return answer

    async def select_and_reserve(
        self,
        model_name: str,
        *,
        token_ids: Sequence[int] | None = None,
        block_hashes: Sequence[int] | None = None,
        sequence_hashes: Sequence[int] | None = None,
        isl_tokens: int | None = None,
        routing_group: str | None = None,
        selection_id: str | None = None,
        session_id: str | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        explain: bool = False,
        fallbacks: int = 0,
    ) -> Selection:
        """``POST /select_and_reserve`` (``/route``): as :meth:`select`, and the request is booked on the chosen
        worker until :meth:`free` (or 300 s). The answer's ``selection_id`` (yours, or a generated one) names
        the reservation: call :meth:`prefill_complete` at the first token, :meth:`free` at the end.

        Raises:
            ApiError: as :meth:`select`; 409 a ``selection_id`` already booked.
        """
        body = self._select_body(
            model_name, token_ids, block_hashes, sequence_hashes, isl_tokens, routing_group, selection_id,
            session_id, lora_name, cache_salt, explain, fallbacks,
        )  # fmt: skip
        answer: Selection = await self._json("POST", "/select_and_reserve", body)
        return answer

    @staticmethod
    def _select_body(
        model_name: str,
        token_ids: Sequence[int] | None,
        block_hashes: Sequence[int] | None,
        sequence_hashes: Sequence[int] | None,
        isl_tokens: int | None,
        routing_group: str | None,
        selection_id: str | None,
        session_id: str | None,
        lora_name: str | None,
        cache_salt: str | None,
        explain: bool,
        fallbacks: int,
    ) -> dict[str, Any]:
        body = _drop_none(
            {
                "model_name": model_name,
                "token_ids": token_ids,
                "block_hashes": block_hashes,
                "sequence_hashes": sequence_hashes,
                "isl_tokens": isl_tokens,
                "routing_group": routing_group,
                "selection_id": selection_id,
                "session_id": session_id,
                "lora_name": lora_name,
                "cache_salt": cache_salt,
            }
        )
        if explain:
            body["explain"] = True
        if fallbacks:
            body["fallbacks"] = fallbacks
        return body

    async def prefill_complete(self, selection_id: str, *, cached_tokens: int | None = None) -> Status:
        """``POST /reservations/{id}/prefill_complete``: the reservation's prompt stops counting as queued
        prefill. ``cached_tokens``, the prompt tokens the engine reused, feeds the index-accuracy figures.

        Raises:
            ApiError: 404 unknown reservation (never booked, freed, or expired).
        """
        body = _drop_none({"cached_tokens": cached_tokens})
        path = f"/reservations/{quote(selection_id, safe='')}/prefill_complete"
        answer: Status = await self._json("POST", path, body)
        return answer

    async def free(self, selection_id: str) -> Status:
        """``DELETE /reservations/{id}``: the reservation's load is taken back.

        Raises:
            ApiError: 404 unknown reservation.
        """
        answer: Status = await self._json("DELETE", f"/reservations/{quote(selection_id, safe='')}")
        return answer

    async def loads(self) -> list[PartitionLoads]:
        """``GET /loads``: every worker's booked load, per partition, with its router queue."""
        answer: list[PartitionLoads] = await self._json("GET", "/loads")
        return answer

    async def dump(self) -> dict[str, DumpPartition]:
        """``GET /dump``: per partition, its block size and (approximate mode only) its blocks as events."""
        answer: dict[str, DumpPartition] = await self._json("GET", "/dump")
        return answer

    async def busy_threshold(self) -> BusyThresholds:
        """``GET /busy_threshold``: every partition's busy thresholds."""
        answer: BusyThresholds = await self._json("GET", "/busy_threshold")
        return answer

    async def set_busy_threshold(
        self,
        model_name: str,
        *,
        routing_group: str | None = None,
        active_decode_blocks_threshold: float | Keep | None = KEEP,
        active_prefill_tokens_threshold: int | Keep | None = KEEP,
    ) -> Thresholds:
        """``POST /busy_threshold``: change a partition's thresholds at run time (``None`` removes one,
        :data:`KEEP` leaves it); the next decision uses them, booked load is kept.

        Returns:
            The partition's thresholds after the change.

        Raises:
            ApiError: 404 unknown partition, 400 a negative threshold.
        """
        body: dict[str, Any] = _drop_none({"model_name": model_name, "routing_group": routing_group})
        if active_decode_blocks_threshold is not KEEP:
            body["active_decode_blocks_threshold"] = active_decode_blocks_threshold
        if active_prefill_tokens_threshold is not KEEP:
            body["active_prefill_tokens_threshold"] = active_prefill_tokens_threshold
        answer: Thresholds = await self._json("POST", "/busy_threshold", body)
        return answer

    async def decisions(self, since: int = 0) -> Decisions:
        """``GET /decisions?since=N``: the last 1,024 decisions after seq ``since``; pass ``answer["last"]``
        next time. A ``last`` below your ``since`` means the service restarted: start again from 0."""
        answer: Decisions = await self._json("GET", "/decisions", params={"since": since})
        return answer

    async def decision(self, selection_id: str) -> DecisionDetail:
        """``GET /decisions/{selection_id}``: one past decision with every candidate's terms and the runner-up.

        Raises:
            ApiError: 404 when the decision is no longer kept.
        """
        answer: DecisionDetail = await self._json("GET", f"/decisions/{quote(selection_id, safe='')}")
        return answer

    async def events(self, since: int = 0) -> Events:
        """``GET /events?since=N``: the service's event log after seq ``since`` (registrations, gaps, skips...)."""
        answer: Events = await self._json("GET", "/events", params={"since": since})
        return answer

    async def metrics(self) -> str:
        """``GET /metrics``: the Prometheus text exposition."""
        response = await self.request("GET", "/metrics")
        if not isinstance(response.body, str):
            raise ApiError(response.status, "expected Prometheus text, got JSON", request="GET /metrics")
        return response.body

    # -- the proxy ---------------------------------------------------------------------------------------

    async def completions(
        self,
        prompt: Prompt,
        /,
        *,
        model: str | None = None,
        max_tokens: int | None = None,
        session_id: str | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """``POST /v1/completions`` through the router's proxy: it chooses the worker, books and frees the
        request, and returns the engine's answer (OpenAI's completion object) as it came.

        Args:
            prompt: token ids (or a list holding one such list); text only with the service's ``--tokenizer``.
            model: the partition's model (default: the service's ``--model-name``).
            max_tokens: tokens to generate.
            session_id: sent as ``X-Dynamo-Session-ID`` (session affinity).
            fields: any other OpenAI field, passed on to the engine (not ``stream``: see
                :meth:`stream_completions`).

        Raises:
            ApiError: the router's refusal (404, 503, 529) or the engine's error, with its message.
        """
        if "stream" in fields:
            raise TypeError("completions() does not stream; use stream_completions()")
        body, headers = _openai(session_id, fields, model=model, prompt=prompt, max_tokens=max_tokens)
        answer: dict[str, Any] = (await self.request("POST", "/v1/completions", body, headers=headers)).body
        return answer

    def stream_completions(
        self,
        prompt: Prompt,
        /,
        *,
        model: str | None = None,
        max_tokens: int | None = None,
        session_id: str | None = None,
        **fields: Any,
    ) -> CompletionStream:
        """``POST /v1/completions`` with ``"stream": true``: the engine's Server-Sent Events as they come.

        Use as ``async with c.stream_completions(prompt, max_tokens=8) as stream: async for chunk in stream``.
        Each item is one ``data:`` payload, parsed (``[DONE]`` ends the iteration); ``stream.worker`` names
        the engine (``X-Kvrouter-Worker``). Leaving the block early closes the connection, and the router
        frees the request. Arguments as :meth:`completions`.
        """
        body, headers = _openai(
            session_id, {**fields, "stream": True}, model=model, prompt=prompt, max_tokens=max_tokens
        )
        return CompletionStream(self._send("POST", "/v1/completions", body, None, headers, None), self)

    async def chat_completions(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        model: str,
        max_tokens: int | None = None,
        session_id: str | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """``POST /v1/chat/completions``: the router renders the messages with the model's template to route
        them, books the request, and returns the engine's ``chat.completion`` as it came. Arguments as
        :meth:`completions`, with OpenAI's ``messages`` in place of the prompt.

        Raises:
            ApiError: the router's refusal (400 in OpenAI's shape for bad messages or an unknown model, 503,
                529) or the engine's error, with its message.
        """
        if "stream" in fields:
            raise TypeError("chat_completions() does not stream; use stream_chat_completions()")
        body, headers = _openai(session_id, fields, model=model, messages=list(messages), max_tokens=max_tokens)
        answer: dict[str, Any] = (await self.request("POST", "/v1/chat/completions", body, headers=headers)).body
        return answer

    def stream_chat_completions(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        model: str,
        max_tokens: int | None = None,
        session_id: str | None = None,
        **fields: Any,
    ) -> CompletionStream:
        """``POST /v1/chat/completions`` with ``"stream": true``: the engine's ``chat.completion.chunk`` events,
        used as :meth:`stream_completions`."""
        body, headers = _openai(
            session_id, {**fields, "stream": True}, model=model, messages=list(messages), max_tokens=max_tokens
        )
        return CompletionStream(self._send("POST", "/v1/chat/completions", body, None, headers, None), self)

    async def models(self) -> list[dict[str, Any]]:
        """``GET /v1/models``: the models workers are registered for, OpenAI's model objects."""
        data: list[dict[str, Any]] = (await self.request("GET", "/v1/models")).body["data"]
        return data


def _openai(session_id: str | None, fields: Mapping[str, Any], **named: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """An OpenAI request's body (``fields``, then the ``named`` ones given) and its session header."""
    body = {**fields, **_drop_none(named)}
    return body, {} if session_id is None else {SESSION_HEADER: session_id}


class _Sending:
    """One request in flight: ``async with`` gives aiohttp's response (any status), errors of the sending
    mapped to ``ServiceUnreachable``; leaving closes the connection unless the answer was read to its end."""

    def __init__(
        self,
        client: Client,
        method: str,
        path: str,
        data: bytes | None,
        params: Mapping[str, str | int] | None,
        headers: Mapping[str, str],
        timeout: float | None,
    ) -> None:
        self.client = client
        self.method = method
        self.path = path
        self.request = f"{method} {path}"
        self._args: dict[str, Any] = {"data": data, "params": params, "headers": headers}
        if timeout is not None:
            self._args["timeout"] = aiohttp.ClientTimeout(total=timeout)
        self._response: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> aiohttp.ClientResponse:
        session = self.client._open_session()
        try:
            self._response = await session.request(self.method, self.client.url + self.path, **self._args)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self.client._unreachable(self.request, exc) from exc
        return self._response

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        response = self._response
        if response is None:
            return
        if response.content.at_eof():
            response.release()
        else:
            response.close()  # an answer left unread: this connection cannot carry another request


class CompletionStream:
    """An open streamed completion (:meth:`Client.stream_completions`): iterate it inside ``async with``.

    Raises (entering):
        ApiError: the router or the engine refused (before any event was sent).
    Raises (iterating):
        ServiceUnreachable: the connection broke or the timeout passed mid-stream.
        ApiError: a ``data:`` payload that is not JSON.
    """

    def __init__(self, sending: _Sending, client: Client) -> None:
        self._sending = sending
        self._client = client
        self._response: aiohttp.ClientResponse | None = None
        self.headers: Mapping[str, str] = {}
        """The answer's headers, once entered."""

    @property
    def worker(self) -> str:
        """``id:rank`` of the engine the router chose (``X-Kvrouter-Worker``); empty before entering."""
        return self.headers.get("X-Kvrouter-Worker", "")

    @property
    def selection_id(self) -> str:
        """The router's reservation for this request (``X-Kvrouter-Selection-Id``)."""
        return self.headers.get("X-Kvrouter-Selection-Id", "")

    @property
    def overlap_tokens(self) -> int:
        """The prompt tokens the router found cached on the chosen worker (``X-Kvrouter-Overlap-Tokens``): what
        it predicts the engine reports as ``cached_tokens``; 0 before entering."""
        return int(self.headers.get("X-Kvrouter-Overlap-Tokens", 0))

    async def __aenter__(self) -> CompletionStream:
        response = await self._sending.__aenter__()
        self._response = response
        self.headers = response.headers
        if not response.ok:
            request = self._sending.request
            try:
                try:
                    raw = await response.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise self._client._unreachable(request, exc) from exc
                self._client._answer(request, response, raw)  # raises the ApiError it stands for
            finally:
                await self._sending.__aexit__(None, None, None)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._sending.__aexit__(kind, exc, tb)

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._payloads()

    async def _payloads(self) -> AsyncIterator[dict[str, Any]]:
        """The ``data:`` payloads, parsed; an ``{"error": ...}`` event (the engine failed mid-stream, or the
        proxy lost it) is yielded like the others: the stream's status was 200 already. Read to the end
        after ``[DONE]``, so the connection is left clean."""
        response = self._response
        if response is None:
            raise RuntimeError("iterate a CompletionStream inside `async with`")
        request = self._sending.request
        try:
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    continue
                try:
                    chunk = orjson.loads(payload)
                except orjson.JSONDecodeError as exc:
                    raise ApiError(
                        response.status,
                        f"a streamed payload is not JSON: {payload[:MESSAGE_CHARS]!r}",
                        headers=response.headers,
                        request=request,
                    ) from exc
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._client._unreachable(request, exc) from exc
