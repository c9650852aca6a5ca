"""``/metrics``: the collector reads a real engine's control segment, fed by real mock engines over ZMQ.

Two ``kvrouter mock-worker --format vllm`` processes publish their caches; one is registered with its
replay socket, one without. Drops on the wire (``/faults`` ``drop_batches``) must show up as gaps
``detected`` and then ``recovered`` (with replay) or ``lost`` (without); cached blocks must equal what
the engine holds. Values are read back by parsing the text exposition, as Prometheus would.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvrouter import Engine
from kvrouter.events.model import EngineHash, LocalHash, StorageTier, Stored, StoredBlock
from kvrouter.plane import WorkerSpec
from kvrouter.routing.slots import SlotManager
from kvrouter.service import PHASES
from kvrouter.service.core.histogram import Buckets
from kvrouter.service.edges.metrics import PartitionLoad, ServiceCollector, exposition, histogram
from tests.conftest import Worker, free_port

BLOCK = 16

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    """Every sample of the exposition, keyed by (sample name, labels)."""
    text = exposition(registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: Any) -> float:
    return samples[name, frozenset((k, str(v)) for k, v in labels.items())]


def families(registry: CollectorRegistry) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(exposition(registry).decode())}


def prompt(n: int) -> list[int]:
    return [1000 * n + i for i in range(3 * BLOCK)]


def test_scrape_follows_cached_blocks_and_gaps_of_real_engines(start_worker, wait_until):
    workers: list[Worker] = []
    for wid in (1, 2):
        port = free_port(2)
        options = ("--format", "vllm", "--num-gpu-blocks", "256", "--block-size", str(BLOCK))
        workers.append(start_worker(*options, events_port=port, replay_port=port + 1, worker_id=wid))
    replayed, unreplayed = workers
    registry = CollectorRegistry()
    with Engine(shards=1) as engine:
        registry.register(ServiceCollector(engine))
        engine.add_worker(WorkerSpec(1, replayed.events[0], replay_endpoint=replayed.replay[0], block_size=BLOCK))
        engine.add_worker(WorkerSpec(2, unreplayed.events[0], block_size=BLOCK))

        kinds = families(registry)
        assert kinds["kvrouter_build_info"] == "gauge"
        assert kinds["kvrouter_shard_up"] == "gauge"
        assert kinds["kvrouter_kv_event_gaps"] == "counter"
        assert kinds["kvrouter_worker_cached_blocks"] == "gauge"
        samples = scrape(registry)
        assert value(samples, "kvrouter_shard_up", shard=0) == 1.0
        assert value(samples, "kvrouter_shard_restarts_total", shard=0) == 0.0

        def caught_up(worker: Worker, wid: int) -> bool:
            row = engine.workers().get((wid, 0))
            return row is not None and row.last_id == worker.cache()["ranks"][0]["last_seq"]

        for n in range(4):
            for worker in workers:
                worker.complete(prompt(n), max_tokens=1)
        for wid, worker in ((1, replayed), (2, unreplayed)):
            wait_until(lambda w=worker, i=wid: caught_up(w, i), what=f"worker {wid}'s events applied")
        samples = scrape(registry)
        for wid, worker in ((1, replayed), (2, unreplayed)):
            held = len(worker.cache()["ranks"][0]["blocks"])
            assert held > 0
            assert value(samples, "kvrouter_worker_cached_blocks", worker_id=wid, dp_rank=0) == held
            assert value(samples, "kvrouter_worker_kv_events_total", worker_id=wid, dp_rank=0) > 0
            assert value(samples, "kvrouter_kv_event_gaps_total", worker_id=wid, dp_rank=0, outcome="detected") == 0
            assert value(samples, "kvrouter_worker_state", worker_id=wid, dp_rank=0, state="exact") == 1.0
        assert value(samples, "kvrouter_kv_events_total", shard=0) > 0
        assert value(samples, "kvrouter_listeners", status="exact") == 2.0

        for worker in workers:
            assert worker.call("POST", "/faults", {"drop_batches": 2})[0] == 200
        for n in range(4, 8):  # two dropped, then batches that reveal the gap
            for worker in workers:
                worker.complete(prompt(n), max_tokens=1)
        for wid, worker in ((1, replayed), (2, unreplayed)):
            wait_until(lambda w=worker, i=wid: caught_up(w, i), what=f"worker {wid} past the gap")
        wait_until(lambda: engine.workers()[1, 0].gaps_recovered >= 1, what="the gap replayed")
        samples = scrape(registry)

        def gaps(wid: int, outcome: str) -> float:
            return value(samples, "kvrouter_kv_event_gaps_total", worker_id=wid, dp_rank=0, outcome=outcome)

        assert gaps(1, "detected") >= 1
        assert (gaps(1, "recovered"), gaps(1, "lost")) == (gaps(1, "detected"), 0)
        assert gaps(2, "detected") >= 1
        assert (gaps(2, "recovered"), gaps(2, "lost")) == (0, gaps(2, "detected"))
        assert value(samples, "kvrouter_worker_state", worker_id=1, dp_rank=0, state="exact") == 1.0
        assert value(samples, "kvrouter_worker_state", worker_id=2, dp_rank=0, state="partial") == 1.0
        assert value(samples, "kvrouter_worker_cached_blocks", worker_id=1, dp_rank=0) == len(
            replayed.cache()["ranks"][0]["blocks"]
        )
        rejected = {dict(labels)["kind"] for name, labels in samples if name == "kvrouter_kv_events_rejected_total"}
        assert rejected == {
            "bad_event",
            "parent_not_found",
            "block_not_found",
            "invalid_block_sequence",
        }


def test_cached_blocks_per_tier_are_a_family_beside_the_device_count() -> None:
    """Blocks stored in the device and host tiers: ``kvrouter_worker_cached_blocks`` stays the device count,
    ``kvrouter_worker_tier_cached_blocks`` has one series per tier, the empty ones at 0."""
    registry = CollectorRegistry()
    with Engine(shards=1) as engine:
        registry.register(ServiceCollector(engine))
        device = tuple(StoredBlock(EngineHash(10 + i), LocalHash(100 + i)) for i in range(2))
        host = tuple(StoredBlock(EngineHash(20 + i), LocalHash(200 + i)) for i in range(3))
        engine.apply_event(7, Stored(7, None, device))
        engine.apply_event(7, Stored(7, None, host, tier=StorageTier.HOST))
        engine.flush()
        assert engine.workers()[7, 0].cached_by_tier == {"device": 2, "host": 3, "disk": 0, "shared": 0}
        assert families(registry)["kvrouter_worker_tier_cached_blocks"] == "gauge"
        samples = scrape(registry)
        assert value(samples, "kvrouter_worker_cached_blocks", worker_id=7, dp_rank=0) == 2
        by_tier = {
            dict(labels)["tier"]: count
            for (name, labels), count in samples.items()
            if name == "kvrouter_worker_tier_cached_blocks"
        }
        assert by_tier == {"device": 2, "host": 3, "disk": 0, "shared": 0}


def test_scrape_reads_slot_manager_load_and_front_histograms(wait_until: Callable[..., None]) -> None:
    slots = SlotManager(block_size=BLOCK)
    workers = ((1, 0), (2, 0))
    overhead: dict[tuple[str, ...], Buckets] = {("hash",): Buckets(), ("total",): Buckets()}
    overhead["hash",].observe(3e-5)
    overhead["total",].observe(2e-4)
    overhead["total",].observe(5.0)

    def front() -> list[Any]:
        return [histogram("kvrouter_routing_overhead_seconds", "Time per phase", overhead, ["phase"])]

    registry = CollectorRegistry()
    with Engine(shards=1) as engine:
        registry.register(
            ServiceCollector(engine, partitions=lambda: [PartitionLoad("m", "default", slots, workers)], front=front)
        )
        samples = scrape(registry)
        assert value(samples, "kvrouter_workers", model="m", routing_group="default") == 2
        assert value(samples, "kvrouter_worker_active_requests", worker_id=2, dp_rank=0) == 0
        hashes = [11, 12, 13]
        slots.add_request("a", (2, 0), hashes, 3 * BLOCK, 1)
        slots.add_request("b", (2, 0), hashes[:2], 2 * BLOCK, 0)
        samples = scrape(registry)
        assert value(samples, "kvrouter_worker_active_requests", worker_id=2, dp_rank=0) == 2
        assert value(samples, "kvrouter_worker_active_decode_blocks", worker_id=2, dp_rank=0) == 3
        assert value(samples, "kvrouter_worker_active_prefill_tokens", worker_id=2, dp_rank=0) == 4 * BLOCK
        assert value(samples, "kvrouter_worker_active_requests", worker_id=1, dp_rank=0) == 0
        slots.mark_prefill_completed("a")
        slots.free("b")
        samples = scrape(registry)
        assert value(samples, "kvrouter_worker_active_requests", worker_id=2, dp_rank=0) == 1
        assert value(samples, "kvrouter_worker_active_prefill_tokens", worker_id=2, dp_rank=0) == 0
        assert value(samples, "kvrouter_routing_overhead_seconds_count", phase="total") == 2
        assert value(samples, "kvrouter_routing_overhead_seconds_bucket", phase="total", le="+Inf") == 2
        assert value(samples, "kvrouter_routing_overhead_seconds_bucket", phase="total", le="0.0002") == 1
        assert value(samples, "kvrouter_routing_overhead_seconds_bucket", phase="hash", le="2.5e-05") == 0
        assert value(samples, "kvrouter_routing_overhead_seconds_bucket", phase="hash", le="5e-05") == 1
        assert value(samples, "kvrouter_routing_overhead_seconds_sum", phase="total") == 5.0002


def test_service_metrics_route_moves_with_decisions_load_and_events(start_worker, wait_until):
    """``GET /metrics`` on a running Service (installed by the service itself); a reservation moves the
    decision, selection, hit-rate, phase and load families, the mock engine's events move its cached
    blocks, HTTP is counted."""
    app = pytest.importorskip("kvrouter.service.process.app")
    config = pytest.importorskip("kvrouter.service.core.config")

    port = free_port(2)
    worker = start_worker(
        "--format", "vllm", "--block-size", str(BLOCK), events_port=port, replay_port=port + 1, worker_id=5
    )
    service = app.Service(config.ServiceConfig(port=0, shards=1))
    service.start()  # forks the applier: before the service's thread
    thread: threading.Thread | None = None
    try:
        ready: queue.Queue[str] = queue.Queue()
        thread = threading.Thread(target=lambda: asyncio.run(service.run(on_ready=ready.put)), daemon=True)
        thread.start()
        url = ready.get(timeout=60)
        registration = {
            "instance_id": 5,
            "endpoint": worker.events[0],
            "replay_endpoint": worker.replay[0],
            "model_name": "m",
            "block_size": BLOCK,
        }
        assert http(url + "/register", "POST", registration)[0] in (200, 201)
        worker.complete(prompt(1), max_tokens=1)
        held = len(worker.cache()["ranks"][0]["blocks"])

        def scraped() -> Samples:
            status, text = http(url + "/metrics", "GET")
            assert status == 200
            return {
                (s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
            }

        wait_until(
            lambda: (
                scraped().get(("kvrouter_worker_cached_blocks", frozenset({("worker_id", "5"), ("dp_rank", "0")})))
                == held
            ),
            what="the engine's blocks in /metrics",
        )
        status, answer = http(
            url + "/select_and_reserve", "POST", {"model_name": "m", "token_ids": prompt(1), "selection_id": "r1"}
        )
        assert status == 200, answer
        samples = scraped()
        assert value(samples, "kvrouter_decisions_total") == 1
        assert value(samples, "kvrouter_reservations_total") == 1
        assert value(samples, "kvrouter_selections_total", worker_id=5, dp_rank=0) == 1
        assert value(samples, "kvrouter_worker_active_requests", worker_id=5, dp_rank=0) == 1
        assert value(samples, "kvrouter_worker_active_decode_blocks", worker_id=5, dp_rank=0) == 3
        assert value(samples, "kvrouter_selected_overlap_blocks_total") == 3
        assert value(samples, "kvrouter_workers", model="m", routing_group="default") == 1
        assert value(samples, "kvrouter_decision_seconds_count") == 1
        assert value(samples, "kvrouter_kv_hit_rate_count") == 1
        for phase in PHASES:
            assert value(samples, "kvrouter_routing_overhead_seconds_count", phase=phase) == 1
        assert value(samples, "kvrouter_http_requests_total", endpoint="/select_and_reserve", method="POST") == 1
        # every request here said Connection: close, which the hot lane leaves to aiohttp (lane.py)
        assert value(samples, "kvrouter_http_connections_total", layer="lane") == 0
        assert value(samples, "kvrouter_http_connections_total", layer="aiohttp") >= 2
        assert http(url + "/reservations/r1", "DELETE")[0] == 200
        assert http(url + "/reservations/r1", "DELETE")[0] == 404
        samples = scraped()
        assert value(samples, "kvrouter_worker_active_requests", worker_id=5, dp_rank=0) == 0
        assert value(samples, "kvrouter_http_errors_total", endpoint="/reservations/{id}", status_class="4xx") == 1
    finally:
        service.stop()
        if thread is not None:
            thread.join(30)
        else:
            service.engine.close()
    assert thread is None or not thread.is_alive()


def http(url: str, method: str, body: object = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read().decode()
            return response.status, raw if url.endswith("/metrics") else json.loads(raw)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())
