"""Every exception kvrouter raises, in one hierarchy.

```
KvRouterError
├── InvalidHashInput         (also a ValueError) token ids outside u32, hashes outside u64, block size < 1
├── EncodeError              (also a ValueError) events that a wire format cannot express
├── DuplicateRequest         a request id the slot tracker already holds
├── ConfigError              (also a ValueError) a setting out of range; names the field
├── NoWorkerAvailable        no candidate worker is eligible (none given, or all busy)
├── ServiceError             a request the service refuses; the subclass says why, the edge picks the status
│   ├── BadRequest           (also a ValueError) a body or field the service cannot take
│   ├── Unauthorized         no bearer token, or the wrong one, on a write
│   ├── TooLarge             a body over the limit
│   ├── NotFound             no such reservation or decision
│   │   └── UnknownPartition no worker registered under that model (or routing group)
│   ├── Conflict             a registration or id that contradicts what is registered or booked
│   ├── Overloaded           every candidate is over a busy threshold (or the router queue is full)
│   ├── Unavailable          nothing can serve it now: no schedulable worker, the engine refused
│   │   ├── Starting         the index is starting; retry after ``retry_after`` seconds
│   │   ├── Stopping         the service is stopping
│   │   └── Backlogged       too many registry writes wait for the index to start
│   ├── UpstreamFailed       the proxy's worker refused, failed or broke off
│   └── ClientGone           the client left while its request waited
├── ApiError                 the service answered a client's request with an error status (``kvrouter.client``)
├── ServiceUnreachable       (also a ConnectionError) no answer from the service: refused, reset, timed out
├── RequestFailed            the mock engine could not serve a completion; ``status`` is its HTTP status
├── EngineError              the shared-memory engine is not running, or could not start
│   └── FlushTimeout         (also a TimeoutError) an applier did not reach a flush in time
├── StatsError               a stats segment that is not one, or whose blob does not decode (``kvrouter top``)
├── BadMessage               (also a ValueError) a replica-sync message or snapshot (NATS) that does not decode
├── RecordingError           a ``--record`` file that is not one, of another version, or cut short
└── EventError               an event could not be applied; ``kind`` names why
    ├── BadEvent             bad_event: the input does not decode into an event
    ├── ParentNotFound       parent_not_found
    ├── BlockNotFound        block_not_found
    └── InvalidBlockSequence invalid_block_sequence
```

``EventError.kind`` equals the error names of the fixtures and of Dynamo's ``KvCacheEventError``
variants, so counters and tests speak one vocabulary. Foreign errors (msgpack, json, zmq) are
mapped to these at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Final

__all__ = [
    "ApiError",
    "Backlogged",
    "BadEvent",
    "BadMessage",
    "BadRequest",
    "BlockNotFound",
    "ClientGone",
    "ConfigError",
    "Conflict",
    "DuplicateRequest",
    "EncodeError",
    "EngineError",
    "EventError",
    "FlushTimeout",
    "InvalidBlockSequence",
    "InvalidHashInput",
    "KvRouterError",
    "NoWorkerAvailable",
    "NotFound",
    "Overloaded",
    "ParentNotFound",
    "RecordingError",
    "RequestFailed",
    "ServiceError",
    "ServiceUnreachable",
    "Starting",
    "StatsError",
    "Stopping",
    "TooLarge",
    "Unauthorized",
    "Unavailable",
    "UnknownPartition",
    "UpstreamFailed",
    "refusal_of",
]


class KvRouterError(Exception):
    """Base class of every error kvrouter raises on purpose; catch it to catch them all."""


class InvalidHashInput(KvRouterError, ValueError):
    """Input the hashing functions cannot take: token ids outside u32 or not integers, local or
    multimodal hashes outside u64, a block size below 1.

    The request cannot be routed by content; the caller should reject it as malformed (HTTP 400).
    """


class EncodeError(KvRouterError, ValueError):
    """A batch cannot be written in the requested wire format: it mixes workers or dp ranks, or an
    engine format needs token ids the blocks do not carry. A programming error on the sending side."""


class ConfigError(KvRouterError, ValueError):
    """A configuration value out of range (a negative weight, a zero TTL). Raised at construction, so a
    router never starts with it; the message names the field."""


class NoWorkerAvailable(KvRouterError):
    """No candidate worker can take the request: none was given, or every one is over a busy threshold.
    The service answers 503 (none) or 529 (all busy) and the client retries later."""


class ServiceError(KvRouterError):
    """The service refuses a request. Each subclass says why, and ``kind`` names it on the wire (the
    fronts of ``kvrouter up --fronts N`` pass refusals on by kind); the core never picks an HTTP status:
    each edge maps the class to its status in one place (``service/edges/gate.py``). The message is the
    ``{"error": ...}`` text, written for an operator."""

    kind: ClassVar[str] = "refused"


class BadRequest(ServiceError, ValueError):
    """A body or field the service cannot take: not JSON, a wrong type, a token id outside u32, an
    unknown format. The message names the field; the client fixes the request (HTTP 400). ``param``, when
    given, is the field's path alone (OpenAI's error shape has it apart)."""

    kind = "bad_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Unauthorized(ServiceError):
    """A write without the service's bearer token, or with another one (HTTP 401)."""

    kind = "unauthorized"


class TooLarge(ServiceError):
    """A body above the service's ``max_body_bytes`` (HTTP 413)."""

    kind = "too_large"


class NotFound(ServiceError):
    """No such reservation (never booked, freed or expired), decision or route (HTTP 404)."""

    kind = "not_found"


class UnknownPartition(NotFound):
    """No worker was ever registered under that model, or that routing group of it (HTTP 404):
    register one, or check the names."""

    kind = "unknown_partition"


class Conflict(ServiceError):
    """The request contradicts what is registered or booked: a rank registered twice, a block size that
    differs from its partition's, an instance id of another partition or format, a ``selection_id``
    already reserved (HTTP 409). Nothing was changed."""

    kind = "conflict"


class Overloaded(ServiceError):
    """Every candidate of the partition is over a busy threshold, or the router queue is full or its
    wait ran out. Answered with the service's ``overload_status`` (529 as the reference, or 429); the
    client retries later."""

    kind = "overloaded"


class Unavailable(ServiceError):
    """Nothing can serve the request now: the partition has no schedulable worker, the engine refused
    a worker, front 0 did not answer a forwarded write (HTTP 503). Retry later."""

    kind = "unavailable"


class Starting(Unavailable):
    """The route needs the index and the index is still starting (a first run compiles its kernels for
    about a minute). Answered 503 with ``Retry-After: retry_after``; registry writes are accepted
    meanwhile."""

    kind = "starting"

    def __init__(self, message: str, retry_after: int = 2) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Stopping(Unavailable):
    """The service is stopping: only ``/health``, ``/ready`` and ``/metrics`` still answer (HTTP 503)."""

    kind = "stopping"


class Backlogged(Unavailable):
    """Too many registry writes already wait for the index to start (a fixed bound); this one was not
    taken (HTTP 503). Retry once ``/ready`` answers."""

    kind = "backlogged"


class UpstreamFailed(ServiceError):
    """The proxy's chosen worker refused the connection twice, failed before answering, or named no
    ``http_endpoint`` (HTTP 502)."""

    kind = "upstream_failed"


class ClientGone(ServiceError):
    """The client closed its connection while its request waited in the router queue: nothing was booked
    for it (HTTP 499, which it never reads)."""

    kind = "client_gone"


def refusal_of(kind: str, message: str) -> ServiceError:
    """The refusal of wire name ``kind`` (:attr:`ServiceError.kind`) with ``message``: how a refusal made in
    another process (front 0, for a write forwarded by another front) is raised again as its own class.
    An unknown kind comes back as the base class."""
    pending: list[type[ServiceError]] = [ServiceError]
    while pending:
        klass = pending.pop()
        if klass.kind == kind:
            return klass(message)
        pending.extend(klass.__subclasses__())
    return ServiceError(message)


class ApiError(KvRouterError):
    """The service answered a request of ``kvrouter.client`` with a status outside 2xx (or a 2xx answer the
    route's shape cannot come from, e.g. HTML where JSON was due). The client side of :class:`ServiceError`:
    ``status`` is the HTTP status, ``message`` the ``{"error": ...}`` text (an engine's OpenAI-style
    ``{"error": {"message": ...}}`` through the proxy too), ``body`` the parsed answer, ``headers`` its
    headers (a proxied request's ``X-Kvrouter-Worker`` names the engine that failed), ``retry_after`` the
    seconds of a ``Retry-After`` header (None without one).

    What to do depends on the status: 400 / 404 / 409 / 413 are the caller's to fix (the message says
    what); 401 wants the service's bearer token (``Client(token=...)``); 503 and 529 (429) are worth
    retrying, after ``retry_after`` seconds when the answer gave them (else after a pause of your own).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        retry_after: float | None = None,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        request: str = "",
    ) -> None:
        super().__init__(f"{request} answered {status}: {message}" if request else f"{status}: {message}")
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.body = body
        self.headers: Mapping[str, str] = headers if headers is not None else {}
        self.request = request
        """``"METHOD /path"`` of the refused request."""


class ServiceUnreachable(KvRouterError, ConnectionError):
    """``kvrouter.client`` got no answer: the connection was refused or reset, the host did not resolve,
    the connection broke mid-answer, or no whole answer came within the client's timeout. The message
    gives the cause first, then the request. Nothing says whether a write that was sent took effect:
    before retrying one, read the state back (``/workers``, ``/loads``). A ``ConnectionError`` too, so
    code that already catches ``OSError`` around network calls keeps working."""


class DuplicateRequest(KvRouterError):
    """A request id is added to the slot tracker while a request of that id is still active. Nothing
    is changed: the first request keeps its worker and its load. Free the old id first, or give each
    request a unique id."""


class RequestFailed(KvRouterError):
    """The mock engine could not serve a completion: it restarted or shut down while the request ran, or
    its model refused the request. ``status`` is the HTTP status the mock answers with (503, 400)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class EngineError(KvRouterError):
    """The shared-memory engine cannot serve the call: it was used before ``start`` or after ``close``,
    an applier process could not start, or another engine already runs in this process (segment names
    carry the owner's pid, so one process owns one engine). The message says which; restart the engine
    or fix what its message names."""


class FlushTimeout(EngineError, TimeoutError):
    """``Engine.flush`` gave up: some shard's applier did not apply everything sent before the flush
    within the timeout (it is busy with a large backlog, or restarting). Nothing is lost by the
    timeout itself; flush again with a longer timeout, or look at ``Engine.stats()`` for the shard."""


class StatsError(KvRouterError):
    """A ``kvrouter up`` stats segment (``stats/segment.py``) cannot be read: the name is no stats segment
    of this layout, its blob is truncated or does not decode, or its writer stayed mid-write (it died
    there). The message names the segment and what is wrong; a reader (``kvrouter top``) reports it and
    tries again later, or attaches elsewhere."""


class BadMessage(KvRouterError, ValueError):
    """A replica-sync message from NATS (``kvrouter/bridge/codec.py``) does not decode: not JSON, a
    missing or mistyped field, an unknown variant, a number out of range. The message names the path and
    the offending value, e.g. ``active_sequences_events: $.worker.dp_rank: expected an integer in
    0..4294967295, got 'x'``. The bridge counts it as malformed, logs the first one, and applies nothing of
    it; the sync carries on. Also raised for a durable-mode index snapshot that does not decode
    (``kvrouter/bridge/snapshot.py``): the replica counts it, says so, and replays the stream instead."""


class RecordingError(KvRouterError):
    """A recording (``kvrouter up --record FILE``, ``kvrouter/recording/``) cannot be replayed: the file does not
    start with the recording magic, its header names a format version this kvrouter does not read, or a
    frame is cut short or does not decode (a writer killed mid-frame, a copy cut off). The message names the
    file, the byte offset and what is wrong; ``kvrouter replay --from`` prints it and exits with status 2."""


class EventError(KvRouterError):
    """A KV event could not be applied (or decoded).

    Index and applier callers count it by ``kind`` against the worker and carry on serving: one bad
    event never stops the process.
    """

    kind: ClassVar[str] = "event_error"


class BadEvent(EventError, ValueError):
    """The input does not decode into an event: malformed frame, wrong type, value out of range,
    missing field, unknown variant. The message names the offending value and its path, e.g.
    ``vllm batch: $[1][0].block_hashes[2]: expected an integer hash, got str``. Nothing of it is applied.
    """

    kind: ClassVar[str] = "bad_event"


class ParentNotFound(EventError):
    """A Stored event names a parent this (worker, dp_rank) does not hold, even if another worker
    does. Nothing of the event is applied, as in the reference; the caller counts it against the
    worker and carries on."""

    kind: ClassVar[str] = "parent_not_found"


class BlockNotFound(EventError):
    """A Removed event names a block this worker does not hold. The other hashes of the batch are
    still removed (best effort); this reports the first unknown one."""

    kind: ClassVar[str] = "block_not_found"


class InvalidBlockSequence(EventError):
    """A Stored event is self-contradictory (its parent is one of its own blocks, or it repeats an
    engine hash). Rejected whole, before anything is applied."""

    kind: ClassVar[str] = "invalid_block_sequence"


EVENT_ERROR_KINDS: Final[dict[str, type[EventError]]] = {
    cls.kind: cls for cls in (BadEvent, ParentNotFound, BlockNotFound, InvalidBlockSequence)
}
"""Kind name → class, for counters and for tests that replay fixture expectations."""
