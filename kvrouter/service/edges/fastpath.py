"""The ZMQ fast path: the decision routes as msgpack over one ROUTER socket, beside the HTTP API.

For in-cluster clients that make a decision per request, HTTP's per-request cost (header parsing, the
aiohttp request and response objects, JSON) is most of a ``/select``'s time in the front. Here a
client keeps one DEALER (or REQ) socket open and sends ``[b"kvr1", msgpack(body)]`` (REQ and DEALER
clients that add the empty delimiter frame are answered with it); the body is the JSON route's body plus
``"op"`` and an optional ``"id"`` echoed in the reply, and the reply is msgpack of exactly what the HTTP
route answers, or ``{"error": ..., "status": n}``. Frames and ops: ``docs/zmq-fast-path.md``.

Design choices:
- One socket on the service's own event loop, no thread: every op is a few microseconds of synchronous
  work on state the loop owns (partitions, reservations), so a thread would need a lock around all of it
  or a hand-off per message, and gain nothing on two cores. The same core calls, ``core/requests.py``
  parsers, answers (``answers.py``) and gate (``gate.py``: token, statuses) as HTTP serve it, so both paths
  decide, validate and refuse alike. With ``--fronts N`` every front serves the one endpoint
  (``docs/zmq-fast-path.md``): the socket here is then a DEALER connected to front 0's relay, and reads
  the same frames a ROUTER would.
- The loop watches the socket's ``ZMQ_FD`` (``add_reader``), and each time it is readable the socket is
  read with ``NOBLOCK`` until it has nothing left, each reply sent ``NOBLOCK`` as soon as it is made.
  The fd says only that the socket's state may have changed (libzmq's signal, consumed by the reads), so
  reading until ``EAGAIN`` is what makes a later message wake the loop again. Rejected: ``zmq.asyncio``,
  which the fast path used first: a future and a poll of ``ZMQ_EVENTS`` per receive and per send were
  about 40 % of the front's samples on this path, more than the decision.
- Messages are served one at a time, in arrival order; after ``YIELD_EVERY`` messages in a row the loop
  is given a turn before the socket is read again, so HTTP, the health loop and signals are never starved
  by a busy fast-path client. One exception, as over HTTP: with replica sync connected, a
  ``prefill_complete`` or ``free`` naming a reservation not known here waits (in a task of its own, the
  other messages served meanwhile) up to ``SYNC_GRACE_S`` for a peer's booking still on its way
  (``Reservations.hear_of``), so its reply may come after later ones: the ``"id"`` tells them apart.
- Refusals never close the socket or end the loop: a malformed envelope, a body that is not a msgpack
  map, an unknown op, a wrong token or a refused request each get an error reply and are counted
  (:class:`FastPathCounters`); an unexpected exception is a 500 reply, logged once per kind.
- Size: a body frame above ``max_body_bytes`` gets a 413 reply; libzmq's ``MAXMSGSIZE`` (the limit
  plus ``FRAME_SLACK``) drops the connection of a peer sending a larger frame before it is ever read
  into memory (libzmq gives no reply in that case; the client sees its connection reset).
- Auth as HTTP: with ``auth_token`` set, the write ops (``select_and_reserve``, ``prefill_complete``,
  ``free``) need a ``"token"`` field, compared with ``hmac.compare_digest``; the read ops stay open.
- Register/unregister stay HTTP-only: the control plane is rare and wants HTTP's tooling.

Rejected: a second process (the reservations and load views live in this loop: it would need the
replica-sync messages), REP (one request at a time per socket pair, no pipelining), and JSON inside ZMQ
(msgpack packs token lists about twice as fast as orjson parses them and is what the event plane already
uses).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack
import numpy as np
import zmq

from ...errors import BadRequest, TooLarge, Unauthorized
from ..core.requests import cached_tokens, parse_query, parse_select, selection_id
from ..core.state import Core
from .answers import query_json, select_json
from .gate import Gate

__all__ = ["MAGIC", "OPS", "FastPath", "FastPathCounters"]

log = logging.getLogger(__name__)

MAGIC: Final = b"kvr1"
"""Protocol frame: a client speaking another version is answered with a 400, not misread."""
OPS: Final = ("select", "select_and_reserve", "query", "query_by_hash", "prefill_complete", "free")
WRITE_OPS: Final = frozenset({"select_and_reserve", "prefill_complete", "free"})
"""Ops that need the token when one is set (as the HTTP write routes)."""
RESERVATION_OPS: Final = frozenset({"prefill_complete", "free"})
"""The ops naming a reservation, which may wait for a peer's booking of it (``Service.hear_of``)."""
YIELD_EVERY: Final = 64
FRAME_SLACK: Final = 64 << 10
"""libzmq's MAXMSGSIZE is ``max_body_bytes`` plus this: frames a little over the limit get a 413 reply;
far over it, the peer is disconnected before the frame is buffered."""
MAX_ID_LEN: Final = 256
"""The longest string ``"id"`` a client may tag a message with (echoed in the reply)."""


@dataclass(slots=True)
class FastPathCounters:
    """What the fast path counts; mutated by the service's loop only."""

    requests: dict[str, int] = field(default_factory=dict)
    """op -> messages answered (an unknown op counts as ``"invalid"``)."""
    errors: dict[tuple[str, str], int] = field(default_factory=dict)
    """(op, "4xx" | "5xx") -> error replies."""
    seconds: dict[str, float] = field(default_factory=dict)
    """op -> total seconds spent answering (decode to encoded reply)."""
    malformed: int = 0
    """Messages whose envelope, magic, msgpack or op was wrong."""
    oversized: int = 0
    """Body frames above ``max_body_bytes`` (answered 413)."""
    unauthorized: int = 0


def _default(value: Any) -> Any:
    """msgpack's fallback: numpy scalars (never expected in a reply, but never a 500 either)."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot pack {type(value).__name__}")


class FastPath:
    """The fast path's socket and its serving on the loop: :meth:`start` binds (or connects to front 0's
    relay), :meth:`close` closes."""

    def __init__(self, core: Core, gate: Gate, port: int, *, host: str | None = None, relay: str | None = None) -> None:
        self.core = core
        self.gate = gate
        self.port = port
        self.host = host if host is not None else core.config.host
        self.relay = relay
        """``--fronts N``: front 0's relay endpoint this front's DEALER connects to (None: bind a ROUTER)."""
        self.endpoint = ""
        """``tcp://host:port`` once bound (or the relay's endpoint)."""
        self.counters = FastPathCounters()
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        """The socket's ``ZMQ_FD`` while the loop watches it."""
        self._logged: set[str] = set()
        self._waiting: set[asyncio.Task[None]] = set()
        """Reservation ops waiting for a peer's booking (``_answer_later``), cancelled at close."""
        self._packer = msgpack.Packer(default=_default)
        self._limit = core.config.max_body_bytes
        self._ops: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
            "select": lambda body: self._select(body, reserve=False),
            "select_and_reserve": lambda body: self._select(body, reserve=True),
            "query": lambda body: self._query(body, by_hash=False),
            "query_by_hash": lambda body: self._query(body, by_hash=True),
            "prefill_complete": self._prefill_complete,
            "free": self._free,
        }

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind on the running loop and start serving.

        Raises:
            zmq.ZMQError: the address is taken or not local.
        """
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = context.socket(zmq.ROUTER if self.relay is None else zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._limit + FRAME_SLACK)
            if self.relay is not None:  # front 0's relay deals this front the messages: identity first
                sock.connect(self.relay)
                self.endpoint = self.relay
            else:
                sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a peer that left is dropped, not an error
                host = self.host
                if ":" in host.strip("[]"):
                    sock.setsockopt(zmq.IPV6, 1)
                    host = f"[{host.strip('[]')}]"
                sock.bind(f"tcp://{host}:{self.port or '*'}")
                self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            sock.close(linger=0)
            context.term()
            raise
        self._context, self._socket = context, sock
        self._loop = asyncio.get_running_loop()
        self._fd = sock.fileno()  # ZMQ_FD
        self._loop.add_reader(self._fd, self._serve)
        log.info("fastpath listening endpoint=%s", self.endpoint)

    async def close(self) -> None:
        """Stop serving and close the socket (LINGER 0: unsent replies are dropped). Idempotent."""
        for task in list(self._waiting):
            task.cancel()
        await asyncio.gather(*self._waiting, return_exceptions=True)
        loop, self._loop = self._loop, None
        if loop is not None and self._fd >= 0:
            loop.remove_reader(self._fd)
        self._fd = -1
        sock, self._socket = self._socket, None
        if sock is not None:
            sock.close(linger=0)
        context, self._context = self._context, None
        if context is not None:
            context.term()

    # -- serving --------------------------------------------------------------------------------

    def _serve(self) -> None:
        """Read and answer until the socket has nothing left (then its fd wakes the loop for the next
        message), or ``YIELD_EVERY`` messages (then the loop runs its other work and calls this again)."""
        sock = self._socket
        if sock is None:
            return
        for _ in range(YIELD_EVERY):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if exc.errno not in (zmq.ETERM, zmq.ENOTSOCK):
                    self._log_once("recv", "fastpath recv failed errno=%s", exc.errno)
                return
            try:
                reply = self.handle(frames)
                if reply is not None:
                    sock.send_multipart(reply, zmq.NOBLOCK)
            except zmq.Again:
                self._log_once("send", "fastpath reply dropped (peer queue full)")
            except Exception as exc:  # the loop must survive anything
                self._log_once(f"serve:{type(exc).__name__}", "fastpath message failed kind=%s", type(exc).__name__)
        if self._loop is not None:
            self._loop.call_soon(self._serve)

    async def _answer_later(self, frames: list[bytes], selection_id: str) -> None:
        """A reservation op :meth:`handle` put off: once the booking arrived or the grace ran out, answer it
        as if it had just come in."""
        await self.core.reservations.hear_of(selection_id)
        sock = self._socket
        reply = self.handle(frames, wait=False)
        if reply is None or sock is None:
            return
        try:
            sock.send_multipart(reply, zmq.NOBLOCK)
        except zmq.Again:
            self._log_once("send", "fastpath reply dropped (peer queue full)")
        except zmq.ZMQError as exc:
            self._log_once("send", "fastpath reply failed errno=%s", exc.errno)

    def handle(self, frames: list[bytes], *, wait: bool = True) -> list[bytes] | None:
        """One message (as the ROUTER reads it, identity first) to its reply frames; None: no peer, or a
        reservation op left to wait for a peer's booking (``wait``; its reply is sent when it is made)."""
        if not frames or not frames[0]:
            return None  # no identity: nobody to answer
        envelope = [frames[0]]
        rest = frames[1:]
        if rest and rest[0] == b"":
            envelope.append(b"")  # REQ (or a DEALER writing the delimiter): answer in the same form
            rest = rest[1:]
        started = time.perf_counter()
        op = "invalid"
        request_id: Any = None
        counters = self.counters
        try:
            if len(rest) != 2 or rest[0] != MAGIC:
                counters.malformed += 1
                raise BadRequest(f"expected frames [{MAGIC!r}, msgpack body] after the envelope")
            raw = rest[1]
            if len(raw) > self._limit:
                counters.oversized += 1
                raise TooLarge(f"body of {len(raw)} bytes is above the limit of {self._limit}")
            body = self._decode(raw)
            request_id = body.get("id")
            if request_id is not None and not (
                type(request_id) is int or (isinstance(request_id, str) and len(request_id) <= MAX_ID_LEN)
            ):
                request_id = None
                counters.malformed += 1
                raise BadRequest(f"id: expected an integer or a string of at most {MAX_ID_LEN} characters")
            name = body.get("op")
            handler = self._ops.get(name) if isinstance(name, str) else None
            if handler is None or not isinstance(name, str):
                counters.malformed += 1
                raise BadRequest(f"op: expected one of {', '.join(OPS)}, got {name!r}")
            op = name
            self.core.lifecycle.require_open()
            if op in WRITE_OPS and not self.gate.token_ok(_token(body)):
                counters.unauthorized += 1
                raise Unauthorized("missing or wrong token")
            if wait and op in RESERVATION_OPS and self._loop is not None:
                reservation = selection_id(body.get("selection_id"))
                if self.core.reservations.awaits_booking(reservation):
                    task = self._loop.create_task(self._answer_later(frames, reservation))
                    self._waiting.add(task)
                    task.add_done_callback(self._waiting.discard)
                    return None
            answer = handler(body)
        except Exception as exc:
            refusal = self.gate.refusal(exc, f"fastpath:{op}")
            answer = {"error": refusal.message, "status": refusal.status}
        if request_id is not None:
            answer["id"] = request_id
        try:
            packed = self._packer.pack(answer)
        except Exception as exc:
            self._log_once(f"pack:{type(exc).__name__}", "fastpath reply not packable op=%s", op)
            answer = {"error": f"internal error ({type(exc).__name__})", "status": 500}
            if request_id is not None:
                answer["id"] = request_id
            packed = self._packer.pack(answer)
        counters.requests[op] = counters.requests.get(op, 0) + 1
        counters.seconds[op] = counters.seconds.get(op, 0.0) + time.perf_counter() - started
        status = answer.get("status")
        if "error" in answer and isinstance(status, int):
            klass = (op, "4xx" if status < 500 else "5xx")
            counters.errors[klass] = counters.errors.get(klass, 0) + 1
        return [*envelope, MAGIC, packed]

    def _decode(self, raw: bytes) -> dict[str, Any]:
        try:
            value = msgpack.unpackb(raw, raw=False)
        except Exception as exc:  # msgpack raises ValueError, ExtraData, FormatError, StackError, ...
            self.counters.malformed += 1
            raise BadRequest(f"body is not valid msgpack: {type(exc).__name__}") from exc
        if not isinstance(value, dict):
            self.counters.malformed += 1
            raise BadRequest(f"body must be a msgpack map, got {type(value).__name__}")
        return value

    def _log_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(message + " (logged once per kind, then counted)", *args)

    # -- ops: the HTTP routes' answers ------------------------------------------------------------

    def _select(self, body: Mapping[str, Any], *, reserve: bool) -> dict[str, Any]:
        self.core.lifecycle.require_index()
        select = parse_select(body)
        partition = self.core.registry.partitions.get((select.model_name, select.routing_group))
        if partition is not None and partition.disaggregated:
            raise BadRequest(
                f"partition {partition.name} is disaggregated (workers of role prefill): the ZMQ fast path does not "
                "answer split decisions yet; use HTTP /select or /select_and_reserve"
            )
        decision = self.core.queue.select_now(select, reserve=reserve)
        answer = select_json(decision)
        answer["index"] = self.core.facts.summary
        return answer

    def _query(self, body: Mapping[str, Any], *, by_hash: bool) -> dict[str, Any]:
        answer = query_json(self.core.decider.query(parse_query(body, by_hash=by_hash)))
        answer["index"] = self.core.facts.summary
        return answer

    def _prefill_complete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        self.core.lifecycle.require_index()
        self.core.reservations.prefill_complete(selection_id(body.get("selection_id")), cached_tokens(body))
        return {"status": "ok"}

    def _free(self, body: Mapping[str, Any]) -> dict[str, Any]:
        self.core.lifecycle.require_index()
        self.core.reservations.free(selection_id(body.get("selection_id")))
        return {"status": "ok"}


def _token(body: Mapping[str, Any]) -> str | None:
    given = body.get("token")
    return given if isinstance(given, str) else None
