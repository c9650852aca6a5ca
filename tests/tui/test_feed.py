"""The real feeds against a real service: ``ShmFeed`` (control + stats segments, no request to the router)
and ``HttpFeed`` (``/loads``, ``/workers``, ``/metrics``, ``/decisions``, ``/events``).

One service for the module (``tests/service/conftest.py``'s ``serving``: its applier and two vLLM-format
mock engines), found through its discovery file in a runtime dir of the module's own
(``XDG_RUNTIME_DIR``). ``test_feed_gone.py`` stops a service under the feeds.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrouter import KvPublisher
from kvrouter.events.model import StorageTier
from kvrouter.index.layout import SHM_DIR
from kvrouter.routing.config import RouterConfig
from kvrouter.service import ServiceConfig
from kvrouter.stats.segment import EXPLAIN_INTERVAL_S
from tests.conftest import _wait_until, free_port
from tests.service.conftest import BLOCK, MODEL, TOKEN, Running, serving
from tui.feed import BadSource, HttpFeed, ShmFeed, discover, shm_names
from tui.model import TIERS, RouterGone, Snapshot

pytestmark = pytest.mark.timeout(300)  # the first test starts the service: cold caches compile


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(blocks * BLOCK + 3)]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """XDG_RUNTIME_DIR of the module: the service publishes its discovery file under ``<it>/kvrouter``."""
    base = tmp_path_factory.mktemp("runtime")
    before = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(base)
    try:
        yield base / "kvrouter"
    finally:
        if before is None:
            del os.environ["XDG_RUNTIME_DIR"]
        else:
            os.environ["XDG_RUNTIME_DIR"] = before


@pytest.fixture(scope="module")
def running(runtime: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    config = ServiceConfig(
        port=0, shards=1, auth_token=TOKEN, health_interval_secs=0.1, drain_secs=2.0, router=RouterConfig()
    )
    with serving(config, tmp_path_factory.mktemp("service")) as run:
        yield run
    assert os.listdir(runtime) == []  # the discovery file went with the service


def holds(run: Running, worker_id: int, tokens: list[int]) -> bool:
    _, answer, _ = run.call("POST", "/query", {"model_name": MODEL, "token_ids": tokens})
    return bool(answer["instances"].get(str(worker_id), {}).get("gpu", 0) >= len(tokens) // BLOCK * BLOCK)


@pytest.fixture(scope="module")
def warm(running: Running) -> Running:
    """Both engines hold blocks (a completion each, indexed), and the router made decisions about them.

    A first batch published while the router's subscription is still joining is lost without a trace
    until the engine's next batch shows the gap (then it is replayed): so more batches follow until the
    index holds the prompt."""
    for wid, worker in zip((1, 2), running.workers, strict=True):
        tokens = prompt(wid, blocks=4)
        worker.complete(tokens, max_tokens=2)

        def indexed(wid: int = wid, tokens: list[int] = tokens) -> bool:
            return holds(running, wid, tokens)

        for attempt in range(30):
            try:
                _wait_until(indexed, timeout=1.0, what="indexed")
                break
            except pytest.fail.Exception:
                worker.complete(prompt(1000 + attempt, blocks=1), max_tokens=2)
        else:
            pytest.fail(f"worker {wid}'s blocks never reached the index")
    for seed in (1, 2, 3):
        running.ok("POST", "/select", {"model_name": MODEL, "token_ids": prompt(seed, blocks=4)})
    return running


@pytest.fixture
def shm(runtime: Path, running: Running) -> Iterator[ShmFeed]:
    (entry,) = discover(runtime)
    feed = ShmFeed.of(entry)
    try:
        yield feed
    finally:
        feed.close()


def settled(snapshot: Snapshot) -> bool:
    """Both workers indexed with blocks, an explained decision and the warm-up's decisions counted (the
    counters are published on their own tick), the registrations in the log."""
    return (
        len(snapshot.workers) == 2
        and all(w.cached_blocks > 0 for w in snapshot.workers)
        and any(d.candidates for d in snapshot.decisions)
        and snapshot.decisions_total >= 3
        and sum(e.kind == "registered" for e in snapshot.events) == 2
    )


def test_the_dashboards_tier_names_are_the_routers():
    assert tuple(tier.value for tier in StorageTier) == TIERS


def test_discover_finds_the_running_service(runtime: Path, running: Running):
    (entry,) = discover(runtime)
    assert (entry.pid, entry.url) == (os.getpid(), running.url)
    assert (entry.control, entry.stats) == shm_names(str(os.getpid()))
    assert os.path.exists(f"{SHM_DIR}/{entry.stats}")
    assert os.path.exists(f"{SHM_DIR}/{entry.control}")
    assert entry.started_at <= time.time()


def test_shm_feed_sees_workers_blocks_decisions_and_events(warm: Running, shm: ShmFeed, wait_until: Any):
    wait_until(lambda: settled(shm.poll()), what="the shm feed sees both workers' blocks and a decision explained")
    snap = shm.poll()
    assert snap.source == f"shm:kvrouter-{os.getpid()}-stats"
    assert (snap.shards, snap.shards_up, snap.shards_recovering) == (1, 1, 0)
    assert [(w.worker_id, w.dp_rank, w.model) for w in snap.workers] == [(1, 0, MODEL), (2, 0, MODEL)]
    assert {w.state for w in snap.workers} <= {"exact", "partial"}
    assert all(w.last_event_at is not None for w in snap.workers)
    assert snap.events_total > 0
    assert snap.decisions_total >= 3
    assert snap.queries_total >= snap.decisions_total
    assert snap.route_p50_us is not None
    assert snap.route_p99_us is not None
    assert 0 < snap.route_p50_us <= snap.route_p99_us
    assert snap.started_at <= snap.taken_at
    assert snap.index_lag_ms is not None  # the mocks stamp their batches on this host's clock
    assert 0 < snap.index_lag_ms < 60_000
    assert snap.index_blocks_cap > 0  # the service's default cap: the index is never unbounded
    assert snap.index_blocks is not None
    assert 0 < snap.index_blocks <= snap.index_blocks_cap
    assert list(snap.weights) == ["credit", "scale", "decode", "work", "pred", "gain", "T"]
    assert snap.extra["url"] == warm.url
    explained = next(d for d in reversed(snap.decisions) if d.candidates)
    assert sorted((c.worker_id, c.dp_rank) for c in explained.candidates) == [(1, 0), (2, 0)]
    (chosen,) = [c for c in explained.candidates if c.selected]
    assert (chosen.worker_id, chosen.dp_rank) == (explained.worker_id, explained.dp_rank)
    assert chosen.total == pytest.approx(explained.cost)
    assert [d.seq for d in snap.decisions] == sorted(d.seq for d in snap.decisions)
    registered = [e for e in snap.events if e.kind == "registered"]
    assert "worker_id=1 " in registered[0].text
    assert "model_name=m " in registered[0].text


def test_the_http_feed_agrees_with_the_shm_feed(warm: Running, shm: ShmFeed, wait_until: Any):
    http = HttpFeed(warm.url)
    wait_until(lambda: settled(http.poll()), what="the HTTP feed sees both workers' blocks and a decision explained")

    def same() -> bool:
        a, b = shm.poll(), http.poll()
        rows = [(w.key, w.state, w.cached_blocks, w.requests, w.gaps_detected) for w in a.workers]
        return (
            rows == [(w.key, w.state, w.cached_blocks, w.requests, w.gaps_detected) for w in b.workers]
            and (a.shards, a.shards_up, a.events_total, a.decisions_total, a.queries_total)
            == (b.shards, b.shards_up, b.events_total, b.decisions_total, b.queries_total)
            and [d.seq for d in a.decisions] == [d.seq for d in b.decisions]
            and [e.seq for e in a.events] == [e.seq for e in b.events]
            and a.weights == b.weights
            and a.started_at == pytest.approx(b.started_at)
            and (a.index_blocks, a.index_blocks_cap, a.index_evicted)
            == (b.index_blocks, b.index_blocks_cap, b.index_evicted)
        )

    wait_until(same, what="both feeds say the same")
    snap = http.poll()
    assert snap.source == warm.url
    assert "url" not in snap.extra  # the header names the source once
    assert snap.route_p50_us is not None
    assert snap.index_lag_ms is not None
    assert 0 < snap.index_lag_ms < 60_000
    assert snap.index_blocks_cap > 0  # the service's default cap: the index is never unbounded
    assert snap.index_blocks is not None
    assert 0 < snap.index_blocks <= snap.index_blocks_cap
    assert any(d.candidates for d in snap.decisions)


def test_a_probe_shows_every_worker_and_books_nothing(warm: Running, shm: ShmFeed, wait_until: Any):
    tokens = prompt(1, blocks=4)  # what worker 1 completed
    wait_until(lambda: settled(shm.poll()), what="settled")

    def marks() -> tuple[Any, ...]:
        _, decisions, _ = warm.call("GET", "/decisions?since=0")
        _, loads, _ = warm.call("GET", "/loads")
        return decisions["last"], loads

    before = marks()
    for feed in (shm, HttpFeed(warm.url)):
        rows = {(r.worker_id, r.dp_rank): r for r in feed.probe(tokens)}
        assert sorted(rows) == [(1, 0), (2, 0)]
        assert rows[1, 0].overlap_blocks == 4
        assert rows[2, 0].overlap_blocks == 0
        assert rows[1, 0].total < rows[2, 0].total
    assert marks() == before  # no decision recorded, no load booked
    status, _, _ = warm.call("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": tokens, "probe": True})
    assert status == 400


def test_decisions_are_explained_for_the_ring_at_a_bounded_rate(warm: Running):
    _, before, _ = warm.call("GET", "/decisions?since=0")
    time.sleep(EXPLAIN_INTERVAL_S)  # an earlier test's last explanation is an interval old: the first is explained
    started = time.monotonic()
    answers = [warm.ok("POST", "/select", {"model_name": MODEL, "token_ids": prompt(50 + i, 2)}) for i in range(30)]
    elapsed = time.monotonic() - started
    _, after, _ = warm.call("GET", f"/decisions?since={before['last']}")
    explained = [d for d in after["decisions"] if "explain" in d]
    assert len(after["decisions"]) == 30
    assert 1 <= len(explained) <= elapsed / EXPLAIN_INTERVAL_S + 1  # the invariant: one per interval at most
    assert not any("explain" in a for a in answers)  # the client's answer is the unexplained one


def test_bad_sources_are_clear_errors(running: Running):
    control, stats = shm_names(str(os.getpid()))
    assert shm_names(f"kvrouter-{os.getpid()}-ctl") == shm_names(stats) == (control, stats)
    with pytest.raises(BadSource, match="expected kvrouter-<pid>-stats"):
        shm_names("not-a-segment")
    wrong = ShmFeed(control)  # a kvrouter segment, but not a stats one
    with pytest.raises(BadSource, match="not a kvrouter stats segment"):
        wrong.poll()
    wrong.close()
    missing = ShmFeed("kvrouter-999999999-stats")
    with pytest.raises(RouterGone, match="not in /dev/shm"):
        missing.poll()
    missing.close()
    with pytest.raises(RouterGone):
        HttpFeed(f"http://127.0.0.1:{free_port()}").poll()
    with pytest.raises(BadSource, match="404"):
        HttpFeed(running.url + "/nothing-here").poll()


def test_a_workers_host_tier_blocks_reach_workers_and_both_feeds(running: Running, shm: ShmFeed, wait_until: Any):
    """A kvrouter-format worker (a ``KvPublisher`` here, its own model) holding 2 device blocks and 3 in the
    host tier: ``/workers`` lists both tiers under its listener, ``cached_blocks`` stays the device count,
    and both feeds' rows carry the host blocks, and the role it registered with. Registered last in the module
    and unregistered after."""
    http = HttpFeed(running.url)
    tiers = {"device": 2, "host": 3, "disk": 0, "shared": 0}
    with KvPublisher(9, block_size=BLOCK, endpoint="tcp://127.0.0.1:*", query_endpoint="tcp://127.0.0.1:*") as pub:
        pub.store([1, 2], prompt(90, blocks=2)[: 2 * BLOCK])
        pub.store([3, 4, 5], prompt(91, blocks=3)[: 3 * BLOCK], tier=StorageTier.HOST)
        pub.publish()  # before anyone subscribed: the router's join restore (a dump query) brings them
        registration = {"instance_id": 9, "endpoint": pub.endpoint, "query_endpoint": pub.query_endpoint}
        running.ok(
            "POST",
            "/register",
            {**registration, "format": "kvrouter", "model_name": "tiers", "block_size": BLOCK, "role": "decode"},
        )
        try:

            def listener() -> dict[str, Any]:
                pub.serve(5)  # answer the router's queries: this thread is the worker's loop
                _, answer, _ = running.call("GET", "/workers?model_name=tiers")
                return dict(answer[0]["listeners"]["0"]) if answer else {}

            def restored() -> bool:  # the restore's blocks land a moment before its end marks the stream exact
                now = listener()
                return now.get("cached_by_tier") == tiers and now.get("state") == "exact"

            wait_until(restored, timeout=60, what="/workers lists the tiers of an exact stream")
            assert listener()["cached_blocks"] == 2

            def row(feed: ShmFeed | HttpFeed) -> tuple[int, tuple[int, int, int], str] | None:
                rows = feed.poll().workers
                found = [(w.cached_blocks, w.cached_offloaded, w.role) for w in rows if w.key == (9, 0)]
                return found[0] if found else None

            wait_until(lambda: row(shm) == (2, (3, 0, 0), "decode"), what="the shm feed's row has the host blocks")
            wait_until(lambda: row(http) == (2, (3, 0, 0), "decode"), what="the HTTP feed's row has the host blocks")
        finally:
            running.call("POST", "/unregister", {"instance_id": 9, "model_name": "tiers"})


def test_shadow_figures_read_the_same_from_the_blob_and_from_metrics() -> None:
    from tui.feed import _blob_shadows, _metric_shadows
    from tui.model import Shadow

    sums = [10.0, 5.0, 80.0, 100.0, 110.0, 100.0]
    assert _blob_shadows({"greedy_overlap": sums, "bad": [1.0]}) == {"greedy_overlap": Shadow(*sums)}
    assert _blob_shadows(None) == {}
    names = (
        "kvrouter_shadow_decisions_total",
        "kvrouter_shadow_agreements_total",
        "kvrouter_shadow_overlap_blocks_total",
        "kvrouter_shadow_live_overlap_blocks_total",
        "kvrouter_shadow_cost_total",
        "kvrouter_shadow_live_cost_total",
    )
    metrics: dict[str, dict[tuple[tuple[str, str], ...], float]] = {
        name: {(("policy", "greedy_overlap"),): value} for name, value in zip(names, sums, strict=True)
    }
    assert _metric_shadows(metrics) == {"greedy_overlap": Shadow(*sums)}


def test_a_misconfigured_worker_shows_as_misconfig_whatever_its_stream_says() -> None:
    from tui.feed import _problems, _state

    assert _state("exact", False, None, False, "misconfigured") == "misconfig"
    assert _state("exact", False, "http_endpoint down", False, "misconfigured") == "unhealthy"
    assert _state("exact", True, None, False, "stale") == "stale"
    assert _problems({"no_events": "b", "block_size": "a"}) == ("a", "b")
    assert _problems(None) == ()


def test_a_decisions_predicted_blocks_come_through_as_their_own_term():
    """The service's explain terms carry ``overlap.predicted``; a router without the tier sends none (0)."""
    from tui.feed import decision_of

    worker = {"worker_id": 1, "dp_rank": 0, "overlap_blocks": 2, "cost": 3.0, "prob": 1.0, "selected": True}
    entry = {"seq": 1, "worker_id": 1, "dp_rank": 0, "explain": [{**worker, "overlap": {"device": 2, "predicted": 5}}]}
    (candidate,) = decision_of(entry).candidates
    assert (candidate.overlap_blocks, candidate.predicted_blocks) == (2, 5)
    (older,) = decision_of({**entry, "explain": [worker]}).candidates
    assert older.predicted_blocks == 0
