"""Trust states and misconfiguration checks (``service/trust.py``).

The checks in one process against rows shaped as the control segment gives them and an injected clock
(every check raised, named, and cleared); then end to end through a real service and two real mock
engines: a worker registered with the wrong block size is named misconfigured, one whose history is lost
in a gap without replay is ``partial``, one that goes silent is ``stale``, and a healthy one is ``exact``.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from kvrouter.engine import WorkerStats
from kvrouter.plane.config import PlaneConfig
from kvrouter.routing.config import RouterConfig
from kvrouter.service import ServiceConfig
from kvrouter.service.core.counters import ServiceCounters
from kvrouter.service.core.trust import (
    CLEAR_AFTER_S,
    NEVER_REUSED_REPORTS,
    NO_EVENTS_AFTER_S,
    NO_EVENTS_DECISIONS,
    Trust,
)
from tests.clock import FakeClock
from tests.service.conftest import BLOCK, MODEL, Running, serving
from tests.service.edges.test_proxy import complete

pytestmark = pytest.mark.timeout(180)

W = (7, 0)
ENDPOINTS = {W: ("tcp://10.0.0.7:5557", "kv", 16, "vllm")}


def row(**fields: Any) -> WorkerStats:
    base = WorkerStats(
        shard=0,
        state="exact",
        stale=False,
        cached_blocks=0,
        cached_by_tier={},
        last_id=3,
        last_event_ns=0,
        gaps_detected=0,
        gaps_recovered=0,
        gaps_lost=0,
        dropped_blocks=0,
        skipped_events=0,
        bad_frames=0,
        restarts=0,
        events=4,
    )
    return dataclasses.replace(base, **fields)


def test_each_check_is_raised_named_and_cleared(clock: FakeClock) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    counters = ServiceCounters()
    trust = Trust(counters, lambda kind, fields: events.append((kind, fields)), clock=clock)
    trust.registered(W)
    trust.update({W: row()}, ENDPOINTS)
    assert trust.state(W) == "exact"
    trust.update({W: row(state="partial")}, ENDPOINTS)
    assert trust.state(W) == "partial"
    trust.update({W: row(stale=True)}, ENDPOINTS)
    assert trust.state(W) == "stale"
    # blocks of another size: named with the registered size, cleared once no more are dropped
    trust.update({W: row(dropped_blocks=3)}, ENDPOINTS)  # dropped for short token lists: not a size problem
    assert trust.state(W) == "exact"
    trust.update({W: row(dropped_blocks=12, foreign_block_size=32)}, ENDPOINTS)
    assert trust.state(W) == "misconfigured"
    assert "KV blocks of 32 tokens, registered with block_size 16" in trust.problems(W)["block_size"]
    clock.now += CLEAR_AFTER_S + 1
    trust.update({W: row(dropped_blocks=12, foreign_block_size=32)}, ENDPOINTS)
    assert trust.problems(W) == {}
    assert trust.state(W) == "exact"
    # frames that never decode under the registered format
    trust.update({W: row(bad_frames=5, events=0, last_id=None, foreign_format="sglang")}, ENDPOINTS)
    assert "do not decode as vllm" in trust.problems(W)["bad_frames"]
    assert "register it with format 'sglang'" in trust.problems(W)["bad_frames"]
    clock.now += CLEAR_AFTER_S + 1
    trust.update({W: row()}, ENDPOINTS)
    # another rank's batches on this rank's port
    trust.update({W: row(bad_frames=7, foreign_rank=1)}, ENDPOINTS)
    assert "dp rank 1's events arrive on tcp://10.0.0.7:5557" in trust.problems(W)["wrong_rank"]
    clock.now += CLEAR_AFTER_S + 1
    trust.update({W: row(bad_frames=7, foreign_rank=1)}, ENDPOINTS)
    assert trust.problems(W) == {}
    # chosen often, long enough, and not one event: the endpoint and topic are named
    counters.selections[W] = NO_EVENTS_DECISIONS
    trust.registered(W)  # registered again now
    silent = row(events=0, last_id=None)
    trust.update({W: silent}, ENDPOINTS)
    assert "no_events" not in trust.problems(W)  # registered too recently to judge
    clock.now += NO_EVENTS_AFTER_S
    trust.update({W: silent}, ENDPOINTS)
    assert "tcp://10.0.0.7:5557 topic 'kv'" in trust.problems(W)["no_events"]
    trust.update({W: row()}, ENDPOINTS)  # an event came: cleared
    assert "no_events" not in trust.problems(W)
    # predicted reuse the engine never made
    counters.reuse[W] = [NEVER_REUSED_REPORTS, 0, NEVER_REUSED_REPORTS, 0, 640, 0]
    trust.update({W: row()}, ENDPOINTS)
    assert "prefix caching off" in trust.problems(W)["never_reused"]
    counters.reuse[W] = [NEVER_REUSED_REPORTS + 1, 1, NEVER_REUSED_REPORTS, 0, 672, 32]
    trust.update({W: row()}, ENDPOINTS)
    assert trust.problems(W) == {}
    kinds = [(kind, fields.get("check")) for kind, fields in events]
    for check in ("block_size", "bad_frames", "wrong_rank", "no_events", "never_reused"):
        assert ("misconfigured", check) in kinds
        assert ("misconfiguration_cleared", check) in kinds
    trust.forget(W)
    assert trust.state(W) is None


@pytest.fixture(scope="module")
def trusted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    config = ServiceConfig(
        port=0,
        shards=1,
        health_interval_secs=0.1,
        drain_secs=2.0,
        router=RouterConfig(untrusted_overlap_weight=0.5),
        plane=PlaneConfig(stale_after=3.0, recovery_timeout=1.0),
    )
    with serving(config, tmp_path_factory.mktemp("trust")) as run:
        yield run


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(blocks * BLOCK)]


def listener(run: Running, worker: int) -> dict[str, Any]:
    (found,) = [r for r in run.ok("GET", "/workers") if r["instance_id"] == worker]
    return dict(found["listeners"]["0"])


_fresh = itertools.count(100)
T = TypeVar("T")


def after_events(run: Running, model: str, probe: Callable[[], T]) -> T:
    """``probe()`` just after a completion of a new prompt on ``model`` made its worker publish. Each poll
    publishes again: a listener registered a moment ago may not have joined its engine's PUB socket yet (ZMQ
    drops what a publisher sends before the subscriber connects), and a state other than ``stale`` is only
    seen reliably while the worker is not silent (on a loaded machine a wait can outlast the fixture's 3 s
    ``stale_after``)."""
    status, answer, _ = complete(run, {"model": model, "prompt": prompt(next(_fresh), 4), "max_tokens": 2})
    assert status == 200, answer
    return probe()


def trust_after_events(run: Running, worker: int) -> str | None:
    return after_events(run, MODEL, lambda: listener(run, worker).get("trust"))


def test_trust_states_and_a_wrong_block_size_end_to_end(trusted: Running, wait_until) -> None:
    one, two = trusted.workers
    # worker 2 again, in a partition of its own, registered with the wrong block size and no replay socket
    trusted.ok("POST", "/unregister", {"instance_id": 2, "model_name": MODEL})
    wrong = {"instance_id": 2, "endpoint": two.events[0], "model_name": "bs32", "block_size": 2 * BLOCK}
    trusted.ok("POST", "/register", {**wrong, "http_endpoint": two.http})
    wait_until(
        lambda: after_events(trusted, "bs32", lambda: listener(trusted, 2).get("trust")) == "misconfigured",
        timeout=20,
    )
    problem = listener(trusted, 2)["problems"]["block_size"]
    assert f"worker 2:0 sends KV blocks of {BLOCK} tokens, registered with block_size {2 * BLOCK}" in problem
    events = trusted.ok("GET", "/events?since=0")["events"]
    assert any(e["kind"] == "misconfigured" and e["check"] == "block_size" for e in events)
    # worker 1: exact once its events flow, stale once silent past stale_after
    wait_until(lambda: trust_after_events(trusted, 1) == "exact", timeout=20)
    wait_until(lambda: listener(trusted, 1).get("trust") == "stale", timeout=20)
    # without a replay socket, a dropped batch is history lost: partial
    trusted.ok("POST", "/unregister", {"instance_id": 1, "model_name": MODEL})
    trusted.ok(
        "POST",
        "/register",
        {
            "instance_id": 1,
            "endpoint": one.events[0],
            "model_name": MODEL,
            "block_size": BLOCK,
            "http_endpoint": one.http,
        },
    )
    wait_until(
        lambda: after_events(trusted, MODEL, lambda: listener(trusted, 1).get("last_id")) is not None,
        timeout=20,
    )
    request = urllib.request.Request(
        one.http + "/faults", data=b'{"drop_batches": 1}', method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
    for n in range(2):
        status, answer, _ = complete(trusted, {"model": MODEL, "prompt": prompt(10 + n, 4), "max_tokens": 2})
        assert status == 200, answer
    wait_until(lambda: listener(trusted, 1).get("gaps_lost", 0) >= 1, timeout=20)
    wait_until(lambda: trust_after_events(trusted, 1) == "partial", timeout=20)
    # explanations carry the trust state of every candidate, and a partial worker's credit is weighted down
    cached = prompt(11, 4)
    wait_until(
        lambda: (
            trusted.ok("POST", "/query", {"model_name": MODEL, "token_ids": cached})["scores"].get("1", {}).get("0", 0)
            > 0
        ),
        timeout=20,
    )
    wait_until(lambda: trust_after_events(trusted, 1) == "partial", timeout=20)
    answer = trusted.ok("POST", "/select", {"model_name": MODEL, "token_ids": cached, "explain": True})
    assert answer["explain"]["trust"] == {"1:0": "partial"}
    (row,) = answer["explain"]["workers"]
    assert row["overlap_blocks"] > 0
    assert row["overlap_credit_blocks"] == pytest.approx(0.5 * row["overlap_blocks"])


def test_a_wrong_format_and_a_wrong_rank_are_named_end_to_end(trusted: Running, wait_until) -> None:
    """Worker 2's vLLM frames registered as kvrouter format; then worker 2's rank-0 port registered as rank 1."""
    _, two = trusted.workers
    trusted.call("POST", "/unregister", {"instance_id": 2, "model_name": "bs32"})
    trusted.call("POST", "/unregister", {"instance_id": 2, "model_name": MODEL})
    common = {"instance_id": 2, "endpoint": two.events[0], "block_size": BLOCK, "http_endpoint": two.http}
    trusted.ok("POST", "/register", {**common, "model_name": "fmt", "format": "kvrouter"})
    wait_until(
        lambda: "bad_frames" in after_events(trusted, "fmt", lambda: listener(trusted, 2).get("problems", {})),
        timeout=20,
    )
    problem = listener(trusted, 2)["problems"]["bad_frames"]
    assert "do not decode as kvrouter" in problem
    assert "they decode as vllm: register it with format 'vllm'" in problem
    trusted.ok("POST", "/unregister", {"instance_id": 2, "model_name": "fmt"})
    trusted.ok("POST", "/register", {**common, "model_name": "rank", "dp_rank": 1})

    def wrong_rank() -> dict[str, str]:
        (found,) = [r for r in trusted.ok("GET", "/workers") if r["instance_id"] == 2]
        return dict(found["listeners"]["1"].get("problems") or {})

    wait_until(lambda: "wrong_rank" in after_events(trusted, "rank", wrong_rank), timeout=20)
    assert f"dp rank 0's events arrive on {two.events[0]}, the port of worker 2:1" in wrong_rank()["wrong_rank"]
