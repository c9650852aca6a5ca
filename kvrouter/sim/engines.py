"""The simulated engines of a run and its event loop in virtual time: what both simulators share.

``simulator.py`` (an aggregated fleet) and ``disagg.py`` (prefill and decode workers) differ in what an
arrival does and in what an iteration's end means; the engines' stepping, the skipped decode stretches,
the KV events' delivery and the ordered heap of events are this one loop. Events at one instant run in
kind order: an iteration ends, then lagged KV events are delivered, then transfers land, then requests
arrive, then idle workers start; equal kinds in the order they were made.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from ..events.model import KvEvent
from ..index import RadixIndex
from ..worker import Iteration, WorkerModel
from .policy import Request

__all__ = ["ARRIVAL", "DELIVERY", "ITERATION_END", "LANDED", "START", "Engines", "arrival_order"]

ITERATION_END = 0
DELIVERY = 1
LANDED = 2
ARRIVAL = 3
START = 4
"""Event kinds, in the order they run when simultaneous."""

Payload = Iteration | list[KvEvent] | int | None


def arrival_order(requests: Sequence[Request]) -> tuple[dict[str, int], list[int]]:
    """Each request's position by its id, and the positions in arrival order (ties in the given order).

    Raises:
        ValueError: two requests with one id.
    """
    position = {request.request_id: i for i, request in enumerate(requests)}
    if len(position) != len(requests):
        raise ValueError("request ids must be unique within a run")
    return position, sorted(range(len(requests)), key=lambda i: requests[i].arrival)


class Engines:
    """The engines of one run, the index their KV events feed, and the heap of what happens next.

    Args:
        models: the engines; worker ``i`` is ``models[i]``.
        index: fed each engine's KV events, ``event_lag_ms`` after they happen.
    """

    def __init__(self, models: Sequence[WorkerModel], index: RadixIndex, event_lag_ms: float) -> None:
        self.models = models
        self.index = index
        self.event_lag_ms = event_lag_ms
        self.now = 0.0
        """Simulated milliseconds."""
        count = len(models)
        self.busy = [False] * count
        """A worker has an iteration running or a start queued."""
        self.ends = [math.inf] * count
        """When each worker's running iteration (or skipped stretch) ends; inf between them."""
        self.itl_values: list[float] = []
        self.itl_weights: list[int] = []
        self.kv_area = [0.0] * count
        """Each worker's active KV blocks integrated over time (block-milliseconds)."""
        self._heap: list[tuple[float, int, int, int, Payload]] = []
        self._tiebreak = 0

    def push(self, at: float, kind: int, worker: int, payload: Payload) -> None:
        heapq.heappush(self._heap, (at, kind, self._tiebreak, worker, payload))
        self._tiebreak += 1

    def deliver(self, worker: int, events: list[KvEvent]) -> None:
        """``worker``'s KV events reach the index: now, or after the lag."""
        if not events:
            return
        if self.event_lag_ms:
            self.push(self.now + self.event_lag_ms, DELIVERY, worker, events)
        else:
            for event in events:
                self.index.apply_event(worker, event)

    def wake(self, worker: int) -> None:
        """A request reached ``worker``: it starts an iteration now unless one is running or queued."""
        if not self.busy[worker]:
            self.busy[worker] = True
            self.push(self.now, START, worker, None)

    def start(self, worker: int, bound: float) -> None:
        """``worker``'s next iteration, or a decode-only stretch of them that stops at the first boundary at or
        after ``bound`` (the next moment a request may reach it), or idleness."""
        now, model = self.now, self.models[worker]
        if not model.has_work():
            self.busy[worker] = False
            return
        if model.decode_only() and (skip := model.next_event_steps() - 1) > 0:
            step_ms = model.decode_step_ms()
            if bound < math.inf:
                skip = min(skip, max(1, math.ceil((bound - now) / step_ms)))
            tokens = skip * model.num_decoding
            duration = model.fast_forward(skip)
            self.itl_values.append(step_ms)
            self.itl_weights.append(tokens)
            self.kv_area[worker] += model.kv.active_blocks * duration
            self.ends[worker] = now + duration
            self.push(now + duration, ITERATION_END, worker, None)
            return
        iteration = model.step()
        if iteration.decode_tokens:
            self.itl_values.append(iteration.duration_ms)
            self.itl_weights.append(iteration.decode_tokens)
        self.kv_area[worker] += model.kv.active_blocks * iteration.duration_ms
        self.ends[worker] = now + iteration.duration_ms
        self.push(now + iteration.duration_ms, ITERATION_END, worker, iteration)

    def run(
        self,
        arrivals: Sequence[float],
        arrive: Callable[[int], None],
        ended: Callable[[int, Iteration | None], None],
        *,
        landed: Callable[[int, int], None] | None = None,
        bound: Callable[[int, float], float] | None = None,
        clock: Callable[[float], None] | None = None,
    ) -> None:
        """Run until nothing is left to happen.

        Args:
            arrivals: arrival times (ms), ascending; ``arrive(k)`` is called for the k-th at its time.
            ended: an iteration (or a skipped stretch: None) of a worker ended; the worker starts again after.
            landed: a ``LANDED`` event's worker and payload (``disagg.py``'s transfers).
            bound: the time a worker's skipped stretch must stop at, given the next arrival; the next arrival
                when None.
            clock: told each new time (seconds), before the event at it runs.
        """
        heap, ends = self._heap, self.ends
        position = 0
        while True:  # hot path: one pass per event
            next_arrival = arrivals[position] if position < len(arrivals) else math.inf
            if heap and (heap[0][0], heap[0][1]) < (next_arrival, ARRIVAL):
                now, kind, _, worker, payload = heapq.heappop(heap)
                self.now = now
                if clock is not None:
                    clock(now / 1000.0)
                if kind == START:
                    self.start(worker, next_arrival if bound is None else bound(worker, next_arrival))
                elif kind == ITERATION_END:
                    ends[worker] = math.inf
                    ended(worker, payload if isinstance(payload, Iteration) else None)
                    self.push(now, START, worker, None)
                elif kind == LANDED:
                    assert landed is not None
                    assert isinstance(payload, int)
                    landed(worker, payload)
                else:
                    assert isinstance(payload, list)
                    for event in payload:
                        self.index.apply_event(worker, event)
            elif position < len(arrivals):
                self.now = next_arrival
                if clock is not None:
                    clock(next_arrival / 1000.0)
                arrive(position)
                position += 1
            else:
                return
