"""``Routes``: the HTTP API of ``docs/http-api.md`` over aiohttp: the route table, one middleware, thin handlers.

Each handler reads and validates its body (``core/requests.py``), calls the core part that does the work
(the registry through the host's ``control``, the router queue, the reservations, the decider's query),
and encodes the answer (``answers.py``). One middleware does what every route shares, through the
:class:`~kvrouter.service.edges.gate.Gate`: refuse once the service stops, the bearer token on writes, the
refusal's status (and ``Retry-After`` while the index starts), the per-route counters, and the
``X-Kvrouter-Front`` header with ``--fronts N``. The hot routes are also served without aiohttp, by the
lane (``lane.py``), through the same gate and answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import orjson
from aiohttp import hdrs, web
from multidict import CIMultiDict

from ...errors import BadRequest, NotFound
from ..core.requests import cached_tokens, parse_body, reservation_id
from ..core.state import Core
from .answers import SelectAnswers, dump_json, loads_json, query_body, workers_json
from .gate import FRONT_HEADER, OPENAI_ROUTES, Gate, openai_error
from .host import Host

__all__ = ["JSON", "OK", "SESSION_HEADER", "Routes", "client_gone"]

log = logging.getLogger(__name__)

JSON: Final = "application/json"
OK: Final = {"status": "ok"}
"""A reservation route's answer."""
SESSION_HEADER: Final = "X-Dynamo-Session-ID"
"""The reference's session header: a session sticks to its worker (``core/affinity.py``)."""


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS), status=status, content_type=JSON, headers=headers
    )


def client_gone(request: web.Request) -> Callable[[], bool]:
    """Whether the client of ``request`` closed its connection (aiohttp does not cancel handlers)."""

    def gone() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    return gone


class Routes:
    """The HTTP API of one service: :meth:`middleware` goes to the ``web.Application``, :meth:`add_to` adds
    the routes. Used on the service's event loop only."""

    def __init__(self, core: Core, host: Host, gate: Gate, answers: SelectAnswers) -> None:
        self.core = core
        self.host = host
        self.gate = gate
        self.answers = answers
        self._json_headers: tuple[object, CIMultiDict[str]] = (None, CIMultiDict())
        """(the index headers they hold, those headers plus Content-Type), re-made when the health loop swaps
        the index headers."""

    def add_to(self, app: web.Application) -> None:
        """Add every route of ``docs/http-api.md`` served here (``/metrics`` and the proxy add their own)."""
        r = app.router
        r.add_get("/health", self._h_health)
        r.add_get("/ready", self._h_ready)
        r.add_post("/register", self._h_register)
        r.add_post("/unregister", self._h_unregister)
        r.add_get("/workers", self._h_workers)
        r.add_post("/query", self._h_query)
        r.add_post("/query_by_hash", self._h_query_by_hash)
        r.add_post("/select", self._h_select)
        r.add_post("/select_and_reserve", self._h_select_and_reserve)
        r.add_post("/route", self._h_select_and_reserve)
        r.add_post("/reservations/{id}/prefill_complete", self._h_prefill_complete)
        r.add_delete("/reservations/{id}", self._h_free)
        r.add_get("/loads", self._h_loads)
        r.add_get("/dump", self._h_dump)
        r.add_get("/busy_threshold", self._h_busy_get)
        r.add_post("/busy_threshold", self._h_busy_set)
        r.add_get("/decisions", self._h_decisions)
        r.add_get("/decisions/{selection_id}", self._h_decision)
        r.add_get("/events", self._h_events)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        started = time.perf_counter()
        gate = self.gate
        lifecycle = self.core.lifecycle
        response: web.StreamResponse
        lifecycle.inflight += 1
        try:
            gate.admit(name)
            gate.authorize(request.method, name, request.headers.get("Authorization", ""))
            response = await handler(request)
        except web.HTTPException as exc:  # no such route (404), method (405), body too large (413)
            message = exc.reason if exc.status != 413 else exc.text or "body too large"
            body = openai_error(exc.status, message) if request.path in OPENAI_ROUTES else {"error": message}
            response = _json(body, exc.status)
        except Exception as exc:
            refusal = gate.refusal(exc, name)
            if request.path in OPENAI_ROUTES:
                body = openai_error(refusal.status, refusal.message, refusal.param)
            else:
                body = {"error": refusal.message}
            response = _json(body, refusal.status, refusal.headers or None)
        finally:
            lifecycle.inflight -= 1
        front = self.host.front
        if front is not None:
            response.headers[FRONT_HEADER] = str(front)
        gate.count(name, request.method, response.status, started)
        return response

    async def _body(self, request: web.Request) -> dict[str, Any]:
        return parse_body(await request.read())

    async def _h_health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok", "stopping": self.core.lifecycle.stopping})

    async def _h_ready(self, request: web.Request) -> web.Response:
        ok, body = self.host.ready()
        return _json(body, 200 if ok else 503)

    async def _h_register(self, request: web.Request) -> web.Response:
        return _json(await self.host.control("register", await self._body(request)), 201)

    async def _h_unregister(self, request: web.Request) -> web.Response:
        return _json(await self.host.control("unregister", await self._body(request)))

    async def _h_workers(self, request: web.Request) -> web.Response:
        model, group = request.query.get("model_name"), request.query.get("routing_group")
        return _json(workers_json(self.core.registry, model, group), headers=self.core.facts.headers)

    async def _h_query(self, request: web.Request) -> web.Response:
        return self._query(await request.read(), by_hash=False)

    async def _h_query_by_hash(self, request: web.Request) -> web.Response:
        return self._query(await request.read(), by_hash=True)

    def _query(self, raw: bytes, *, by_hash: bool) -> web.Response:
        body = query_body(self.core, raw, by_hash=by_hash)
        return web.Response(body=body, content_type=JSON, headers=self.core.facts.headers)

    async def _select_route(self, request: web.Request, *, reserve: bool) -> web.Response:
        started = time.perf_counter()
        self.core.lifecycle.require_index()  # before the parse: its compiled scan waits for the start's compile
        select = self.answers.parse(await request.read(), request.headers.get(SESSION_HEADER), started)
        decision = await self.core.queue.select(select, reserve=reserve, gone=client_gone(request))
        payload, extra = self.answers.encode(decision, started)
        facts = self.core.facts
        if self._json_headers[0] is not facts.headers:
            headers = CIMultiDict(facts.headers)
            headers[hdrs.CONTENT_TYPE] = JSON
            self._json_headers = (facts.headers, headers)
        response = web.Response(body=payload, headers=self._json_headers[1])  # aiohttp copies the headers
        response.headers.update(extra)
        return response

    async def _h_select(self, request: web.Request) -> web.Response:
        return await self._select_route(request, reserve=False)

    async def _h_select_and_reserve(self, request: web.Request) -> web.Response:
        return await self._select_route(request, reserve=True)

    async def _h_prefill_complete(self, request: web.Request) -> web.Response:
        reservation = reservation_id(request.match_info["id"])
        self.core.lifecycle.require_index()
        await self.core.reservations.hear_of(reservation)  # a peer's booking may still be on its way
        raw = await request.read()
        self.core.reservations.prefill_complete(reservation, cached_tokens(parse_body(raw)) if raw.strip() else None)
        return _json(OK)

    async def _h_free(self, request: web.Request) -> web.Response:
        reservation = reservation_id(request.match_info["id"])
        self.core.lifecycle.require_index()
        await self.core.reservations.hear_of(reservation)
        self.core.reservations.free(reservation)
        return _json(OK)

    async def _h_loads(self, request: web.Request) -> web.Response:
        return _json(loads_json(self.core.registry, self.core.queue), headers=self.core.facts.headers)

    async def _h_dump(self, request: web.Request) -> web.Response:
        self.core.lifecycle.require_index()
        return _json(dump_json(self.core.registry), headers=self.core.facts.headers)

    async def _h_busy_get(self, request: web.Request) -> web.Response:
        return _json({"thresholds": [p.thresholds() for p in self.core.registry.partitions.values()]})

    async def _h_busy_set(self, request: web.Request) -> web.Response:
        return _json(await self.host.control("busy", await self._body(request)))

    @staticmethod
    def _since(request: web.Request) -> int:
        raw = request.query.get("since", "0")
        try:
            return int(raw)
        except ValueError as exc:
            raise BadRequest(f"since: expected an integer, got {raw!r}") from exc

    async def _h_decisions(self, request: web.Request) -> web.Response:
        journal = self.core.journal
        return _json(
            {"last": journal.decision_seq, "decisions": journal.after(journal.decisions, self._since(request))}
        )

    async def _h_decision(self, request: web.Request) -> web.Response:
        answer = await self.host.find_decision(request.match_info["selection_id"])
        if answer is None:
            raise NotFound("no decision of that id is kept (never made, or older than the ring holds)")
        return _json(answer)

    async def _h_events(self, request: web.Request) -> web.Response:
        journal = self.core.journal
        return _json({"last": journal.event_seq, "events": journal.after(journal.events, self._since(request))})
