"""Index accuracy (``service/accuracy.py``): the router's predicted overlap against what the engine reused.

End to end through a real service and two real mock engines: completions through the proxy are compared
with the ``cached_tokens`` the mock engines report (and the figures in ``/workers`` and ``/metrics`` sum
exactly what the answers said); reservations whose client reports a reuse the router did not predict
raise a drift (warning, ``/events``, ``/workers``, ``/metrics``) that clears when reports match again.
"""

from __future__ import annotations

import json
import random
import urllib.request
from typing import Any

import pytest

from kvrouter.service.core.accuracy import DRIFT_BELOW, MIN_REPORTS, WINDOW, Accuracy
from kvrouter.service.core.counters import ServiceCounters
from tests.service.conftest import BLOCK, MODEL, Running, running
from tests.service.edges.test_proxy import complete

__all__ = ["running"]  # the module's service, from conftest

pytestmark = pytest.mark.timeout(180)


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(blocks * BLOCK)]


def test_reports_are_classed_in_blocks_and_a_drift_rises_and_clears() -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    accuracy = Accuracy(ServiceCounters(), lambda kind, fields: events.append((kind, fields)))
    worker = (3, 1)
    assert accuracy.observe(worker, 64, 64 + 15, 16) == "exact"  # a partial block is not a block
    assert accuracy.observe(worker, 64, 32, 16) == "over"
    assert accuracy.observe(worker, 0, 48, 16) == "under"
    assert accuracy.rolling(worker) is None  # too few reports to judge
    counts = accuracy.counters.reuse[worker]
    assert counts == [3, 1, 1, 1, 128, 64 + 15 + 32 + 48]
    assert accuracy.counters.reuse_error[worker].count == 3
    for _ in range(MIN_REPORTS):
        accuracy.observe(worker, 0, 32, 16)
    assert worker in accuracy.drifting
    ((kind, fields),) = events
    assert kind == "accuracy_drift"
    assert fields["worker_id"] == 3
    assert fields["under"] > fields["over"]
    for _ in range(WINDOW):
        accuracy.observe(worker, 32, 32, 16)
    assert accuracy.rolling(worker) == 1.0
    assert worker not in accuracy.drifting
    assert [kind for kind, _ in events] == ["accuracy_drift", "accuracy_recovered"]
    accuracy.forget(worker)
    assert accuracy.view(worker) is not None  # the lifetime counts stay
    assert accuracy.rolling(worker) is None
    assert DRIFT_BELOW < 1.0


def metric(run: Running, name: str, worker: int) -> float:
    with urllib.request.urlopen(run.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    prefix = f'{name}{{dp_rank="0",worker_id="{worker}"}} '
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def accuracy_of(run: Running, worker: int) -> dict[str, Any]:
    (row,) = [r for r in run.ok("GET", f"/workers?model_name={MODEL}") if r["instance_id"] == worker]
    return dict(row["accuracy"].get("0") or {})


def test_proxied_completions_match_what_the_engines_report(running: Running, wait_until) -> None:
    system = prompt(7, 4)
    reported: dict[int, int] = {}
    before = {w: accuracy_of(running, w).get("reports", 0) for w in (1, 2)}
    for i in range(8):
        tokens = system + prompt(100 + i, 2)
        body = {"model": MODEL, "prompt": tokens, "max_tokens": 2, "stream": i % 2 == 0}
        status, answer, headers = complete(running, body)
        assert status == 200, answer
        worker = int(headers["X-Kvrouter-Worker"].split(":")[0])
        last = json.loads(answer[-2]) if body["stream"] else answer
        reported[worker] = reported.get(worker, 0) + last["usage"]["prompt_tokens_details"]["cached_tokens"]
        # the next prompt is predicted only from what the index holds: wait for this one's blocks
        wait_until(
            lambda t=tokens, w=worker: (
                running.ok("POST", "/query", {"model_name": MODEL, "token_ids": t})["scores"]
                .get(str(w), {})
                .get("0", 0)
                == len(t)
            ),
            timeout=20,
        )
    for worker, cached in reported.items():
        view = accuracy_of(running, worker)
        assert view["reports"] - before[worker] > 0
        assert view["actual_tokens"] == cached  # the figures are the engines' own
        assert view["exact"] == view["reports"]  # every event seen before the next decision: all as predicted
        assert metric(running, "kvrouter_worker_reuse_actual_tokens_total", worker) == cached
    assert sum(accuracy_of(running, w).get("reports", 0) - before[w] for w in (1, 2)) == 8


def test_a_client_reporting_unpredicted_reuse_raises_a_drift_that_clears(running: Running) -> None:
    def reserve(seed: int) -> tuple[str, int]:
        answer = running.ok("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": prompt(seed, 2)})
        return answer["selection_id"], answer["worker_id"]

    # bad reports are refused and change nothing
    selection, worker = reserve(5000)
    for bad in ({"cached_tokens": "x"}, {"cached_tokens": -1}, {"cached_tokens": 1 << 40}):
        status, answer, _ = running.call("POST", f"/reservations/{selection}/prefill_complete", bad)
        assert status == 400, answer
        assert "cached_tokens" in answer["error"]
    running.ok("DELETE", f"/reservations/{selection}")
    start = accuracy_of(running, worker).get("reports", 0)
    # fresh prompts (predicted 0 blocks) reported as fully reused: the index would be missing stores
    for i in range(3 * MIN_REPORTS):  # spread over both workers: each gets a window's worth
        selection, _ = reserve(6000 + i)
        running.ok("POST", f"/reservations/{selection}/prefill_complete", {"cached_tokens": 2 * BLOCK})
        status, _, _ = running.call("POST", f"/reservations/{selection}/prefill_complete", {"cached_tokens": 0})
        assert status == 200  # a second report of one reservation is not counted again
        running.ok("DELETE", f"/reservations/{selection}")
    drifting = [w for w in (1, 2) if accuracy_of(running, w).get("drift")]
    assert drifting, [accuracy_of(running, w) for w in (1, 2)]
    for w in drifting:
        assert metric(running, "kvrouter_worker_accuracy_drift", w) == 1.0
    events = running.ok("GET", "/events?since=0")["events"]
    assert {e["worker_id"] for e in events if e["kind"] == "accuracy_drift"} >= set(drifting)
    assert sum(accuracy_of(running, w).get("reports", 0) for w in (1, 2)) >= start + 3 * MIN_REPORTS
    # reports as predicted again: the drift clears
    for i in range(4 * WINDOW):
        if not any(accuracy_of(running, w).get("drift") for w in (1, 2)):
            break
        selection, _ = reserve(7000 + i)
        running.ok("POST", f"/reservations/{selection}/prefill_complete", {"cached_tokens": 0})
        running.ok("DELETE", f"/reservations/{selection}")
    assert not any(accuracy_of(running, w).get("drift") for w in (1, 2))
    events = running.ok("GET", "/events?since=0")["events"]
    assert any(e["kind"] == "accuracy_recovered" for e in events)
