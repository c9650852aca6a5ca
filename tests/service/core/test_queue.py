"""The router queue (``kvrouter/service/queue.py``): overloaded requests wait instead of getting 529.

The orders are tested on :class:`PendingQueue` with an injected clock. End to end, a real service's
``app`` is served by aiohttp's test server on 127.0.0.1 in approximate mode (workers registered through
``/register``, no engine needed): one worker, a busy threshold of 1 prefill token, and one booked
request make every candidate busy; queued requests are then served one per freed reservation, so the
order they come out in is the policy's.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from kvrouter.errors import ConfigError, ServiceError
from kvrouter.routing.config import RouterConfig
from kvrouter.service import Service, ServiceConfig
from kvrouter.service.core.queue import PendingQueue, queue_key
from kvrouter.service.core.requests import SelectRequest
from kvrouter.service.edges.gate import status

BLOCK = 4
MODEL = "q"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def drain(queue: PendingQueue[str]) -> list[str]:
    out = []
    while (ticket := queue.pop()) is not None:
        out.append(ticket.item)
    return out


# -- ordering (no service) ------------------------------------------------------------------------


def test_fcfs_serves_in_arrival_order_and_a_priority_jump_moves_ahead():
    clock = Clock()
    queue: PendingQueue[str] = PendingQueue("fcfs", clock=clock)
    for name, isl in (("long", 400), ("short", 10), ("mid", 100)):
        queue.push(name, isl_tokens=isl)
        clock.now += 1.0
    assert (queue.pending_count, queue.pending_isl_tokens) == (3, 510)
    queue.push("jumper", isl_tokens=50, priority_jump=5.0)  # arrived 3 s in, jumps 5 s: ahead of all
    assert drain(queue) == ["jumper", "long", "short", "mid"]
    assert (queue.pending_count, queue.pending_isl_tokens) == (0, 0)


def test_wspt_serves_the_shortest_prompt_first_weighted_by_priority():
    clock = Clock()
    queue: PendingQueue[str] = PendingQueue("wspt", clock=clock)
    for name, isl in (("long", 400), ("short", 10), ("mid", 100), ("mid-too", 100)):
        queue.push(name, isl_tokens=isl)
        clock.now += 1.0
    queue.push("heavy", isl_tokens=400, priority_jump=9.0)  # weight 10 over 400 tokens = 1/40
    assert drain(queue) == ["short", "heavy", "mid", "mid-too", "long"]  # equal keys: arrival


def test_the_keys_are_the_references():
    assert queue_key("fcfs", priority_jump=2.0, arrival_offset=3.5, isl_tokens=7) == 2.0 - 3.5
    assert queue_key("wspt", priority_jump=2.0, arrival_offset=3.5, isl_tokens=8) == 3.0 / 8
    assert queue_key("wspt", priority_jump=0.0, arrival_offset=0.0, isl_tokens=0) == 1.0


def test_removed_tickets_leave_the_counts_and_the_order():
    queue: PendingQueue[str] = PendingQueue("fcfs", clock=Clock())
    tickets = [queue.push(name, isl_tokens=10) for name in "abc"]
    assert queue.remove(tickets[0])
    assert queue.remove(tickets[1])
    assert not queue.remove(tickets[1])
    assert (queue.pending_count, queue.pending_isl_tokens) == (1, 10)
    assert drain(queue) == ["c"]


def test_priority_classes_come_first_lowest_first_and_the_policy_orders_each_class():
    clock = Clock()
    queue: PendingQueue[str] = PendingQueue("wspt", clock=clock)
    for name, isl, klass in (("a", 40, 1), ("b", 10, 1), ("c", 40, 0), ("d", 80, -1), ("e", 20, 0)):
        queue.push(name, isl_tokens=isl, priority=klass)
        clock.now += 1.0
    assert queue.by_priority == {1: 2, 0: 2, -1: 1}
    assert drain(queue) == ["d", "e", "c", "b", "a"]  # class -1, then 0 (shortest first), then 1
    assert queue.by_priority == {}


def test_a_waiting_request_moves_up_one_class_per_interval_so_a_low_class_is_not_starved():
    clock = Clock()
    queue: PendingQueue[str] = PendingQueue("fcfs", clock=clock, age_secs=10.0)
    queue.push("low", isl_tokens=10, priority=2)
    clock.now += 15.0  # low has waited one interval: class 1 now
    queue.push("high", isl_tokens=10, priority=1)
    queue.push("top", isl_tokens=10, priority=0)
    head = queue.peek()
    assert head is not None
    assert head.item == "top"
    clock.now += 15.0  # 30 s: low has waited three intervals (class -1), top one (class -1), high one (0)
    assert drain(queue) == ["low", "top", "high"]  # low and top tie on class: the earlier first
    still: PendingQueue[str] = PendingQueue("fcfs", clock=clock)  # without ageing, classes stay
    still.push("low", isl_tokens=10, priority=2)
    clock.now += 25.0
    still.push("high", isl_tokens=10, priority=1)
    assert drain(still) == ["high", "low"]


def test_a_removed_ticket_leaves_its_class_and_its_ageing():
    clock = Clock()
    queue: PendingQueue[str] = PendingQueue("fcfs", clock=clock, age_secs=1.0)
    gone = queue.push("gone", isl_tokens=10, priority=5)
    queue.push("kept", isl_tokens=10, priority=5)
    assert queue.remove(gone)
    clock.now += 30.0  # many intervals: only the ticket still queued moves
    assert [t.item for t in queue.tickets()] == ["kept"]
    assert queue.tickets()[0].klass == 5 - 30
    assert drain(queue) == ["kept"]
    assert (queue.pending_count, queue.by_priority) == (0, {})


def test_config_validates_the_queue():
    with pytest.raises(ConfigError, match="queue_threshold"):
        ServiceConfig(queue_threshold=0)
    with pytest.raises(ConfigError, match="queue_policy"):
        ServiceConfig(queue_policy="lcfs")  # type: ignore[arg-type]  # what a caller might send
    with pytest.raises(ConfigError, match="queue_timeout_secs"):
        ServiceConfig(queue_timeout_secs=0)
    with pytest.raises(ValueError, match="age_secs"):
        PendingQueue("fcfs", age_secs=0.0)
    assert ServiceConfig().queue_threshold is None  # no queue: today's 529


# -- end to end -------------------------------------------------------------------------------------


def service(**queue: Any) -> Service:
    config = ServiceConfig(port=0, shards=1, router=RouterConfig(use_kv_events=False), **queue)
    return Service(config)


async def until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def prompt(n: int, seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


FRESH_SEEDS = itertools.count(100)
"""Each reserved request's own prompt: one that shares a prefix with an earlier one would be (partly)
cached, add fewer prefill tokens than the busy threshold, and let the next waiter through as well."""


async def busy_partition(client: TestClient[Any, Any]) -> None:
    """One worker, busy above 1 prefill token, with one booked request ("blocker")."""
    response = await client.post("/register", json={"instance_id": 1, "model_name": MODEL, "block_size": BLOCK})
    assert response.status == 201, await response.text()
    response = await client.post("/busy_threshold", json={"model_name": MODEL, "active_prefill_tokens_threshold": 1})
    assert response.status == 200
    response = await client.post(
        "/select_and_reserve", json={"model_name": MODEL, "token_ids": prompt(8, 0), "selection_id": "blocker"}
    )
    assert response.status == 200, await response.text()


def with_client(service: Service, body: Callable[[TestClient[Any, Any]], Awaitable[None]]) -> None:
    async def main() -> None:
        async with TestClient(TestServer(service.app, host="127.0.0.1")) as client:
            await body(client)

    asyncio.run(main())


def reserve(
    client: TestClient[Any, Any], selection_id: str, n: int, priority: int | None = None
) -> asyncio.Task[ClientResponse]:
    body: dict[str, Any] = {
        "model_name": MODEL,
        "token_ids": prompt(n, next(FRESH_SEEDS)),
        "selection_id": selection_id,
    }
    if priority is not None:
        body["priority"] = priority
    return asyncio.ensure_future(client.post("/select_and_reserve", json=body))


async def loads(client: TestClient[Any, Any]) -> dict[str, Any]:
    response = await client.get("/loads")
    (partition,) = [p for p in await response.json() if p["model_name"] == MODEL]
    return dict(partition)


async def served_in_order(
    client: TestClient[Any, Any],
    svc: Service,
    arrivals: list[tuple[str, int]],
    *,
    threshold: int,
    priorities: dict[str, int] | None = None,
) -> list[str]:
    """Queue ``arrivals`` one after the other behind the blocker, then free one reservation at a time."""
    tasks: dict[str, asyncio.Task[ClientResponse]] = {}
    for i, (name, n) in enumerate(arrivals):
        tasks[name] = reserve(client, name, n, (priorities or {}).get(name))
        await until(lambda i=i: svc.core.queue.pending(MODEL, "default")[0] == i + 1, f"{name} queued")  # type: ignore[misc]
    state = await loads(client)
    assert state["pending_count"] == len(arrivals)
    assert state["pending_isl_tokens"] == sum(n for _, n in arrivals)
    metrics = await (await client.get("/metrics")).text()
    assert f'kvrouter_router_queue_pending_requests{{model="{MODEL}",routing_group="default"}} {len(arrivals)}.0' in (
        metrics
    )
    if len(arrivals) == threshold:  # one more is refused at once
        refused = await reserve(client, "extra", 4)
        assert refused.status == 529
        assert "queue is full" in (await refused.json())["error"]
    order: list[str] = []
    holder = "blocker"
    while tasks:
        response = await client.delete(f"/reservations/{holder}")
        assert response.status == 200
        await until(lambda: any(t.done() for t in tasks.values()), "a queued request served")
        (name,) = [name for name, task in tasks.items() if task.done()]
        answer = tasks.pop(name).result()
        assert answer.status == 200, await answer.text()
        assert (await answer.json())["selection_id"] == name
        order.append(name)
        holder = name
    assert (await client.delete(f"/reservations/{holder}")).status == 200
    assert len(svc.core.reservations) == 0
    assert (await loads(client))["pending_count"] == 0
    return order


ARRIVALS = [("long", 40), ("short", 8), ("mid", 20)]


@pytest.mark.parametrize(
    ("policy", "expected"), [("fcfs", ["long", "short", "mid"]), ("wspt", ["short", "mid", "long"])]
)
def test_requests_wait_instead_of_529_and_are_served_in_policy_order(policy: str, expected: list[str]):
    svc = service(queue_threshold=3, queue_policy=policy)

    async def body(client: TestClient[Any, Any]) -> None:
        await busy_partition(client)
        assert await served_in_order(client, svc, ARRIVALS, threshold=3) == expected

    with_client(svc, body)


def test_a_filled_queue_serves_by_priority_then_policy_and_metrics_count_each_class():
    svc = service(queue_threshold=4, queue_priority_age_secs=None)
    classes = {"later": 1, "first": -1, "low": 3, "second": -1}

    async def body(client: TestClient[Any, Any]) -> None:
        await busy_partition(client)
        arrivals = [("later", 8), ("first", 8), ("low", 8), ("second", 8)]
        tasks = {name: reserve(client, name, n, classes[name]) for name, n in arrivals}
        await until(lambda: svc.core.queue.pending(MODEL, "default")[0] == 4, "four queued")
        metrics = await (await client.get("/metrics")).text()
        for klass, count in ((-1, 2), (1, 1), (3, 1)):
            assert f'kvrouter_queue_pending_by_priority{{model="{MODEL}",priority="{klass}"}} {count}.0' in metrics
        order, holder = [], "blocker"
        while tasks:
            assert (await client.delete(f"/reservations/{holder}")).status == 200
            await until(lambda: any(t.done() for t in tasks.values()), "a queued request served")
            (holder,) = [name for name, task in tasks.items() if task.done()]
            assert tasks.pop(holder).result().status == 200
            order.append(holder)
        assert order == ["first", "second", "later", "low"]
        metrics = await (await client.get("/metrics")).text()
        assert 'kvrouter_router_queue_wait_seconds_count{priority="3"} 1.0' in metrics
        assert 'kvrouter_router_queue_wait_seconds_count{priority="-1"} 2.0' in metrics
        assert (await client.delete(f"/reservations/{holder}")).status == 200

    with_client(svc, body)


def test_ageing_lets_a_long_waiting_low_class_ahead_of_a_newer_high_one():
    svc = service(queue_threshold=4, queue_priority_age_secs=0.2)

    async def body(client: TestClient[Any, Any]) -> None:
        await busy_partition(client)
        low = reserve(client, "low", 8, priority=2)
        await until(lambda: svc.core.queue.pending(MODEL, "default")[0] == 1, "low queued")
        await asyncio.sleep(0.5)  # two intervals: class 0 now
        high = reserve(client, "high", 8, priority=1)
        await until(lambda: svc.core.queue.pending(MODEL, "default")[0] == 2, "high queued")
        assert (await client.delete("/reservations/blocker")).status == 200
        await until(lambda: low.done() or high.done(), "one served")
        assert low.done()
        assert not high.done()
        assert (await client.delete("/reservations/low")).status == 200
        await until(high.done, "high served")
        assert (await client.delete("/reservations/high")).status == 200

    with_client(svc, body)


def test_the_proxy_takes_the_priority_from_the_body_else_the_header():
    from aiohttp.test_utils import make_mocked_request

    from kvrouter.errors import BadRequest
    from kvrouter.service.edges.proxy import PRIORITY_HEADER, priority

    bare = make_mocked_request("POST", "/v1/chat/completions")
    headed = make_mocked_request("POST", "/v1/chat/completions", headers={PRIORITY_HEADER: "-3"})
    assert priority(bare, {}) == 0
    assert priority(headed, {}) == -3
    assert priority(headed, {"priority": 4}) == 4  # the body's field wins
    with pytest.raises(BadRequest, match="priority: expected an integer"):
        priority(bare, {"priority": "high"})
    with pytest.raises(BadRequest, match=f"{PRIORITY_HEADER}: expected an integer"):
        priority(make_mocked_request("POST", "/", headers={PRIORITY_HEADER: "high"}), {})
    with pytest.raises(BadRequest, match="2\\*\\*31"):
        priority(bare, {"priority": 1 << 40})


def test_without_a_queue_threshold_overload_is_still_529():
    svc = service()

    async def body(client: TestClient[Any, Any]) -> None:
        await busy_partition(client)
        response = await reserve(client, "x", 8)
        assert response.status == 529
        assert (await loads(client))["pending_count"] == 0

    with_client(svc, body)


def test_a_prefill_completed_or_a_threshold_raised_lets_the_queue_through():
    svc = service(queue_threshold=4)

    async def body(client: TestClient[Any, Any]) -> None:
        await busy_partition(client)
        first = reserve(client, "first", 8)
        await until(lambda: svc.core.queue.pending(MODEL, "default")[0] == 1, "first queued")
        assert (await client.post("/reservations/blocker/prefill_complete")).status == 200
        assert (await first).status == 200  # the blocker's prompt no longer counts as queued prefill
        second = reserve(client, "second", 8)
        await until(lambda: svc.core.queue.pending(MODEL, "default")[0] == 1, "second queued")
        response = await client.post(
            "/busy_threshold", json={"model_name": MODEL, "active_prefill_tokens_threshold": None}
        )
        assert response.status == 200
        assert (await second).status == 200
        for selection_id in ("blocker", "first", "second"):
            assert (await client.delete(f"/reservations/{selection_id}")).status == 200

    with_client(svc, body)


def test_a_request_waiting_too_long_gets_the_overload_status():
    svc = service(queue_threshold=2, queue_timeout_secs=0.2, overload_status=429)

    async def body(client: TestClient[Any, Any]) -> None:
        await busy_partition(client)
        response = await reserve(client, "late", 8)
        assert response.status == 429
        assert "waited" in (await response.json())["error"]
        assert (await loads(client))["pending_count"] == 0
        assert svc.core.counters.overloaded == 1  # counted once, when refused
        assert (await client.delete("/reservations/blocker")).status == 200
        assert len(svc.core.reservations) == 0

    with_client(svc, body)


def test_a_client_leaving_while_queued_leaves_nothing_queued_or_booked():
    svc = service(queue_threshold=2)

    async def body(client: TestClient[Any, Any]) -> None:
        await busy_partition(client)
        leaving = reserve(client, "leaving", 8)
        await until(lambda: svc.core.queue.pending(MODEL, "default")[0] == 1, "queued")
        leaving.cancel()  # the client closes its connection
        with pytest.raises(asyncio.CancelledError):
            await leaving

        def dropped() -> bool:
            svc.core.queue.tick()  # what every health tick does
            return svc.core.queue.pending(MODEL, "default") == (0, 0)

        await until(dropped, "the waiter dropped")
        assert (await client.delete("/reservations/blocker")).status == 200
        assert len(svc.core.reservations) == 0
        partition = svc.core.registry.partition(MODEL)
        assert partition.slots.active_requests((1, 0)) == 0

    with_client(svc, body)


def test_a_waiter_whose_client_is_gone_is_dropped_at_the_tick_and_never_booked():
    svc = service(queue_threshold=2)

    async def body(client: TestClient[Any, Any]) -> None:
        await busy_partition(client)
        left = False
        request = SelectRequest(model_name=MODEL, token_ids=np.arange(8, dtype=np.uint32), selection_id="gone")
        waiting = asyncio.ensure_future(svc.core.queue.select(request, reserve=True, gone=lambda: left))
        await until(lambda: svc.core.queue.pending(MODEL, "default")[0] == 1, "queued")
        left = True  # what client_gone() sees once the transport closes
        svc.core.queue.tick()
        assert svc.core.queue.pending(MODEL, "default") == (0, 0)
        with pytest.raises(ServiceError) as refused:
            await waiting
        assert status(refused.value, 529) == 499  # ClientGone: the client left
        assert svc.core.queue.dropped_gone == 1
        assert (await client.delete("/reservations/blocker")).status == 200
        assert len(svc.core.reservations) == 0

    with_client(svc, body)


def test_a_newcomer_does_not_overtake_the_queue_and_unregistering_the_last_worker_answers_503():
    svc = service(queue_threshold=3)

    async def body(client: TestClient[Any, Any]) -> None:
        await busy_partition(client)
        waiting = reserve(client, "waiting", 8)
        await until(lambda: svc.core.queue.pending(MODEL, "default")[0] == 1, "queued")
        # a /select that books nothing still queues behind the backlog (the reference's anti-bypass)
        peek = asyncio.ensure_future(client.post("/select", json={"model_name": MODEL, "token_ids": prompt(8, 5)}))
        await until(lambda: svc.core.queue.pending(MODEL, "default")[0] == 2, "the newcomer queued")
        response = await client.post("/unregister", json={"instance_id": 1, "model_name": MODEL})
        assert response.status == 200, await response.text()
        assert (await waiting).status == 503
        assert (await peek).status == 503
        assert svc.core.queue.pending(MODEL, "default") == (0, 0)

    with_client(svc, body)


def test_a_restarted_worker_loses_its_booked_requests():
    """A restart (the plane saw its event ids go back to 0) drops what was booked on it: those requests died
    with the engine, and their blocks must not count as its load or as predicted there."""
    svc = service()

    async def body(client: TestClient[Any, Any]) -> None:
        for instance in (1, 2):
            response = await client.post(
                "/register", json={"instance_id": instance, "model_name": MODEL, "block_size": BLOCK}
            )
            assert response.status == 201, await response.text()
        booked = await (await reserve(client, "before-restart", 8)).json()
        worker = (booked["worker_id"], booked["dp_rank"])
        assert svc.core.registry.restarted((3 - worker[0], 0)) == 0  # the other worker held nothing
        assert svc.core.registry.restarted(worker) == 1
        rows = {(w["worker_id"], w["dp_rank"]): w for w in (await loads(client))["loads"]}
        assert rows[worker]["active_requests"] == 0
        assert rows[worker]["potential_prefill_tokens"] == 0

    with_client(svc, body)
