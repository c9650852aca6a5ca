"""``Gate``: what every edge does around the core, written once: admission, the token, statuses, counting.

The HTTP routes (``routes.py``), the hot lane (``lane.py``) and the ZMQ fast path (``fastpath.py``) each
parse their own framing, then pass through the same gate:

- **Admission.** While the service stops, every route but ``/health``, ``/ready`` and ``/metrics`` is
  refused (:class:`Stopping`); while the index starts, the core refuses the routes that need it
  (:class:`Starting`, with ``Retry-After``), and everything else answers with what it knows.
- **The bearer token.** With ``auth_token`` set, a write (``POST``, ``DELETE``, ... except the read-only
  ``OPEN_ROUTES``) needs it, compared in constant time.
- **Statuses.** The core raises typed refusals (``kvrouter/errors.py``) and never picks a status:
  :func:`status` maps each class to its HTTP status here, the one place that does (the fast path puts the
  same number in its reply). An engine not up is a 503, other bad input a 400, anything unexpected a 500
  logged with its traceback.
- **Counting.** Every answered request goes into the per-route counters ``/metrics`` shows.
- **OpenAI's error shape** on the routes OpenAI's clients call (:data:`OPENAI_ROUTES`):
  ``{"error": {"message", "type", "param", "code"}}``, the type named from the status (:func:`openai_error`);
  every other route keeps ``{"error": message}``.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Final

from ...errors import (
    BadRequest,
    ClientGone,
    Conflict,
    EngineError,
    KvRouterError,
    NotFound,
    Overloaded,
    ServiceError,
    Starting,
    TooLarge,
    Unauthorized,
    Unavailable,
    UpstreamFailed,
)
from ..core.config import ServiceConfig
from ..core.counters import ServiceCounters
from ..core.lifecycle import Lifecycle

__all__ = [
    "ALWAYS_SERVED",
    "CHAT_ROUTE",
    "FRONT_HEADER",
    "MODELS_ROUTE",
    "OPENAI_ROUTES",
    "OPEN_ROUTES",
    "UNAUTHORIZED",
    "Gate",
    "Refusal",
    "openai_error",
    "status",
]

log = logging.getLogger(__name__)

CHAT_ROUTE: Final = "/v1/chat/completions"
MODELS_ROUTE: Final = "/v1/models"
OPENAI_ROUTES: Final = frozenset({CHAT_ROUTE, MODELS_ROUTE})
"""Routes whose errors take OpenAI's shape (``/v1/completions`` keeps kvrouter's, as it always answered)."""

_OPENAI_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    529: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable_error",
}

OPEN_ROUTES: Final = frozenset({"/query", "/query_by_hash", "/select"})
"""POST routes that only read (no state changes): open even with an auth token. Every other POST and
DELETE is a write and needs the bearer token when one is set."""
ALWAYS_SERVED: Final = frozenset({"/health", "/ready", "/metrics"})
"""Routes still answered while the service stops."""
UNAUTHORIZED: Final = "missing or wrong bearer token"
FRONT_HEADER: Final = "X-Kvrouter-Front"
"""Which front of ``kvrouter up --fronts N`` answered (every answer carries it then)."""
_STATUSES: Final[tuple[tuple[type[ServiceError], int], ...]] = (
    (BadRequest, 400),
    (Unauthorized, 401),
    (NotFound, 404),
    (Conflict, 409),
    (TooLarge, 413),
    (ClientGone, 499),
    (UpstreamFailed, 502),
    (Unavailable, 503),
)
"""Each refusal's HTTP status; :class:`Overloaded` takes the service's ``overload_status`` (529 or 429)."""


class Refusal:
    """One refused request as an edge answers it: the status, the message, the extra headers."""

    __slots__ = ("headers", "message", "param", "status")

    def __init__(
        self, status: int, message: str, headers: dict[str, str] | None = None, *, param: str | None = None
    ) -> None:
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.param = param
        """The request field at fault, when the refusal names one (OpenAI's error shape has it apart)."""


def openai_error(status: int, message: str, param: str | None = None) -> dict[str, object]:
    """OpenAI's error body for a refusal of ``status``."""
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def status(exc: ServiceError, overload_status: int) -> int:
    """The HTTP status of a refusal (500 for the base class: a failure nobody named)."""
    if isinstance(exc, Overloaded):
        return overload_status
    for klass, code in _STATUSES:
        if isinstance(exc, klass):
            return code
    return 500


class Gate:
    """The admission, token, status and counting rules of one service's edges."""

    def __init__(self, config: ServiceConfig, lifecycle: Lifecycle, counters: ServiceCounters) -> None:
        self.config = config
        self.lifecycle = lifecycle
        self.counters = counters
        self._token = None if config.auth_token is None else config.auth_token.encode()
        self._logged: set[tuple[str, str]] = set()
        """(route, kind) of the failures logged: each is logged once with its traceback, then counted."""

    def admit(self, route: str) -> None:
        """Raise :class:`Stopping` for a route the stopping service no longer answers."""
        if route not in ALWAYS_SERVED:
            self.lifecycle.require_open()

    def needs_token(self, method: str, route: str) -> bool:
        """Whether a request to ``route`` must carry the bearer token: a write, with a token set."""
        return self._token is not None and method in ("POST", "DELETE", "PUT", "PATCH") and route not in OPEN_ROUTES

    def token_ok(self, token: str | None) -> bool:
        """``token`` is the service's, compared in constant time (True when none is set)."""
        if self._token is None:
            return True
        return token is not None and hmac.compare_digest(token.encode(), self._token)

    def bearer_ok(self, authorization: str) -> bool:
        """``authorization`` (the header's value) carries the service's token."""
        scheme, _, value = authorization.partition(" ")
        return scheme.lower() == "bearer" and self.token_ok(value.strip())

    def authorize(self, method: str, route: str, authorization: str) -> None:
        """Raise :class:`Unauthorized` for a write without the token."""
        if self.needs_token(method, route) and not self.bearer_ok(authorization):
            raise Unauthorized(UNAUTHORIZED)

    def refusal(self, exc: BaseException, route: str) -> Refusal:
        """How an edge answers a request that raised ``exc``."""
        if isinstance(exc, ServiceError):
            code = status(exc, self.config.overload_status)
            if code == 500:
                self._log_once(route, exc)
            if isinstance(exc, Starting):
                return Refusal(code, str(exc), {"Retry-After": str(exc.retry_after)})
            if isinstance(exc, Unauthorized):
                return Refusal(code, str(exc), {"WWW-Authenticate": "Bearer"})
            return Refusal(code, str(exc), param=exc.param if isinstance(exc, BadRequest) else None)
        if isinstance(exc, EngineError):  # not up yet, or closing
            return Refusal(503, f"engine: {exc}")
        if isinstance(exc, (KvRouterError, ValueError)):
            return Refusal(400, str(exc))
        self._log_once(route, exc)
        return Refusal(500, f"internal error ({type(exc).__name__})")

    def _log_once(self, route: str, exc: BaseException) -> None:
        key = (route, type(exc).__name__)
        if key not in self._logged:
            self._logged.add(key)
            log.error("request failed route=%s kind=%s (logged once per kind, then counted)", *key, exc_info=exc)

    def count(self, route: str, method: str, code: int, started: float) -> None:
        """One answered request in the per-route counters ``/metrics`` shows."""
        counters = self.counters
        key = (route, method)
        counters.http_requests[key] = counters.http_requests.get(key, 0) + 1
        counters.http_seconds[key] = counters.http_seconds.get(key, 0.0) + time.perf_counter() - started
        if code >= 400:
            klass = (route, "4xx" if code < 500 else "5xx")
            counters.http_errors[klass] = counters.http_errors.get(klass, 0) + 1
