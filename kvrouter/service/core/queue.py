"""The router queue (``--router-queue-threshold``, ``--router-queue-policy``): overloaded requests wait.

Without it, a request that finds every candidate of its partition over a busy threshold is refused with
``overload_status`` (529). With it, the request waits in its partition's queue and is decided as soon as
the load allows, in the policy's order — Dynamo's ``SchedulerQueue``
(``lib/kv-router/src/scheduling/queue.rs``; ``spec/dynamo-semantics.md`` §4.4):

- **When a request waits.** When every candidate is busy (kvrouter's busy thresholds: the router's
  ``active_decode_blocks_threshold`` / ``active_prefill_tokens_threshold``, adjustable through
  ``/busy_threshold``), *or* when the partition's queue already holds requests: the reference's
  "backlog anti-bypass" (``should_queue = has_backlog || all_workers_busy``), so a newcomer never
  overtakes a request that was there first.
- **Order.** First by **priority class** (kvrouter's, issue 36): a request's ``priority``, vLLM's meaning
  (an integer, lower first, 0 by default; ``priority`` in a proxied body or ``X-Kvrouter-Priority``).
  **Ageing** (``--router-queue-priority-age-secs``, 10 s) lowers a waiting request's class by one per
  interval it has waited, so a low class is never starved: a request of class 2 competes as class 1
  after 10 s, as class 0 after 20 s. Within a class, highest key first, ties by arrival (§4.4): ``fcfs``
  keys a request by ``priority_jump - arrival_offset`` (earliest first), ``wspt`` (weighted shortest
  processing time) by ``(1 + priority_jump) / isl_tokens`` (shortest prompt first; the weight is 1 + the
  priority jump); ``priority_jump`` is 0 (no kvrouter request carries one), so the orders are arrival and
  prompt length. Each class is a heap; a request that ages moves to the next class's heap when its
  interval ends (a heap of those times), so the head is found in O(log n) and no scan of the waiting
  requests ever runs. Rejected: the effective class computed per waiter at every retry (a scan of the
  whole queue per decision: quadratic in a long queue's drain).
- **When waiting requests are retried.** On every change that can lower a partition's load or widen its
  candidates: a reservation freed, a prefill completed, a worker registered or unregistered, thresholds
  moved by ``/busy_threshold``; and on every health tick (``health_interval_secs``; reservations expire
  there). The head is retried first and the retrying stops at the first head still overloaded — the
  reference's head-of-line blocking (``pop_next`` with the all-busy check), which is what keeps the
  order: a short request behind a long head never jumps it under ``fcfs``.
- **Bounds.** The reference's queue is unbounded (its ``router_queue_threshold`` is the prefill-busy
  fraction ``active_prefill_tokens > threshold * max_num_batched_tokens``; only later versions' policy
  classes reject with ``queue_rejected``). kvrouter's workers register no ``max_num_batched_tokens``, so
  the busy test is the busy thresholds above, and the threshold is the queue's depth per partition: a
  request that finds ``queue_threshold`` requests waiting is refused with ``overload_status`` at once —
  a bound a front on one event loop needs (every waiter holds a connection). A request waits at most
  ``queue_timeout_secs`` (60 s by default, the reference's own dequeue timeout elsewhere); then it is
  refused with ``overload_status`` (the workers are still busy). If its partition loses its last
  schedulable worker while it waits, it gets the 503 a fresh request would get.
- **Clients that leave.** A waiter whose client closed its connection is dropped at the next health
  tick, and never decided for: nothing is booked for it. A handler cancelled while it waits leaves the
  queue at once; one cancelled after its decision frees the reservation it was given.

Every transition (decided, refused, timed out, dropped) happens on the service's event loop, in this
module, so a waiter is resolved exactly once: a timer racing a decision cannot lose a booked
reservation, which ``asyncio.wait_for`` around the waiter's future could (the decision lands, the
timeout cancels the handler before it sees the result). Rejected alternative: one asyncio task per
partition draining an ``asyncio.PriorityQueue`` — it adds a hand-off per decision and cannot skip a
waiter whose client left without popping it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Generic, Literal, TypeVar

from ...errors import ClientGone, Overloaded, ServiceError, Stopping
from .histogram import Buckets

if TYPE_CHECKING:
    from .counters import ServiceCounters
    from .decider import Decider
    from .decision import Decision
    from .partition import Partition
    from .requests import SelectRequest

__all__ = ["POLICIES", "WAIT_BUCKETS", "PendingQueue", "QueuePolicy", "RouterQueue", "Ticket", "queue_key"]

log = logging.getLogger(__name__)

WAIT_BUCKETS: Final = tuple(0.001 * 2**n for n in range(17))
"""Queue wait buckets [s]: 1 ms doubling to 65 s (the default timeout is 60 s)."""

QueuePolicy = Literal["fcfs", "wspt"]
POLICIES: Final[tuple[QueuePolicy, ...]] = ("fcfs", "wspt")
T = TypeVar("T")


def queue_key(policy: QueuePolicy, *, priority_jump: float, arrival_offset: float, isl_tokens: int) -> float:
    """The reference's ordering key (``spec/dynamo-semantics.md`` §4.4); the highest is served first.

    ``fcfs``: ``priority_jump - arrival_offset``. ``wspt``: ``(1 + priority_jump) / isl_tokens`` (an empty
    prompt counts as one token).
    """
    if policy == "fcfs":
        return priority_jump - arrival_offset
    return (1.0 + priority_jump) / max(isl_tokens, 1)


@dataclass(slots=True, eq=False)
class Ticket(Generic[T]):
    """One entry of a :class:`PendingQueue`; ``item`` is the caller's."""

    item: T
    isl_tokens: int
    key: float
    seq: int
    priority: int = 0
    """The request's own class (what ``/metrics`` counts it under)."""
    klass: int = 0
    """Its class now: ``priority`` less the intervals it has waited."""
    arrived: float = 0.0
    """The queue clock when it was pushed."""
    queued: bool = True


class PendingQueue(Generic[T]):
    """The policy-ordered waiting line of one partition: a heap with lazy removal.

    Pure data (no asyncio), so the orders are tested with an injected clock. ``pending_count`` and
    ``pending_isl_tokens`` are what ``/loads`` reports (the reference's ``potential_loads`` fields).
    """

    def __init__(
        self,
        policy: QueuePolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        age_secs: float | None = None,
    ) -> None:
        """``age_secs``: the ageing interval (one class per interval waited); None: classes never age."""
        if policy not in POLICIES:
            raise ValueError(f"queue policy must be one of {POLICIES}, got {policy!r}")
        if age_secs is not None and not age_secs > 0:
            raise ValueError(f"age_secs must be > 0 or None, got {age_secs!r}")
        self.policy: QueuePolicy = policy
        self.age_secs = age_secs
        self._clock = clock
        self._start = clock()
        self._classes: dict[int, list[tuple[float, int, Ticket[T]]]] = {}
        """Class -> heap of (-key, seq, ticket); an entry whose ticket left or moved on is skipped."""
        self._ageing: list[tuple[float, int, Ticket[T]]] = []
        """(when the ticket moves up a class, seq, ticket)."""
        self._seq = itertools.count()
        self.pending_count = 0
        self.pending_isl_tokens = 0
        self.by_priority: dict[int, int] = {}
        """Waiting tickets per own priority (``/metrics``' ``kvrouter_queue_pending_by_priority``)."""

    def __len__(self) -> int:
        return self.pending_count

    def push(self, item: T, *, isl_tokens: int, priority: int = 0, priority_jump: float = 0.0) -> Ticket[T]:
        arrival = self._clock() - self._start
        key = queue_key(self.policy, priority_jump=priority_jump, arrival_offset=arrival, isl_tokens=isl_tokens)
        ticket = Ticket(item, isl_tokens, key, next(self._seq), priority, priority, arrival)
        heapq.heappush(self._classes.setdefault(priority, []), (-key, ticket.seq, ticket))
        if self.age_secs is not None:
            heapq.heappush(self._ageing, (arrival + self.age_secs, ticket.seq, ticket))
        self.pending_count += 1
        self.pending_isl_tokens += isl_tokens
        self.by_priority[priority] = self.by_priority.get(priority, 0) + 1
        return ticket

    def _age(self) -> None:
        """Move every ticket whose interval ended up a class, as often as it has waited intervals."""
        ageing, step = self._ageing, self.age_secs
        if not ageing or step is None:
            return
        now = self._clock() - self._start
        while ageing and ageing[0][0] <= now:
            due, seq, ticket = heapq.heappop(ageing)
            if not ticket.queued:
                continue
            ticket.klass -= 1
            heapq.heappush(self._classes.setdefault(ticket.klass, []), (-ticket.key, seq, ticket))
            heapq.heappush(ageing, (due + step, seq, ticket))

    def peek(self) -> Ticket[T] | None:
        """The next ticket to serve, or None: the best key of the lowest class now."""
        self._age()
        for klass in sorted(self._classes):
            heap = self._classes[klass]
            while heap and (not heap[0][2].queued or heap[0][2].klass != klass):
                heapq.heappop(heap)
            if heap:
                return heap[0][2]
            del self._classes[klass]
        return None

    def pop(self) -> Ticket[T] | None:
        ticket = self.peek()
        if ticket is not None:
            heapq.heappop(self._classes[ticket.klass])
            self._unqueue(ticket)
        return ticket

    def remove(self, ticket: Ticket[T]) -> bool:
        """Take a ticket out wherever it is; False when it had left already."""
        if not ticket.queued:
            return False
        self._unqueue(ticket)
        return True

    def tickets(self) -> list[Ticket[T]]:
        """The queued tickets, in no particular order, each in its class now."""
        self._age()
        return [t for klass, heap in self._classes.items() for _, _, t in heap if t.queued and t.klass == klass]

    def _unqueue(self, ticket: Ticket[T]) -> None:
        ticket.queued = False
        self.pending_count -= 1
        self.pending_isl_tokens -= ticket.isl_tokens
        left = self.by_priority[ticket.priority] - 1
        if left:
            self.by_priority[ticket.priority] = left
        else:
            del self.by_priority[ticket.priority]


@dataclass(slots=True, eq=False)
class _Waiter:
    request: SelectRequest
    reserve: bool
    future: asyncio.Future[Decision]
    gone: Callable[[], bool] | None
    since: float = 0.0
    timer: asyncio.TimerHandle | None = None
    queue: PendingQueue[_Waiter] | None = field(default=None, repr=False)


class RouterQueue:
    """The service's queues, one :class:`PendingQueue` per (model, routing group); see the module docstring.

    The one way in to a decision for every edge: :meth:`select` waits when the partition is overloaded (and
    ``threshold`` is set), :meth:`select_now` never waits. Either counts a refusal for overload once, when
    it is final. Used on the service's event loop only.
    """

    def __init__(
        self,
        decider: Decider,
        counters: ServiceCounters,
        *,
        threshold: int | None,
        policy: QueuePolicy,
        timeout_secs: float,
        age_secs: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.decider = decider
        self.counters = counters
        self.threshold = threshold
        self.policy: QueuePolicy = policy
        self.timeout_secs = timeout_secs
        self.age_secs = age_secs
        """The priority classes' ageing interval (``--router-queue-priority-age-secs``); None: no ageing."""
        self.waits: dict[int, Buckets] = {}
        """Per priority: how long its decided waiters waited [s] (``kvrouter_router_queue_wait_seconds``)."""
        self._clock = clock
        self._queues: dict[tuple[str, str], PendingQueue[_Waiter]] = {}
        self._scheduled: set[tuple[str, str]] = set()
        self.queued_total = 0
        """Requests that waited (decided later, refused later, or dropped)."""
        self.timed_out = 0
        self.rejected_full = 0
        self.dropped_gone = 0

    # -- what /loads and /metrics read ------------------------------------------------------

    def pending(self, model: str, group: str) -> tuple[int, int]:
        """(pending_count, pending_isl_tokens) of the partition's queue."""
        queue = self._queues.get((model, group))
        return (queue.pending_count, queue.pending_isl_tokens) if queue is not None else (0, 0)

    def pending_by_priority(self, model: str, group: str) -> dict[int, int]:
        """The partition's waiting requests per priority."""
        queue = self._queues.get((model, group))
        return dict(queue.by_priority) if queue is not None else {}

    # -- the entry -----------------------------------------------------------------------------

    def select_now(self, request: SelectRequest, *, reserve: bool) -> Decision:
        """Decide now, without waiting (an edge that cannot wait, or no queue); a refusal for overload counted.

        Raises:
            ServiceError: what ``Decider.select`` raises.
        """
        try:
            return self.decider.select(request, reserve=reserve)
        except Overloaded:
            self.counters.overloaded += 1
            raise

    async def select(
        self, request: SelectRequest, *, reserve: bool, gone: Callable[[], bool] | None = None
    ) -> Decision:
        """Decide, or wait in the partition's queue when it is overloaded (or has a backlog); ``gone()`` tells
        whether the client left meanwhile.

        Raises:
            ServiceError: what ``Decider.select`` raises. Overloaded: the queue is full or the wait lapsed.
            Stopping: the service stops meanwhile. Unavailable: the partition lost its last worker meanwhile.
            ClientGone: the client left while it waited.
        """
        if self.threshold is None:
            return self.select_now(request, reserve=reserve)
        key = (request.model_name, request.routing_group)
        queue = self._queues.get(key)
        refusal: Overloaded
        if not queue:  # no backlog: the fast path, unchanged
            try:
                return self.decider.select(request, reserve=reserve)
            except Overloaded as exc:
                refusal = exc
        else:
            partition = self.decider.registry.partition(*key)  # unknown before queueing
            refusal = Overloaded(f"overloaded: {partition.name} has a queue")
        if queue is None:
            queue = self._queues[key] = PendingQueue(self.policy, clock=self._clock, age_secs=self.age_secs)
        if len(queue) >= self.threshold:
            self.rejected_full += 1
            self.counters.overloaded += 1
            raise Overloaded(
                f"{refusal}; the router queue is full ({len(queue)} waiting, --router-queue-threshold)"
            ) from refusal
        future = asyncio.get_running_loop().create_future()
        waiter = _Waiter(request, reserve, future, gone, self._clock(), queue=queue)
        ticket = queue.push(waiter, isl_tokens=self._isl(request), priority=request.priority)
        self.queued_total += 1
        waiter.timer = asyncio.get_running_loop().call_later(self.timeout_secs, self._expire, ticket)
        self.changed_key(key)  # the backlog path may find the load already free
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._abandon(ticket)
            raise

    # -- load changed --------------------------------------------------------------------------

    def changed(self, partition: Partition) -> None:
        """The partition's load or candidates changed: retry its waiters soon (coalesced)."""
        self.changed_key((partition.model_name, partition.routing_group))

    def changed_key(self, key: tuple[str, str]) -> None:
        if not self._queues.get(key) or key in self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called off the loop (before run): nobody waits there
            return
        self._scheduled.add(key)
        loop.call_soon(self._pump, key)

    def tick(self) -> None:
        """Every health tick: drop waiters whose client left, retry every queue."""
        for key, queue in list(self._queues.items()):
            for ticket in queue.tickets():
                waiter = ticket.item
                if waiter.gone is not None and waiter.gone():
                    self.dropped_gone += 1
                    self._resolve(ticket, ClientGone("client closed the connection while queued"))
            if queue:
                self._pump(key)
            else:
                del self._queues[key]

    def close(self) -> None:
        """The service stops: refuse every waiter."""
        for queue in self._queues.values():
            for ticket in queue.tickets():
                self._resolve(ticket, Stopping("the service is stopping"))
        self._queues.clear()

    # -- internals -----------------------------------------------------------------------------

    def _pump(self, key: tuple[str, str]) -> None:
        """Decide for the queue's head while the partition takes it (head-of-line, as the reference)."""
        self._scheduled.discard(key)
        queue = self._queues.get(key)
        if queue is None:
            return
        while (ticket := queue.peek()) is not None:
            waiter = ticket.item
            if waiter.gone is not None and waiter.gone():
                self.dropped_gone += 1
                self._resolve(ticket, ClientGone("client closed the connection while queued"))
                continue
            try:
                decision = self.decider.select(waiter.request, reserve=waiter.reserve)
            except Overloaded:
                return  # still busy: the head waits on, and a retry is not a refusal
            except ServiceError as exc:
                self._resolve(ticket, exc)
                continue
            except Exception as exc:  # the waiter must hear of it; the loop goes on
                log.exception("queued decision failed")
                self._resolve(ticket, ServiceError(f"queued decision failed: {exc!r}"))
                continue
            self._resolve(ticket, decision)

    def _resolve(self, ticket: Ticket[_Waiter], outcome: Decision | ServiceError) -> None:
        """Take the ticket out and hand the waiter its outcome, exactly once."""
        waiter = ticket.item
        assert waiter.queue is not None
        waiter.queue.remove(ticket)
        if waiter.timer is not None:
            waiter.timer.cancel()
        if waiter.future.done():  # cancelled: the handler left; give back what was booked for it
            if not isinstance(outcome, ServiceError):
                self._give_back(outcome)
            return
        if isinstance(outcome, ServiceError):
            waiter.future.set_exception(outcome)
        else:
            buckets = self.waits.get(ticket.priority)
            if buckets is None:
                buckets = self.waits[ticket.priority] = Buckets(WAIT_BUCKETS)
            buckets.observe(self._clock() - waiter.since)
            waiter.future.set_result(outcome)

    def _expire(self, ticket: Ticket[_Waiter]) -> None:
        if not ticket.queued:
            return
        self.timed_out += 1
        self.counters.overloaded += 1
        self._resolve(
            ticket,
            Overloaded(
                f"overloaded: waited {self.timeout_secs:g} s in the router queue and every worker is still busy"
            ),
        )

    def _abandon(self, ticket: Ticket[_Waiter]) -> None:
        """The handler was cancelled while waiting (or just after its decision)."""
        waiter = ticket.item
        if ticket.queued:
            assert waiter.queue is not None
            waiter.queue.remove(ticket)
            if waiter.timer is not None:
                waiter.timer.cancel()
            return
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            self._give_back(future.result())

    def _give_back(self, decision: Decision) -> None:
        if decision.reserved and decision.selection_id is not None:
            with contextlib.suppress(ServiceError):  # expired or freed meanwhile
                self.decider.reservations.free(decision.selection_id)

    def _isl(self, request: SelectRequest) -> int:
        if request.isl_tokens is not None:
            return request.isl_tokens
        if request.token_ids is not None:
            return len(request.token_ids)
        block_size = self.decider.registry.partition(request.model_name, request.routing_group).block_size
        return len(request.block_hashes or ()) * block_size
