"""The hot lane: ``/select``, ``/query`` and a reservation's life answered by our own HTTP/1.1 code, the rest by
aiohttp.

Why: a router front spends its CPU on HTTP, not on routing. Measured on this 2-core machine (wrk, one
connection per request stream, concurrency 8, a 7.5 KB POST answered with a constant): a bare aiohttp
handler answers 12,900 requests/s on one core (about 77 µs each), an ``asyncio.Protocol`` that finds the
header end and ``Content-Length`` 97,900/s (about 10 µs). kvrouter's own work per ``/select`` (parse,
hash, decide, encode) is about 60 µs, so aiohttp's request machinery was more than half of every decision.

What the lane takes, from every connection's first byte: ``POST /select``, ``/select_and_reserve``
(``/route``), ``/query``, ``/query_by_hash``, ``/reservations/{id}/prefill_complete`` and ``DELETE
/reservations/{id}`` over HTTP/1.1 with a ``Content-Length`` body within the body limit, no
``Transfer-Encoding``, ``Expect``, ``Upgrade`` or ``Connection`` other than keep-alive, while the service
is not draining, (for the selections) has no router queue to wait in and (for the reservations) knows the
reservation or has no replica sync whose booking it could wait for (``Service.hear_of``). It answers them
at once, synchronously, through the same gate (``gate.py``: admission, token, statuses, counters), parser
and answer encoder (``answers.py``) and core calls as aiohttp's handlers, so an answer is the same
whichever layer gave it (``test_lane.py``).

What it does not take, it hands over: at the first request the lane does not take, the connection (its
unread bytes included) becomes an aiohttp connection for the rest of its life, so every other route,
every HTTP error (malformed request lines, 413, chunked bodies), the streaming proxy, draining's 503 and
the router queue stay aiohttp's alone. Answers stay in order: the lane writes each one before it reads the
next request, and hands over only between requests.

Reads go through :class:`asyncio.BufferedProtocol`, into one scratch buffer per lane: asyncio's plain
``Protocol`` path calls ``sock.recv(256 KiB)`` for every read, and glibc serves an allocation that size
with ``mmap``, then ``mremap`` to shrink it and ``munmap`` to free it (an mmapped chunk shrunk by realloc
never raises the allocator's threshold): 13 µs a read on this machine against 2 µs for ``recv_into``,
about a tenth of a front's CPU per ``/select`` (CPython issue 85451). The scratch buffer is shared
because a read is consumed before the loop runs anything else: what a request has not finished is
copied out, as ``bytes``, before the next read.

Rejected: replacing aiohttp for every route (each HTTP edge case would then be ours to get right, for
routes that are not hot); a second server on another port (clients would need to know which route
lives where).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Final, Protocol

import orjson
from aiohttp import web

from ..core.requests import cached_tokens, parse_body, reservation_id
from ..core.state import Core
from .answers import SelectAnswers, query_body
from .gate import FRONT_HEADER, Gate
from .host import Host
from .routes import JSON, OK, SESSION_HEADER

__all__ = ["Lane"]

KEEPALIVE_S: Final = 75.0
"""An idle lane connection is closed after this long, as aiohttp closes its own (its default)."""
SWEEP_S: Final = 15.0
READ_BUFFER: Final = 256 * 1024
"""The lane's scratch buffer, as much as asyncio's own transport asks the socket for in one read."""
HEAD_LIMIT: Final = 16384
"""A request head longer than this is aiohttp's to refuse (its line and field limits are 8,190 bytes)."""
SELECTIONS: Final = {b"/select": False, b"/select_and_reserve": True, b"/route": True}
"""The selection routes the lane answers, and whether each books a reservation."""
QUERIES: Final = {b"/query": False, b"/query_by_hash": True}
"""The index queries the lane answers, and whether each takes block hashes."""
RESERVATIONS: Final = b"/reservations/"
PREFILL_COMPLETE: Final = b"/prefill_complete"
_SESSION: Final = SESSION_HEADER.lower().encode()
_OK_BODY: Final = orjson.dumps(OK)


def _status_line(status: int) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""  # 529 and the like: no standard phrase, as aiohttp sends them
    return f"HTTP/1.1 {status} {reason}\r\n".encode()


class Sharing(Protocol):
    """With ``--fronts N``, how a front serves the connections it holds with the other fronts
    (``service/process/sharing.py``): the lane calls these at a connection's turns."""

    def watch(self, connection: LaneConnection, transport: asyncio.Transport, *, serve: bool = True) -> None:
        """A new connection, before its transport's first read: serve it shared (``serve``), or only hold
        it, to end it if the fronts that serve it die."""
        ...

    def closing(self, connection: LaneConnection, transport: asyncio.BaseTransport) -> None:
        """``connection_lost``, before the transport closes its socket."""
        ...

    def hand_over(
        self, connection: LaneConnection, transport: asyncio.Transport, handler: asyncio.Protocol
    ) -> asyncio.Protocol:
        """The connection goes to aiohttp's ``handler`` for good: the protocol that takes the transport."""
        ...

    def end(self, connection: LaneConnection) -> bool:
        """The keep-alive sweep would close ``connection``: False when another front is answering on it."""
        ...

    def close(self) -> None:
        """Stop serving shared connections (the other fronts go on serving them)."""
        ...


class Lane:
    """The listening side: makes a :class:`LaneConnection` per accepted connection, keeps them for the
    keep-alive sweep and for :meth:`close`. Used on the service's event loop only."""

    def __init__(self, core: Core, host: Host, gate: Gate, answers: SelectAnswers, aiohttp_server: web.Server) -> None:
        self.core = core
        self.host = host
        self.gate = gate
        self.answers = answers
        self.aiohttp_server = aiohttp_server
        self.connections: set[LaneConnection] = set()
        self._status_lines: dict[int, bytes] = {}
        self._date = (0, b"")
        self._headers: tuple[object, bytes] = (None, b"")
        self._sweeper: asyncio.TimerHandle | None = None
        self.scratch = memoryview(bytearray(READ_BUFFER))
        """Every connection's reads land here (``get_buffer``) and are copied out at once (``buffer_updated``)."""
        self.deal: Callable[[asyncio.Transport], tuple[int, bool]] | None = None
        """Front 0 of ``--fronts N``: sends the fronts that serve a new connection their copy; returns the
        connection's id among the fronts and whether front 0 serves it too."""
        self.sharing: Sharing | None = None
        """With ``--fronts N``, every front's: the connections it serves with the other fronts."""

    def __call__(self, connection_id: int = 0) -> LaneConnection:
        """The protocol factory ``loop.create_server`` calls (and another front's, with the connection's id)."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)
        return LaneConnection(self, connection_id)

    def close(self) -> None:
        """Close every lane connection: each is idle between requests by construction (an answer is
        written before the next request is read); a half-received request is dropped, as aiohttp drops
        one on its idle connections at shutdown."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.sharing is not None:
            self.sharing.close()  # the copies it shares are dropped: the other fronts go on serving them
        for connection in list(self.connections):
            connection.close()

    def _sweep(self) -> None:
        idle_since = time.monotonic() - KEEPALIVE_S
        sharing = self.sharing
        for connection in list(self.connections):
            if connection.last_active < idle_since and (sharing is None or sharing.end(connection)):
                connection.close()
        self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    # -- answer bytes -----------------------------------------------------------------------------

    def response(self, status: int, body: bytes, extra: bytes) -> bytes:
        """One HTTP/1.1 response: the status line, ``Date``, the index headers, ``extra`` header lines."""
        line = self._status_lines.get(status)
        if line is None:
            line = self._status_lines[status] = _status_line(status)
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n")
        headers = self.core.facts.headers
        if self._headers[0] is not headers:
            fixed = dict(headers)
            if self.host.front is not None:
                fixed[FRONT_HEADER] = str(self.host.front)
            block = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in fixed.items())
            self._headers = (headers, block)
        return b"".join(
            (
                line,
                self._date[1],
                self._headers[1],
                extra,
                b"Content-Length: %d\r\n\r\n" % len(body),
                body,
            )
        )


_JSON_TYPE: Final = f"Content-Type: {JSON}\r\n".encode()


class LaneConnection(asyncio.BufferedProtocol):
    """One client connection while the lane serves it."""

    def __init__(self, lane: Lane, connection_id: int = 0) -> None:
        self.lane = lane
        self.id = connection_id
        """The connection's id among the fronts of ``--fronts N`` (front 0 numbers them as it accepts)."""
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.last_active = time.monotonic()
        self.paused = False
        self.fd = -1
        """The socket's descriptor in this front, while shared (``process/sharing.py``)."""
        self.dropped = False
        """This front's copy was closed without ending the connection."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        lane = self.lane
        serve = True
        if lane.deal is not None:
            self.id, serve = lane.deal(transport)
        if lane.sharing is None or lane.deal is not None:  # counted once: by the front that accepted it
            lane.core.counters.connections += 1
        self.transport = transport
        lane.connections.add(self)
        if lane.sharing is not None:
            lane.sharing.watch(self, transport, serve=serve)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lane.sharing is not None and self.transport is not None:
            self.lane.sharing.closing(self, self.transport)
        self.lane.connections.discard(self)
        self.transport = None

    def pause_writing(self) -> None:
        """The client reads slower than it sends: stop reading its requests until it catches up."""
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None:
            self.transport.resume_reading()
            self._received(b"")

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.lane.scratch

    def buffer_updated(self, nbytes: int) -> None:
        self._received(bytes(self.lane.scratch[:nbytes]))

    def _received(self, data: bytes) -> None:
        buffer = self.buffer + data if self.buffer else data
        while buffer and not self.paused and self.transport is not None:
            head_end = buffer.find(b"\r\n\r\n")
            if head_end < 0:
                if len(buffer) > HEAD_LIMIT:
                    return self._hand_over(buffer)
                break
            request = self._parse_head(buffer, head_end)
            if request is None:
                return self._hand_over(buffer)
            method, target, length, headers = request
            start = head_end + 4
            if len(buffer) < start + length:
                break
            body = buffer[start : start + length]
            answer = self._answer(method, target, body, headers)
            if answer is None:
                return self._hand_over(buffer)
            self.transport.write(answer)
            buffer = buffer[start + length :]
        self.buffer = buffer
        self.last_active = time.monotonic()

    def _parse_head(self, buffer: bytes, head_end: int) -> tuple[bytes, bytes, int, dict[bytes, bytes]] | None:
        """(method, target, Content-Length, the headers the lane reads) of a request the lane may take, or
        None: not one of its routes, or anything in the head it leaves to aiohttp."""
        if head_end > HEAD_LIMIT:
            return None
        lines = buffer[:head_end].split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or parts[2] != b"HTTP/1.1":
            return None
        method, target = parts[0], parts[1]
        if method == b"POST":
            if (
                target not in SELECTIONS
                and target not in QUERIES
                and not (target.startswith(RESERVATIONS) and target.endswith(PREFILL_COMPLETE))
            ):
                return None
        elif method != b"DELETE" or not target.startswith(RESERVATIONS):
            return None
        length = -1
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name[-1:] in b" \t" or name[:1] in b" \t":
                return None  # not a header line, or obsolete folding: aiohttp's to refuse
            name = name.lower()
            value = value.strip(b" \t")
            if name == b"content-length":
                if length >= 0 or not value.isdigit():
                    return None
                length = int(value)
            elif name in (b"transfer-encoding", b"expect", b"upgrade"):
                return None
            elif name == b"connection":
                if value.lower() != b"keep-alive":
                    return None
            elif name == b"authorization" or name == _SESSION:
                if name in headers:
                    return None
                headers[name] = value
        if length < 0:
            if method == b"POST":
                return None
            length = 0
        if length > self.lane.core.config.max_body_bytes:
            return None  # aiohttp's 413
        return method, target, length, headers

    def _answer(self, method: bytes, target: bytes, body: bytes, headers: dict[bytes, bytes]) -> bytes | None:
        """The whole response to one request, or None when the lane leaves it (and the connection) to
        aiohttp. What the aiohttp middleware does around a handler, the lane does here, through the gate."""
        lane = self.lane
        core = lane.core
        lifecycle = core.lifecycle
        if lifecycle.stopping:
            return None  # aiohttp's middleware answers 503, and it drains what it holds
        reserve = SELECTIONS.get(target)
        by_hash = QUERIES.get(target)  # _parse_head let a query target through on POST only
        reservation = ""
        if by_hash is not None:
            route = target.decode()
        elif reserve is None:
            reservation = self._selection_id(method, target)
            if not reservation or core.reservations.awaits_booking(reservation):
                return None  # aiohttp's handler waits for a peer's booking still on its way (hear_of)
            route = "/reservations/{id}/prefill_complete" if method == b"POST" else "/reservations/{id}"
        else:
            if core.queue.threshold is not None:
                return None  # a selection may wait in the router queue: aiohttp's awaitable path
            route = target.decode()
        verb = method.decode()
        started = time.perf_counter()
        gate = lane.gate
        lifecycle.inflight += 1
        status = 200
        try:
            gate.authorize(verb, route, headers.get(b"authorization", b"").decode("latin-1"))
            if by_hash is not None:
                payload, extra = query_body(core, body, by_hash=by_hash), _JSON_TYPE
            elif reserve is None:
                lifecycle.require_index()
                reservation = reservation_id(reservation)
                if method == b"POST":
                    core.reservations.prefill_complete(
                        reservation, cached_tokens(parse_body(body)) if body.strip() else None
                    )
                else:
                    core.reservations.free(reservation)
                payload, extra = _OK_BODY, _JSON_TYPE
            else:
                lifecycle.require_index()  # before the parse: its compiled scan waits for the start's compile
                payload, extra = self._select(body, headers.get(_SESSION), reserve=reserve, started=started)
        except Exception as exc:
            refusal = gate.refusal(exc, route)
            status = refusal.status
            payload = orjson.dumps({"error": refusal.message})
            extra = _JSON_TYPE + b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in refusal.headers.items())
        finally:
            lifecycle.inflight -= 1
        gate.count(route, verb, status, started)
        return lane.response(status, payload, extra)

    def _select(self, body: bytes, session: bytes | None, *, reserve: bool, started: float) -> tuple[bytes, bytes]:
        """A selection's body and its header lines (the phases timed by the answers, as on aiohttp's route)."""
        lane = self.lane
        request = lane.answers.parse(
            body, None if session is None else session.decode("utf-8", "surrogateescape"), started
        )
        payload, extra = lane.answers.encode(lane.core.queue.select_now(request, reserve=reserve), started)
        if not extra:
            return payload, _JSON_TYPE
        return payload, _JSON_TYPE + b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in extra.items())

    @staticmethod
    def _selection_id(method: bytes, target: bytes) -> str:
        """The ``{id}`` of a reservation route, or "" when the lane leaves the target to aiohttp (escapes,
        a query string, anything but plain ASCII: aiohttp's router decodes those)."""
        rest = target[len(RESERVATIONS) :]
        if method == b"POST":
            rest = rest[: -len(PREFILL_COMPLETE)]
        if not rest or not rest.isascii() or any(c in rest for c in b"/%?#"):
            return ""
        return rest.decode()

    def _hand_over(self, buffer: bytes) -> None:
        """Give the connection, with the bytes it has not answered, to aiohttp for the rest of its life."""
        transport = self.transport
        assert transport is not None
        self.lane.connections.discard(self)
        self.lane.core.counters.handovers += 1
        self.transport = None
        self.buffer = b""
        handler: asyncio.Protocol = self.lane.aiohttp_server()
        sharing = self.lane.sharing
        if sharing is not None:
            handler = sharing.hand_over(self, transport, handler)
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if buffer:
            handler.data_received(buffer)
