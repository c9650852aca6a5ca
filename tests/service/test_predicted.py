"""The predicted tier in the service, on its default configuration: a reservation's blocks count on its worker
before any KV event confirms them, ``explain`` and ``/decisions/{id}`` show them as their own term, and a
worker that leaves takes its predictions with it."""

from __future__ import annotations

import random
import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from kvrouter.routing.config import KVROUTER_CONFIG
from kvrouter.service import ServiceConfig
from tests.service.conftest import BLOCK, MOCK_IDS, MODEL, TOKEN, Running, serving


@pytest.fixture(scope="module")
def kvrouter_defaults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    config = ServiceConfig(port=0, shards=1, auth_token=TOKEN, health_interval_secs=0.1, drain_secs=2.0)
    assert config.router == KVROUTER_CONFIG  # the tier is on without a flag
    with serving(config, tmp_path_factory.mktemp("predicted")) as run:
        yield run


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(blocks * BLOCK)]


def terms(answer: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {w["worker_id"]: w for w in answer["workers"]}


def test_a_reservation_is_predicted_on_its_worker_until_it_leaves(kvrouter_defaults: Running) -> None:
    run = kvrouter_defaults
    shared = prompt(1, 6)
    leader = run.ok("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": shared})
    chosen = leader["worker_id"]
    follower = {"model_name": MODEL, "token_ids": shared + prompt(2, 2), "explain": True, "selection_id": "f1"}
    answer = run.ok("POST", "/select", follower)
    assert answer["explain"]["weights"]["predicted_credit"] == KVROUTER_CONFIG.predicted_credit
    rows = terms(answer["explain"])
    assert rows[chosen]["overlap"]["predicted"] == 6  # no event has arrived: the engine was never asked
    assert rows[chosen]["overlap"]["device"] == 0
    assert rows[chosen]["predicted_credit_blocks"] >= 6  # 1 to 2 blocks of credit per predicted block
    assert rows[chosen]["overlap_credit_blocks"] == rows[chosen]["predicted_credit_blocks"]
    assert all(w["overlap"]["predicted"] == 0 for wid, w in rows.items() if wid != chosen)
    assert terms(run.ok("GET", "/decisions/f1")) == rows

    run.ok("DELETE", f"/reservations/{leader['selection_id']}")
    rows = terms(run.ok("POST", "/select", follower | {"selection_id": "f2"})["explain"])
    assert rows[chosen]["overlap"]["predicted"] == 0


def test_a_worker_that_leaves_takes_its_predictions(kvrouter_defaults: Running) -> None:
    run = kvrouter_defaults
    shared = prompt(3, 5)
    leader = run.ok("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": shared})
    chosen = leader["worker_id"]
    worker = run.workers[MOCK_IDS.index(chosen)]
    run.ok("POST", "/unregister", {"instance_id": chosen, "model_name": MODEL})
    run.register(chosen, worker)  # the same engine back, as after a restart
    follower = {"model_name": MODEL, "token_ids": shared + prompt(4, 1), "explain": True}
    rows = terms(run.ok("POST", "/select", follower)["explain"])
    assert rows[chosen]["overlap"]["predicted"] == 0
    loads = {(w["worker_id"], w["dp_rank"]): w for p in run.ok("GET", "/loads") for w in p["loads"]}
    assert loads[(chosen, 0)]["active_requests"] == 0


def predictions(run: Running) -> dict[tuple[int, str], float]:
    """``kvrouter_worker_predictions_total`` by (worker id, outcome)."""
    request = urllib.request.Request(run.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    out: dict[tuple[int, str], float] = {}
    for line in text.splitlines():
        match = re.match(
            r'kvrouter_worker_predictions_total\{dp_rank="0",outcome="(\w+)",worker_id="(\d+)"\} (\S+)', line
        )
        if match:
            out[(int(match[2]), match[1])] = float(match[3])
    return out


def test_metrics_count_each_prediction_and_how_it_ended(kvrouter_defaults: Running, wait_until: Any) -> None:
    run = kvrouter_defaults
    before = predictions(run)

    def grew(worker: int, outcome: str) -> float:
        return predictions(run).get((worker, outcome), 0.0) - before.get((worker, outcome), 0.0)

    # a minute's work on both workers, so neither is the idle one the recent-work factor favours; kept
    # queued through a quiet spell, so the decisions below see a busy fleet (the seen load), where a follower
    # waits for a prefix in flight rather than computing it again behind another queue
    warm = [
        run.ok("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": prompt(100 + n, 40)}) for n in range(4)
    ]
    assert {w["worker_id"] for w in warm} == set(MOCK_IDS)
    time.sleep(3.0)
    # a bet the engine never makes good: the leader is reserved, never sent
    shared = prompt(5, 6)
    leader = run.ok("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": shared})
    chosen = leader["worker_id"]
    follower = run.ok("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": shared + prompt(6, 1)})
    assert follower["worker_id"] == chosen  # a 6-block prefix in flight, 1 block of its own: it waits for it
    assert grew(chosen, "made") == 1
    run.ok("DELETE", f"/reservations/{follower['selection_id']}")
    assert grew(chosen, "contradicted") == 1

    # a bet the engine makes good: the prompt is computed on that worker before the reservation ends
    follower = run.ok("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": shared + prompt(7, 1)})
    assert (follower["worker_id"], grew(chosen, "made")) == (chosen, 2)
    run.workers[MOCK_IDS.index(chosen)].complete(shared, 1)  # straight to the engine: its events follow
    wait_until(
        lambda: (
            run.ok("POST", "/query", {"model_name": MODEL, "token_ids": shared})["scores"]
            .get(str(chosen), {})
            .get("0", 0)
            >= 6 * BLOCK
        ),
        what="the engine's events to reach the index",
    )
    run.ok("DELETE", f"/reservations/{follower['selection_id']}")
    run.ok("DELETE", f"/reservations/{leader['selection_id']}")
    for reservation in warm:
        run.ok("DELETE", f"/reservations/{reservation['selection_id']}")
    assert grew(chosen, "confirmed") == 1
    assert grew(chosen, "expired") == 0
