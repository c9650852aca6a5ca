"""The mock engine's HTTP front: OpenAI-shaped completions plus the control routes tests and drills use.

Standard library only (``http.server.ThreadingHTTPServer``, one thread per connection): the mock
serves tests and drills, a few hundred requests a second at most, and a web framework would be a new
dependency for no measured gain. Handlers never touch the model: they validate, queue a command on
the rank's engine thread (:class:`~kvrouter.worker.mock_engine.MockEngine`) and wait for its answer.

| route | body | answer |
|---|---|---|
| ``POST /v1/completions`` | ``{"prompt", "max_tokens", "stream", "stream_options", "dp_rank"}`` | (*) |
| ``GET /cache`` | | per rank: ``last_seq`` (vllm) or ``last_event_id`` (kvrouter), ``held_batches``, ``blocks`` |
| ``POST /overlap`` | ``{"prompts": [[token ids], ...]}`` | per rank: ``last_seq`` / ``last_event_id``, ``overlaps`` |
| ``POST /faults`` | ``{"drop_batches": n, "pause": bool, "dp_rank": r}`` | each rank's fault state |
| ``POST /restart`` | ``{}`` or ``{"dp_rank": r}`` | each rank's position after the restart |
| ``GET /health`` | | ``{"status": "ok", ..., "published"}``; 503 ``"failed"`` once an engine thread died |

``published``: per rank, ``last_seq`` / ``last_event_id`` read without the engine thread, so it is cheap to
poll (``kvrouter replay``'s slow-consumer drill watches a burst go out with it). An engine that offers KV
(role ``prefill`` or ``both``) adds ``transfers``: offers waiting, pulls in progress (``serving``), served and cut
(the prefill-kill drill kills it while ``serving`` is above 0).

(*) A ``text_completion``, OpenAI-shaped, with ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens
reused from the cache at admission) and a ``kvrouter`` object: simulated ``ttft_ms`` and ``finish_ms``, ``dp_rank``.

Bad input gets 400 with ``{"error": {"message": ..., "type": "invalid_request_error"}}`` naming the
field, as OpenAI's servers answer; the server carries on. ``stream: true`` sends Server-Sent Events: one
chunk when the first token is out, a last one with ``finish_reason`` and ``usage``, then ``[DONE]``; with
``"stream_options": {"continuous_usage_stats": true}`` (vLLM's) the first chunk carries ``usage`` too.
The mock generates no text (``text`` is empty): its output tokens are synthetic ids, see
``mock_engine.py``.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import time
from array import array
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from ..chat import ChatModel, checked_messages
from ..errors import BadRequest, RequestFailed
from .kv_transfer import TransferFailed, pull
from .mock_engine import Completion, MockEngine, Update

__all__ = ["MAX_BODY_BYTES", "MockHttpServer"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES: Final = 64 << 20
"""Largest request body read: 64 MiB, room for a prompt of several million token ids."""

DEFAULT_MAX_TOKENS: Final = 16
"""OpenAI's completions default for ``max_tokens``."""

CONTROL_TIMEOUT_S: Final = 30.0
"""How long a control route waits for the engine threads (they answer between iterations)."""

_U32: Final = 1 << 32


class _BadRequest(Exception):
    """Input the mock cannot take; becomes a 400 naming the problem."""


class MockHttpServer(ThreadingHTTPServer):
    """The HTTP server of one mock worker; ``serve_forever`` in a thread, ``shutdown`` to stop.

    Args:
        engine: the started mock engine the routes drive.
        host: the address to listen on.
        port: the TCP port; 0 picks a free one (read it back from ``server_address``).
        request_timeout: longest wait for one completion before answering 504.
        chat: the model ``/v1/chat/completions`` renders and tokenizes with; None: no chat route.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        engine: MockEngine,
        host: str,
        port: int,
        *,
        request_timeout: float = 600.0,
        chat: ChatModel | None = None,
    ) -> None:
        self.engine = engine
        self.request_timeout = request_timeout
        self.chat = chat
        self.errors_logged: set[str] = set()
        self.connection_errors = 0
        """Connections that failed outside a route (a client that reset before its request was read)."""
        super().__init__((host, port), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed before a route ran: counted, logged once per kind at info, never the
        standard library's traceback on stderr (clients behind a router reset idle connections as a matter
        of course: the demo's printed a warning a minute into every run)."""
        self.connection_errors += 1
        error = sys.exc_info()[1]
        kind = f"connection:{type(error).__name__}"
        if kind not in self.errors_logged:
            self.errors_logged.add(kind)
            log.info("mock http connection failed client=%s error=%r (logged once per kind)", client_address, error)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: MockHttpServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        """No access log: one line per request is exactly what STYLE §6 rules out."""

    # -- routing --------------------------------------------------------------------------------

    def do_GET(self) -> None:
        routes = {"/health": self._health, "/cache": self._cache}
        self._dispatch(routes, read_body=False)

    def do_POST(self) -> None:
        routes = {
            "/v1/completions": self._completions,
            "/v1/chat/completions": self._chat,
            "/faults": self._faults,
            "/restart": self._restart,
            "/overlap": self._overlap,
        }
        self._dispatch(routes, read_body=True)

    def _dispatch(self, routes: dict[str, Any], *, read_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        try:
            handler = routes.get(path)
            if handler is None:
                known = ", ".join(sorted(routes))
                self._error(404, f"no route {self.command} {path}; this method has {known}", "not_found")
                return
            handler(self._body() if read_body else {})
        except _BadRequest as exc:
            self._error(400, str(exc), "invalid_request_error")
        except RequestFailed as exc:
            self._error(exc.status, str(exc), "engine_error")
        except TimeoutError:
            self._error(504, f"{self.command} {path}: the engine did not answer in time", "timeout")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # one bad request must not end the server
            kind = type(exc).__name__
            if kind not in self.server.errors_logged:
                self.server.errors_logged.add(kind)
                log.exception("mock http handler failed route=%s error=%s (logged once per kind)", path, kind)
            self._error(500, f"{kind}: {exc}", "internal_error")

    def _body(self) -> dict[str, Any]:
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            if self.headers.get("Transfer-Encoding"):
                self.close_connection = True
                raise _BadRequest("chunked bodies are not accepted; send Content-Length")
            return {}
        try:
            length = int(length_header)
        except ValueError:
            self.close_connection = True
            raise _BadRequest(f"Content-Length {length_header!r} is not an integer") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True
            raise _BadRequest(f"body of {length} bytes; at most {MAX_BODY_BYTES} are accepted")
        raw = self.rfile.read(length)
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _BadRequest(f"body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise _BadRequest(f"body must be a JSON object, got {type(body).__name__}")
        return body

    # -- answers --------------------------------------------------------------------------------

    def _json(self, status: int, payload: object) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, kind: str) -> None:
        self._json(status, {"error": {"message": message, "type": kind, "code": status}})

    # -- routes ---------------------------------------------------------------------------------

    def _health(self, _body: dict[str, Any]) -> None:
        engine = self.server.engine
        cfg = engine.config
        failed = engine.failed_ranks()
        self._json(
            503 if failed else 200,
            {
                "status": "failed" if failed else "ok",
                "failed_ranks": failed,
                "worker_id": cfg.worker_id,
                "dp_size": cfg.dp_size,
                "format": cfg.format,
                "published": engine.positions(),
                **({} if engine.transfers is None else {"transfers": engine.transfers.status()}),
            },
        )

    def _cache(self, _body: dict[str, Any]) -> None:
        self._json(200, self.server.engine.cache(CONTROL_TIMEOUT_S))

    def _overlap(self, body: dict[str, Any]) -> None:
        prompts = body.get("prompts")
        if not isinstance(prompts, list):
            raise _BadRequest(f"prompts must be a list of token-id lists, got {_describe(prompts)}")
        parsed = []
        for i, prompt in enumerate(prompts):
            try:
                parsed.append(_prompt(prompt))
            except _BadRequest as exc:
                raise _BadRequest(f"prompts[{i}]: {exc}") from None
        lora, salt = _opt_str(body, "lora_name"), _opt_str(body, "cache_salt")
        self._json(200, {"ranks": self.server.engine.overlaps(parsed, CONTROL_TIMEOUT_S, lora, salt)})

    def _faults(self, body: dict[str, Any]) -> None:
        drop = _opt_int(body, "drop_batches", low=0)
        pause = body.get("pause")
        if pause is not None and not isinstance(pause, bool):
            raise _BadRequest(f"pause must be true or false, got {pause!r}")
        if drop is None and pause is None:
            raise _BadRequest("faults: give drop_batches (an integer >= 0) and/or pause (true/false)")
        ranks = self.server.engine.faults(drop, pause, _opt_int(body, "dp_rank", low=0), CONTROL_TIMEOUT_S)
        self._json(200, {"ranks": ranks})

    def _restart(self, body: dict[str, Any]) -> None:
        ranks = self.server.engine.restart(_opt_int(body, "dp_rank", low=0), CONTROL_TIMEOUT_S)
        self._json(200, {"ranks": ranks})

    def _completions(self, body: dict[str, Any]) -> None:
        self._serve(body, _prompt(body.get("prompt")), _opt_int(body, "max_tokens", low=1), chat=False)

    def _chat(self, body: dict[str, Any]) -> None:
        """``/v1/chat/completions``: the messages rendered and tokenized with the worker's model (the router
        renders with the same files), then served as a completion of those tokens, in ``chat.completion``
        shape."""
        chat = self.server.chat
        if chat is None:
            raise _BadRequest("this mock worker serves no chat: start it with --model-path")
        max_tokens = _opt_int(body, "max_completion_tokens", low=1) or _opt_int(body, "max_tokens", low=1)
        try:
            ids = chat.prompt_ids(checked_messages(body.get("messages")))
            chat.check_length(len(ids), max_tokens)
        except BadRequest as exc:
            raise _BadRequest(str(exc)) from exc
        self._serve(body, array("I", ids.tobytes()), max_tokens, chat=True)

    def _serve(self, body: dict[str, Any], prompt: array[int], max_tokens: int | None, *, chat: bool) -> None:
        """One completion of ``prompt``, answered whole or streamed, as a completion or a chat completion."""
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _BadRequest(f"stream must be true or false, got {stream!r}")
        engine = self.server.engine
        hop = _hop(body.get("kv_transfer_params"), engine.config.role)
        if hop == "prefill" and stream:
            raise _BadRequest("a prefill hop (kv_transfer_params.do_remote_decode) is answered whole: stream false")
        received = None
        if hop == "decode":
            params = body["kv_transfer_params"]
            try:
                received = pull(
                    str(params.get("remote_host")),
                    int(params.get("remote_port")),
                    str(params.get("remote_request_id")),
                    timeout=self.server.request_timeout,
                )
            except (TypeError, ValueError) as exc:
                raise _BadRequest(f"kv_transfer_params: remote_host, remote_port and remote_request_id: {exc}") from exc
            except TransferFailed as exc:
                raise RequestFailed(str(exc), 502) from exc
        model = body.get("model")
        request = engine.submit(
            prompt,
            DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            _opt_int(body, "dp_rank", low=0),
            received,
            model if model in engine.config.lora_adapters else None,  # any other name is the base model's
            _opt_str(body, "cache_salt") or None,
        )
        ident = f"{'chatcmpl' if chat else 'cmpl'}-mock-{engine.config.worker_id}-{request.dp_rank}-{id(request):x}"
        created = int(time.time())
        if stream:
            options = body.get("stream_options")
            continuous = isinstance(options, dict) and options.get("continuous_usage_stats") is True
            self._stream(request, ident, created, continuous=continuous, chat=chat)
            return
        while (update := self._next(request)) is Update.FIRST_TOKEN:
            pass
        if update is Update.FAILED:
            assert request.error is not None
            raise request.error
        answer = _completion(request, ident, created, engine.config.worker_id, final=True, chat=chat)
        if hop == "prefill":
            answer["kv_transfer_params"] = self._offer(request)
        self._json(200, answer)

    def _offer(self, request: Completion) -> dict[str, Any]:
        """The prefill hop's answer: where the decode engine pulls the prompt's KV (vLLM's NixlConnector's
        ``kv_transfer_params``, with ``remote_request_id`` naming the offer)."""
        engine = self.server.engine
        transfers = engine.transfers
        assert transfers is not None  # a prefill hop needs role prefill or both
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"kvrouter-mock-{engine.config.worker_id}",
            "remote_block_ids": list(request.ids),
            "remote_host": transfers.host,
            "remote_port": transfers.port,
            "remote_request_id": transfers.offer(request.ids, len(request.prompt)),
        }

    def _next(self, request: Completion) -> Update:
        try:
            return request.updates.get(timeout=self.server.request_timeout)
        except queue.Empty:
            raise TimeoutError from None

    def _stream(self, request: Completion, ident: str, created: int, *, continuous: bool, chat: bool) -> None:
        worker = self.server.engine.config.worker_id
        update = self._next(request)
        if update is Update.FAILED:  # before anything was sent: a plain error status
            assert request.error is not None
            raise request.error
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        self._event(_completion(request, ident, created, worker, final=False, usage=continuous, chat=chat, chunk=True))
        update = self._next(request)
        if update is Update.FAILED:
            assert request.error is not None
            self._event({"error": {"message": str(request.error), "type": "engine_error", "code": 503}})
        else:
            self._event(_completion(request, ident, created, worker, final=True, chat=chat, chunk=True))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, payload: object) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()


def _completion(
    request: Completion,
    ident: str,
    created: int,
    worker_id: int,
    *,
    final: bool,
    usage: bool = False,
    chat: bool = False,
    chunk: bool = False,
) -> dict[str, Any]:
    """A ``text_completion`` object (or stream chunk); with ``chat``, a ``chat.completion`` (a
    ``chat.completion.chunk`` with ``chunk``). ``final`` adds the finish reason, usage and finish time;
    ``usage`` adds usage to a first chunk (vLLM's ``stream_options.continuous_usage_stats``), so a gateway
    learns the reused tokens at the first token. A stream's last chunk always carries usage, so its
    ``cached_tokens`` are known."""
    reason = "length" if final else None
    choice: dict[str, Any]
    if chat:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        message = {"role": "assistant", "content": ""}
        choice = {"index": 0, ("delta" if chunk else "message"): message, "logprobs": None, "finish_reason": reason}
    else:
        kind, choice = "text_completion", {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}
    answer: dict[str, Any] = {
        "id": ident,
        "object": kind,
        "created": created,
        "model": "kvrouter-mock",
        "choices": [choice],
        "kvrouter": {"worker_id": worker_id, "dp_rank": request.dp_rank, "ttft_ms": request.ttft_ms},
    }
    if final or usage:
        prompt, produced = len(request.prompt), request.max_tokens if final else 1
        answer["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": produced,
            "total_tokens": prompt + produced,
            "prompt_tokens_details": {"cached_tokens": request.cached_tokens},
        }
        answer["kvrouter"]["finish_ms"] = request.finish_ms
    return answer


def _hop(params: object, role: str) -> str | None:
    """Which hop of a disaggregated request ``kv_transfer_params`` asks for: ``prefill`` (``do_remote_decode``),
    ``decode`` (``do_remote_prefill``) or None (a whole request, which every role serves).

    Raises:
        _BadRequest: not an object, both flags, or a hop this worker's role does not take.
    """
    if params is None:
        return None
    if not isinstance(params, dict):
        raise _BadRequest(f"kv_transfer_params must be an object, got {_describe(params)}")
    prefill, decode = params.get("do_remote_decode") is True, params.get("do_remote_prefill") is True
    if prefill and decode:
        raise _BadRequest("kv_transfer_params: do_remote_decode and do_remote_prefill are both true")
    hop = "prefill" if prefill else "decode" if decode else None
    if hop is not None and role not in (hop, "both"):
        raise _BadRequest(f"this worker's role is {role}: it does not take a {hop} hop")
    return hop


def _opt_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _BadRequest(f"{name} must be a string, got {_describe(value)}")
    return value


def _opt_int(body: dict[str, Any], name: str, *, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _BadRequest(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _prompt(value: object) -> array[int]:
    if not isinstance(value, list) or not value:
        raise _BadRequest(f"prompt must be a non-empty list of token ids, got {_describe(value)}")
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < _U32:
            raise _BadRequest(f"prompt[{i}] must be a token id in [0, 2**32), got {token!r}")
    return array("I", value)


def _describe(value: object) -> str:
    if isinstance(value, list):
        return "an empty list"
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
