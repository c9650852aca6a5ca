"""``Tracing``: OpenTelemetry spans of the requests the router forwards, exported over OTLP/HTTP.

With ``--otlp-endpoint URL`` (the collector's base, as ``OTEL_EXPORTER_OTLP_ENDPOINT``) every request
through the proxy's routes (``/v1/completions``, ``/v1/chat/completions``) is one span, with three
children:

- ``queue``: the time it waited in the router queue (0 when it did not wait);
- ``decision``: the router's decision, its attributes the chosen worker and rank, its overlap, its cost
  terms, the runner-up and its cost, and the ``selection_id``;
- ``upstream``: the call to the engine, from the request sent to the answer's end (both hops of a split
  request).

A client's W3C ``traceparent`` (and ``tracestate``) is taken up: the request's span is its child. The
engine gets a ``traceparent`` naming the ``upstream`` span, so its own spans hang under the router's.
Spans go out in batches, flushed every second (``FLUSH_MS``), as ``application/x-protobuf`` POSTs to
URL + ``/v1/traces``, by the SDK's exporter, on its own thread.

**Off by default, and free when off**: nothing is imported, no thread starts, and the proxy asks one
attribute per request. **Started on first use**, on the event loop: the exporter's thread must not exist
when the service forks its appliers. Rejected: spans on ``/select`` too (its clients trace their own
requests, and the hot lane would pay per request), and a hand-written OTLP encoder (the SDK is the
standard's own, and an operator's collector speaks it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

if TYPE_CHECKING:
    from ..core.decision import Decision

__all__ = ["FLUSH_MS", "RequestTrace", "Tracing"]

FLUSH_MS: Final = 1000
"""The batch processor's schedule: spans reach the collector within about a second (the issue: 5 s)."""
SERVICE_NAME: Final = "kvrouter"


class RequestTrace:
    """The spans of one forwarded request: its own and its children's, ended in order."""

    def __init__(self, tracer: Any, span: Any, context: Any) -> None:
        self._tracer = tracer
        self.span = span
        self._context = context
        self._upstream: Any = None

    def _child(self, name: str, start_ns: int) -> Any:
        return self._tracer.start_span(name, context=self._context, start_time=start_ns)

    def decided(self, decision: Decision, asked_ns: int, answered_ns: int) -> None:
        """The queue wait and the decision, from when the router queue was asked to when it answered."""
        decided_ns = answered_ns - int(decision.elapsed * 1e9)
        queue = self._child("queue", asked_ns)
        queue.end(end_time=max(asked_ns, decided_ns))
        span = self._child("decision", max(asked_ns, decided_ns))
        selection = decision.selection
        cost = selection.cost
        attributes: dict[str, Any] = {
            "kvrouter.selection_id": decision.selection_id or "",
            "kvrouter.model": decision.partition.model_name,
            "kvrouter.worker_id": selection.worker[0],
            "kvrouter.dp_rank": selection.worker[1],
            "kvrouter.overlap_blocks": selection.overlap_blocks,
            "kvrouter.isl_tokens": selection.isl_tokens,
            "kvrouter.cost": cost.total,
            "kvrouter.cost.prefill": cost.prefill_cost,
            "kvrouter.cost.decode_blocks": cost.decode_blocks,
            "kvrouter.cost.overlap_credit_blocks": cost.overlap_credit_blocks,
            "kvrouter.cost.work_factor": cost.work_factor,
        }
        if decision.fallbacks:
            (runner_id, runner_rank), runner_cost = decision.fallbacks[0]
            attributes |= {
                "kvrouter.runner_up.worker_id": runner_id,
                "kvrouter.runner_up.dp_rank": runner_rank,
                "kvrouter.runner_up.cost": runner_cost,
            }
        if decision.split is not None and decision.split.prefill is not None:
            attributes["kvrouter.prefill_worker_id"] = decision.split.prefill.worker[0]
        span.set_attributes(attributes)
        span.end(end_time=answered_ns)

    def upstream(self, headers: dict[str, str]) -> dict[str, str]:
        """Start the engine call's span; ``headers`` plus the ``traceparent`` naming it."""
        from opentelemetry import trace
        from opentelemetry.propagate import inject

        if self._upstream is not None:  # a retry: the refused call's span ends here
            self._upstream.end(end_time=time.time_ns())
        self._upstream = self._child("upstream", time.time_ns())
        carrier = dict(headers)
        inject(carrier, context=trace.set_span_in_context(self._upstream))
        return carrier

    def end(self, status: int) -> None:
        """The request is answered with ``status``; every span still open ends now."""
        self.span.set_attribute("http.response.status_code", status)
        self._close()

    def failed(self, exc: BaseException) -> None:
        """The request failed before an answer (a refusal the edge turns into a status, or a cancellation)."""
        from opentelemetry.trace import Status, StatusCode

        self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        self._close()

    def _close(self) -> None:
        now = time.time_ns()
        if self._upstream is not None:
            self._upstream.end(end_time=now)
            self._upstream = None
        self.span.end(end_time=now)


class Tracing:
    """The service's tracer (see the module docstring): None of it exists until the first request."""

    def __init__(self, endpoint: str | None) -> None:
        self.endpoint = endpoint
        self._provider: Any = None
        self._tracer: Any = None

    def _start(self) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        assert self.endpoint is not None
        exporter = OTLPSpanExporter(endpoint=self.endpoint.rstrip("/") + "/v1/traces")
        provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=FLUSH_MS))
        self._provider = provider
        self._tracer = provider.get_tracer("kvrouter")

    def request(self, request: web.Request, route: str) -> RequestTrace | None:
        """A request's trace, its span started now under the client's ``traceparent``; None when off."""
        if self.endpoint is None:
            return None
        if self._tracer is None:
            self._start()
        from opentelemetry import trace
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind

        parent = extract(dict(request.headers))
        span = self._tracer.start_span(
            f"POST {route}", context=parent, kind=SpanKind.SERVER, attributes={"http.route": route}
        )
        return RequestTrace(self._tracer, span, trace.set_span_in_context(span))

    def close(self) -> None:
        """Flush what is batched and stop the exporter's thread (the service stops)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = self._tracer = None
