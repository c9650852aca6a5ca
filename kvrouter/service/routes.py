"""``Routes``: the HTTP API of ``docs/http-api.md`` over one service: the route table, the middleware, the handlers.

Each handler is a thin adapter: read and validate the body (``validation.py``, ``fastparse.py``), call
the service's Python method that does the work (:meth:`~kvrouter.service.app.Service.register`,
``select_or_wait``, ...), encode the answer. Keeping the HTTP layer here and the decisions in
``app.py`` is what lets the ZMQ fast path (``fastpath.py``), the proxy and the router queue call the
same methods without going through aiohttp. One middleware does what every route shares: refuse while
draining, the bearer token on writes, the error mapping (``ServiceError`` -> its status, engine not up
-> 503, bad input -> 400, anything else -> 500 logged with its traceback) and the per-route counters.

``/select``'s common answer is spliced from bytes cached here (the answer head per partition, worker
and endpoint; the index summary encoded once per refresh), so the hot route builds no nested dicts.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import orjson
from aiohttp import hdrs, web
from multidict import CIMultiDict

from ..errors import EngineError, KvRouterError, ServiceError
from ..events.codecs.dynamo import Encoder
from ..events.model import WorkerKey
from ..hashing import block_hashes_array
from . import fastparse
from .affinity import SESSION_HEADER
from .answers import address, select_json
from .fronts import FRONT_HEADER
from .queue import client_gone
from .validation import (
    MAX_ID,
    SelectRequest,
    cached_tokens,
    parse_body,
    parse_query,
    parse_select,
)

if TYPE_CHECKING:
    from .app import SelectResult, Service
    from .partition import Instance, Partition

__all__ = ["Routes"]

log = logging.getLogger(__name__)

OPEN_ROUTES: Final = frozenset({"/query", "/query_by_hash", "/select"})
"""POST routes that only read (no state changes): open even with an auth token. Every other POST and
DELETE is a write and needs the bearer token when one is set."""
ALWAYS_SERVED: Final = frozenset({"/health", "/ready", "/metrics"})
"""Routes still answered while the service drains."""
JSON: Final = "application/json"
GATEWAY_HEADER: Final = "X-Gateway-Destination-Endpoint"
"""The chosen worker's ``ip:port`` (then the fallbacks'), for a gateway that forwards by header."""
UNAUTHORIZED: Final = "missing or wrong bearer token"
"""The 401's error message, from the middleware and from the lane."""
OK: Final = {"status": "ok"}
"""A reservation route's answer."""
HEADS_CACHED: Final = 4096
"""``/select`` answer heads kept (one per partition, worker and endpoint); cleared when full."""


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS), status=status, content_type=JSON, headers=headers
    )


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


class Routes:
    """The HTTP API of one :class:`~kvrouter.service.app.Service`: its :meth:`middleware` goes to the
    ``web.Application``, :meth:`add_to` adds the routes. Used on the service's event loop only."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self._index_json: tuple[object, bytes] = (None, b"")
        """(the ``_index`` dict it encodes, its JSON): re-encoded when ``Health.refresh_index`` swaps the dict."""
        self._json_headers: tuple[object, CIMultiDict[str]] = (None, CIMultiDict())
        """(the ``_index_headers`` they hold, those headers plus Content-Type), as ``_index_json``."""
        self._heads: dict[tuple[str, str, int, WorkerKey, str | None], bytes] = {}

    def add_to(self, app: web.Application) -> None:
        """Add every route of ``docs/http-api.md`` served here to ``app``."""
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
        self.service._inflight += 1
        response: web.StreamResponse
        try:
            if self.service._stopping and name not in ALWAYS_SERVED:
                response = _error(503, "the service is stopping")
            elif self.needs_token(request.method, name) and not self.bearer_ok(
                request.headers.get("Authorization", "")
            ):
                response = _error(401, UNAUTHORIZED)
                response.headers["WWW-Authenticate"] = "Bearer"
            else:
                response = await handler(request)
        except web.HTTPException as exc:  # no such route (404), method (405), body too large (413)
            response = _error(exc.status, exc.reason if exc.status != 413 else exc.text or "body too large")
        except Exception as exc:
            response = _error(*self.failure(exc, name))
        finally:
            self.service._inflight -= 1
        if self.service.fronts is not None:
            response.headers[FRONT_HEADER] = str(self.service.fronts.index)
        self.count(name, request.method, response.status, started)
        return response

    # -- what the middleware and the hot lane (lane.py) share --------------------------------------

    def needs_token(self, method: str, route: str) -> bool:
        """Whether a request to ``route`` must carry the bearer token: a write, with a token set."""
        return (
            self.service.config.auth_token is not None
            and method in ("POST", "DELETE", "PUT", "PATCH")
            and route not in OPEN_ROUTES
        )

    def bearer_ok(self, authorization: str) -> bool:
        """``authorization`` (the header's value) carries the service's token, compared in constant time."""
        token = self.service.config.auth_token
        assert token is not None
        scheme, _, value = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())

    def failure(self, exc: Exception, route: str) -> tuple[int, str]:
        """(status, message) of a request that raised ``exc``: ``ServiceError`` its status, engine not up
        503, bad input 400, anything else 500, logged with its traceback."""
        if isinstance(exc, ServiceError):
            return exc.status, str(exc)
        if isinstance(exc, EngineError):  # not up yet (see /ready), or closing
            return 503, f"engine: {exc}"
        if isinstance(exc, (KvRouterError, ValueError)):
            return 400, str(exc)
        log.error("request failed route=%s kind=%s", route, type(exc).__name__, exc_info=exc)
        return 500, f"internal error ({type(exc).__name__})"

    def count(self, route: str, method: str, status: int, started: float) -> None:
        """One answered request in the per-route counters ``/metrics`` shows."""
        counters = self.service.counters
        key = (route, method)
        counters.http_requests[key] = counters.http_requests.get(key, 0) + 1
        counters.http_seconds[key] = counters.http_seconds.get(key, 0.0) + time.perf_counter() - started
        if status >= 400:
            klass = (route, "4xx" if status < 500 else "5xx")
            counters.http_errors[klass] = counters.http_errors.get(klass, 0) + 1

    async def _body(self, request: web.Request) -> dict[str, Any]:
        return parse_body(await request.read())

    def _with_index(self, body: dict[str, Any], status: int = 200) -> web.Response:
        body["index"] = self.service._index
        return _json(body, status, self.service._index_headers)

    async def _h_health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok", "stopping": self.service._stopping})

    async def _h_ready(self, request: web.Request) -> web.Response:
        ok, body = self.service.ready()
        return _json(body, 200 if ok else 503)

    async def _h_register(self, request: web.Request) -> web.Response:
        status, answer = await self.service.control("register", await self._body(request))
        return _json(answer, status)

    async def _h_unregister(self, request: web.Request) -> web.Response:
        status, answer = await self.service.control("unregister", await self._body(request))
        return _json(answer, status)

    async def _h_workers(self, request: web.Request) -> web.Response:
        model = request.query.get("model_name")
        group = request.query.get("routing_group")
        out = []
        for partition in self.service.partitions.values():
            if model not in (None, partition.model_name) or group not in (None, partition.routing_group):
                continue
            for instance in partition.instances.values():
                out.append(self._worker_json(partition, instance))
        return _json(out, headers=self.service._index_headers)

    def _worker_json(self, partition: Partition, instance: Instance) -> dict[str, Any]:
        listeners: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        for rank, endpoint in sorted(instance.ranks.items()):
            key = (instance.instance_id, rank)
            stats = self.service._streams.get(key)
            if key in partition.unhealthy:
                skipped[str(rank)] = partition.unhealthy[key]
            if partition.approx is not None:
                listeners[str(rank)] = {"endpoint": endpoint, "status": "approximate"}
                continue
            if stats is None:
                listeners[str(rank)] = {"endpoint": endpoint, "status": "pending"}
                continue
            trust = self.service.trust
            listeners[str(rank)] = {
                "endpoint": endpoint,
                "status": "active" if stats.state in ("exact", "partial") else "pending",
                "trust": trust.state(key),
                "problems": trust.problems(key),
                "state": stats.state,
                "stale": stats.stale,
                "cached_blocks": stats.cached_blocks,
                "cached_by_tier": dict(stats.cached_by_tier),
                "last_id": stats.last_id,
                "gaps_detected": stats.gaps_detected,
                "gaps_recovered": stats.gaps_recovered,
                "gaps_lost": stats.gaps_lost,
                "restarts": stats.restarts,
                "events": stats.events,
                "last_event_at": stats.last_event_ns / 1e9 if stats.last_event_ns else None,
                "evicted": dict(stats.evicted),
            }
            if evicted := sum(stats.evicted.values()):
                listeners[str(rank)]["note"] = (
                    f"{evicted} blocks evicted by --max-index-blocks: the index holds less than this worker's "
                    "cache on purpose (every event is still accounted; the trust state is unchanged)"
                )
        status = "active"
        if skipped:
            status = "unhealthy" if len(skipped) == len(instance.ranks) else "degraded"
        return {
            "instance_id": instance.instance_id,
            "source": "zmq" if partition.approx is None else "approximate",
            "status": status,
            "model_name": partition.model_name,
            "routing_group": partition.routing_group,
            "block_size": partition.block_size,
            "format": instance.format,
            "endpoints": {str(rank): ep for rank, ep in sorted(instance.ranks.items())},
            "replay_endpoint": instance.replay_endpoint,
            "http_endpoint": instance.http_endpoint,
            "address": address(instance.http_endpoint),
            "listeners": listeners,
            "skipped": skipped,
            "accuracy": {
                str(rank): view
                for rank in sorted(instance.ranks)
                if (view := self.service.accuracy.view((instance.instance_id, rank))) is not None
            },
        }

    async def _h_query(self, request: web.Request) -> web.Response:
        query = parse_query(await self._body(request), by_hash=False)
        partition = self.service.partition(query.model_name, query.routing_group)
        assert query.token_ids is not None
        local = block_hashes_array(
            query.token_ids, partition.block_size, lora_name=query.lora_name, cache_namespace=query.cache_salt
        )
        return self._with_index(self.service._query(partition, local))

    async def _h_query_by_hash(self, request: web.Request) -> web.Response:
        query = parse_query(await self._body(request), by_hash=True)
        partition = self.service.partition(query.model_name, query.routing_group)
        local = np.array(query.block_hashes or (), dtype=np.uint64)
        return self._with_index(self.service._query(partition, local))

    def _select_head(self, partition: Partition, worker: WorkerKey, endpoint: str | None, address: str | None) -> bytes:
        """The answer's opening members up to ``"overlap":{"longest_matched":``, built once per
        (partition, worker, endpoint): everything in it is fixed by that key, so the cache needs no
        invalidation (it is only bounded)."""
        key = (partition.model_name, partition.routing_group, partition.block_size, worker, endpoint)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= HEADS_CACHED:
                self._heads.clear()
            opening = {
                "model_name": partition.model_name,
                "routing_group": partition.routing_group,
                "worker_id": worker[0],
                "dp_rank": worker[1],
                "endpoint": endpoint,
                "address": address,
                "block_size": partition.block_size,
            }
            head = orjson.dumps(opening)[:-1] + b',"overlap":{"longest_matched":'
            self._heads[key] = head
        return head

    def select_payload(self, result: SelectResult, request: SelectRequest, started: float) -> tuple[bytes, str | None]:
        """``/select``'s answer body and its ``X-Gateway-Destination-Endpoint`` (None: no address), timed as
        the ``serialise`` phase, and ``total`` since ``started`` (the request's first byte read). The
        common case (no ``explain``, no ``fallbacks``) is spliced from preassembled bytes: the cached head,
        a few numbers, and the index summary encoded once per refresh; it is byte for byte what
        ``answers.select_json`` + ``orjson`` give (``test_api``), without the two nested dicts per request.
        The rest goes through ``answers.select_json``."""
        serialising = time.perf_counter()
        if request.explain or request.fallbacks or result.selection.explanation is not None:
            body = select_json(result, request)
            body["index"] = self.service._index
            payload = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
        else:
            selection = result.selection
            partition = result.partition
            device = selection.overlap_blocks * partition.block_size
            if self._index_json[0] is not self.service._index:
                self._index_json = (self.service._index, orjson.dumps(self.service._index))
            sid = b"" if result.selection_id is None else b',"selection_id":' + orjson.dumps(result.selection_id)
            payload = b"".join(
                (
                    self._select_head(partition, selection.worker, result.endpoint, result.address),
                    b'%d,"gpu":%d,"dp":{"%d":%d},"cpu":%d,"disk":%d},"effective_prefill_tokens":%d,'
                    b'"potential_decode_blocks":%d,"isl_tokens":%d,"cost":'
                    % (
                        device,
                        device,
                        selection.worker[1],
                        device,
                        device,
                        device,
                        max(0, selection.isl_tokens - device),
                        selection.cost.decode_blocks,
                        selection.isl_tokens,
                    ),
                    orjson.dumps(selection.cost.total),
                    sid,
                    b',"index":',
                    self._index_json[1],
                    b"}",
                )
            )
        gateway = result.address
        if gateway is not None and result.fallbacks:
            instances = result.partition.instances
            gateway = ",".join(
                [gateway, *(a for k, _ in result.fallbacks if (a := address(instances[k[0]].http_endpoint)))]
            )
        done = time.perf_counter()
        phases = self.service.counters.phases
        phases["serialise"].observe(done - serialising)
        phases["total"].observe(done - started)
        return payload, gateway

    def select_request(self, raw: bytes, session: str | None, started: float) -> SelectRequest:
        """The validated ``/select`` body, its session id from the reference's header when the body has none;
        timed as the ``parse`` phase since ``started``."""
        select = fastparse.fast_select(raw)  # token ids straight into uint32 (fastparse.py)
        if select is None:
            select = parse_select(parse_body(raw))  # every other shape, and every error
        if select.session_id is None and session:
            select = dataclasses.replace(select, session_id=session[:MAX_ID])  # the reference's header
        self.service.counters.phases["parse"].observe(time.perf_counter() - started)
        return select

    async def _select_route(self, request: web.Request, *, reserve: bool) -> web.Response:
        started = time.perf_counter()
        select = self.select_request(await request.read(), request.headers.get(SESSION_HEADER), started)
        result = await self.service.select_or_wait(select, reserve=reserve, gone=client_gone(request))  # queue.py
        payload, gateway = self.select_payload(result, select, started)
        if self._json_headers[0] is not self.service._index_headers:
            headers = CIMultiDict(self.service._index_headers)
            headers[hdrs.CONTENT_TYPE] = JSON
            self._json_headers = (self.service._index_headers, headers)
        response = web.Response(body=payload, headers=self._json_headers[1])  # aiohttp copies the headers
        if gateway is not None:
            response.headers[GATEWAY_HEADER] = gateway
        return response

    async def _h_select(self, request: web.Request) -> web.Response:
        return await self._select_route(request, reserve=False)

    async def _h_select_and_reserve(self, request: web.Request) -> web.Response:
        return await self._select_route(request, reserve=True)

    def prefill_complete(self, selection_id: str, raw: bytes) -> None:
        """``/reservations/{id}/prefill_complete`` with its body: optional ``{"cached_tokens": n}``, what the
        engine reused (accuracy.py)."""
        reused = cached_tokens(parse_body(raw)) if raw.strip() else None
        self.service.prefill_complete(selection_id, reused)

    async def _h_prefill_complete(self, request: web.Request) -> web.Response:
        selection_id = request.match_info["id"]
        await self.service.hear_of(selection_id)  # a peer's booking may still be on its way (SYNC_GRACE_S)
        self.prefill_complete(selection_id, await request.read())
        return _json(OK)

    async def _h_free(self, request: web.Request) -> web.Response:
        selection_id = request.match_info["id"]
        await self.service.hear_of(selection_id)
        self.service.free(selection_id)
        return _json(OK)

    async def _h_loads(self, request: web.Request) -> web.Response:
        out = []
        for name, partition in self.service.partitions.items():
            slots = partition.slots
            loads = [
                {
                    "worker_id": key[0],
                    "dp_rank": key[1],
                    "potential_prefill_tokens": slots.active_prefill_tokens(key),
                    "potential_decode_blocks": slots.active_blocks(key),
                    "active_requests": slots.active_requests(key),
                    "recent_prefill_tokens": round(slots.recent_prefill_tokens(key), 3),
                    "schedulable": key not in partition.unhealthy,
                }
                for key in partition.worker_keys()
            ]
            pending = self.service.pending(*name)  # queue.py
            out.append(
                {
                    "model_name": partition.model_name,
                    "routing_group": partition.routing_group,
                    "loads": loads,
                    "pending_count": pending[0],
                    "pending_isl_tokens": pending[1],
                }
            )
        return _json(out, headers=self.service._index_headers)

    async def _h_dump(self, request: web.Request) -> web.Response:
        encoder = Encoder()
        out: dict[str, Any] = {}
        for partition in self.service.partitions.values():
            events: list[Any] = []
            if partition.approx is not None:
                events = [
                    {
                        "worker_id": e.worker_id,
                        "storage_tier": "device",
                        "event": orjson.loads(encoder.encode_event(e)),
                    }
                    for e in partition.approx.dump()
                ]
            out[partition.name] = {
                "block_size": partition.block_size,
                "events": events,
                "complete": partition.approx is not None,
            }
        return _json(out, headers=self.service._index_headers)

    async def _h_busy_get(self, request: web.Request) -> web.Response:
        return _json({"thresholds": [p.thresholds() for p in self.service.partitions.values()]})

    async def _h_busy_set(self, request: web.Request) -> web.Response:
        status, answer = await self.service.control("busy", await self._body(request))
        return _json(answer, status)

    def _since(self, request: web.Request) -> int:
        raw = request.query.get("since", "0")
        try:
            return int(raw)
        except ValueError as exc:
            raise ServiceError(400, f"since: expected an integer, got {raw!r}") from exc

    @staticmethod
    def _after(ring: Iterable[dict[str, Any]], since: int) -> list[dict[str, Any]]:
        return [entry for entry in ring if entry["seq"] > since]

    async def _h_decisions(self, request: web.Request) -> web.Response:
        since = self._since(request)
        return _json({"last": self.service._decision_seq, "decisions": self._after(self.service.decisions, since)})

    async def _h_decision(self, request: web.Request) -> web.Response:
        answer = await self.service.decision(request.match_info["selection_id"])
        if answer is None:
            raise ServiceError(404, "no decision of that id is kept (never made, or older than the ring holds)")
        return _json(answer)

    async def _h_events(self, request: web.Request) -> web.Response:
        since = self._since(request)
        return _json({"last": self.service._event_seq, "events": self._after(self.service.events, since)})
