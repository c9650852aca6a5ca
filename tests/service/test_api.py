"""The HTTP API end to end: a real service, two real vLLM-format mock engines, plain HTTP.

Registration and readiness, ``/query`` against the engines' own caches, the reservation lifecycle
moving the load and cost terms as the cost function says, overload and busy thresholds, skipped
workers, the rings for ``kvrouter top``, and the refusals (malformed, oversized, unauthenticated,
unknown) after which the service still serves. The fixture (``conftest.py``) checks the shutdown.
"""

from __future__ import annotations

import random
import socket
from typing import Any

import pytest

from kvrouter.hashing import block_hashes
from tests.conftest import Worker
from tests.service.conftest import BLOCK, MODEL, Running

pytestmark = pytest.mark.timeout(120)


def prompt(seed: int, blocks: int, tail: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(blocks * BLOCK + tail)]


def held(worker: Worker) -> dict[tuple[int, int], set[tuple[int, ...]]]:
    cache = worker.cache()
    return {
        (cache["worker_id"], rank["dp_rank"]): {tuple(b["local_hashes"]) for b in rank["blocks"]}
        for rank in cache["ranks"]
    }


def depth(paths: set[tuple[int, ...]], path: tuple[int, ...]) -> int:
    n = 0
    while n < len(path) and path[: n + 1] in paths:
        n += 1
    return n


def device_tokens(answer: dict[str, Any], worker_id: int) -> int:
    return int(answer["instances"].get(str(worker_id), {}).get("dp", {}).get("0", 0))


def query_matches_cache(run: Running, worker: Worker) -> bool:
    """Every path the engine holds is answered by ``/query_by_hash`` with its depth, in tokens."""
    for (wid, _rank), paths in held(worker).items():
        for path in paths:
            _, answer, _ = run.call("POST", "/query_by_hash", {"model_name": MODEL, "block_hashes": list(path)})
            if device_tokens(answer, wid) != depth(paths, path) * BLOCK:
                return False
    return True


def test_registered_workers_are_listed_and_the_service_is_ready(running: Running, wait_until):
    wait_until(lambda: running.call("GET", "/ready")[0] == 200, what="/ready 200")
    _, ready, _ = running.call("GET", "/ready")
    assert ready["ready"] is True
    assert ready["schedulable_workers"] == 2
    assert ready["shards"] == {"0": "up"}
    status, workers, headers = running.call("GET", f"/workers?model_name={MODEL}")
    assert status == 200
    assert isinstance(workers, list)
    assert sorted(w["instance_id"] for w in workers) == [1, 2]
    assert all(w["block_size"] == BLOCK and w["status"] == "active" for w in workers)
    assert "X-Kvrouter-Index-Epoch" in headers
    wait_until(
        lambda: all(
            w["listeners"]["0"]["status"] == "active" for w in running.call("GET", f"/workers?model_name={MODEL}")[1]
        ),
        what="listeners active",
    )
    worker = running.workers[0]
    base = {"instance_id": 1, "endpoint": worker.events[0], "model_name": MODEL, "block_size": BLOCK}
    assert running.call("POST", "/register", base)[0] == 409  # duplicate
    assert running.call("POST", "/register", {**base, "instance_id": 9, "block_size": 32})[0] == 409  # block size
    assert running.call("POST", "/register", {**base, "model_name": "other"})[0] == 409  # id in another partition
    _, events, _ = running.call("GET", "/events?since=0")
    assert [e["worker_id"] for e in events["events"] if e["kind"] == "registered"][:2] == [1, 2]


def test_query_answers_what_the_engines_cache_holds(running: Running, wait_until):
    prompts = [prompt(100 + i, blocks=3 + i % 3) for i in range(6)]
    for i, tokens in enumerate(prompts):
        running.workers[i % 2].complete(tokens, max_tokens=4)
    for worker in running.workers:
        wait_until(lambda worker=worker: query_matches_cache(running, worker), what=f"/query matches {worker.http}")
    # /query (token ids) and /query_by_hash (Dynamo's local block hashes) agree, in tokens
    tokens = prompts[0]
    _, by_tokens, headers = running.call("POST", "/query", {"model_name": MODEL, "token_ids": tokens})
    _, by_hash, _ = running.call(
        "POST", "/query_by_hash", {"model_name": MODEL, "block_hashes": block_hashes(tokens, BLOCK)}
    )
    assert by_tokens["instances"] == by_hash["instances"]
    assert device_tokens(by_tokens, 1) == 3 * BLOCK  # the prompt's full blocks, cached on worker 1
    assert by_tokens["scores"]["1"]["0"] == 3 * BLOCK
    entry = by_tokens["instances"]["1"]
    assert entry["gpu"] <= entry["cpu"] <= entry["disk"] <= entry["longest_matched"]
    assert by_tokens["index"]["events_applied"] > 0
    assert int(headers["X-Kvrouter-Index-Events"]) > 0
    # i64 hashes as Dynamo sends them are the same hashes
    signed = [h - (1 << 64) if h >= 1 << 63 else h for h in block_hashes(tokens, BLOCK)]
    _, by_signed, _ = running.call("POST", "/query_by_hash", {"model_name": MODEL, "block_hashes": signed})
    assert by_signed["instances"] == by_hash["instances"]


def loads(running: Running) -> dict[int, dict[str, Any]]:
    _, answer, _ = running.call("GET", "/loads")
    (partition,) = [p for p in answer if p["model_name"] == MODEL]
    return {entry["worker_id"]: entry for entry in partition["loads"]}


def test_reserve_prefill_complete_free_move_load_and_cost_terms(running: Running, wait_until):
    warm = prompt(7, blocks=4, tail=0)
    running.workers[1].complete(warm, max_tokens=2)  # worker 2 caches the prompt's 4 blocks
    wait_until(lambda: query_matches_cache(running, running.workers[1]), what="worker 2 indexed")
    request = {"model_name": MODEL, "token_ids": [*warm, 11, 12, 13], "explain": True, "fallbacks": 1}
    _, chosen, headers = running.call("POST", "/select", request)
    costs = {w["worker_id"]: w for w in chosen["explain"]["workers"]}
    assert chosen["worker_id"] == 2
    assert costs[2]["overlap_blocks"] == 4
    assert costs[1]["overlap_blocks"] == 0
    isl = len(warm) + 3
    assert costs[2]["raw_prefill_blocks"] == pytest.approx(isl / BLOCK)  # nothing booked yet
    assert costs[2]["prefill_cost"] == pytest.approx(max(0.0, isl / BLOCK - 4))  # credit 1 per cached block
    assert chosen["overlap"]["gpu"] == 4 * BLOCK
    assert chosen["effective_prefill_tokens"] == isl - 4 * BLOCK
    assert chosen["address"] == running.workers[1].http.removeprefix("http://")
    assert [f["worker_id"] for f in chosen["fallbacks"]] == [1]
    assert headers["X-Gateway-Destination-Endpoint"].split(",")[0] == chosen["address"]

    before = loads(running)[2]
    _, booked, _ = running.call("POST", "/select_and_reserve", {**request, "selection_id": "r-1"})
    assert booked["selection_id"] == "r-1"
    assert booked["worker_id"] == 2
    after = loads(running)[2]
    assert after["active_requests"] == before["active_requests"] + 1
    assert after["potential_prefill_tokens"] == before["potential_prefill_tokens"] + isl - 4 * BLOCK
    assert after["potential_decode_blocks"] == before["potential_decode_blocks"] + isl // BLOCK
    # the next decision sees the booked load in worker 2's terms
    _, again, _ = running.call("POST", "/select", request)
    terms = {w["worker_id"]: w for w in again["explain"]["workers"]}
    assert terms[2]["raw_prefill_blocks"] == pytest.approx((isl - 4 * BLOCK + isl) / BLOCK)
    assert terms[2]["decode_cost"] == isl // BLOCK  # the shared prefix counts once
    assert running.call("POST", "/select_and_reserve", {**request, "selection_id": "r-1"})[0] == 409

    running.ok("POST", "/reservations/r-1/prefill_complete")
    assert loads(running)[2]["potential_prefill_tokens"] == before["potential_prefill_tokens"]
    running.ok("DELETE", "/reservations/r-1")
    freed = loads(running)[2]
    assert freed.pop("recent_prefill_tokens") > before.pop("recent_prefill_tokens")  # work done is remembered
    assert freed == before
    assert running.call("DELETE", "/reservations/r-1")[0] == 404
    _, decisions, _ = running.call("GET", "/decisions?since=0")
    assert any(d["selection_id"] == "r-1" and d["reserved"] for d in decisions["decisions"])
    last = decisions["last"]
    running.ok("POST", "/select", {"model_name": MODEL, "token_ids": warm})
    _, newer, _ = running.call("GET", f"/decisions?since={last}")
    assert [d["seq"] for d in newer["decisions"]] == [last + 1]


def test_every_worker_busy_is_an_overload_until_the_threshold_moves(running: Running):
    request = {"model_name": MODEL, "token_ids": prompt(55, blocks=2)}
    ids = []
    for i in range(2):  # one booked request each: both carry queued prefill
        _, booked, _ = running.call("POST", "/select_and_reserve", {**request, "selection_id": f"busy-{i}"})
        ids.append(booked["selection_id"])
    try:
        running.ok("POST", "/busy_threshold", {"model_name": MODEL, "active_prefill_tokens_threshold": 1})
        assert all(loads(running)[w]["potential_prefill_tokens"] > 1 for w in (1, 2))  # the load term spread them
        status, answer, _ = running.call("POST", "/select", request)
        assert status == 529
        assert "overloaded" in answer["error"]
        assert running.call("POST", "/select_and_reserve", request)[0] == 529
    finally:
        running.ok("POST", "/busy_threshold", {"model_name": MODEL, "active_prefill_tokens_threshold": None})
        for selection_id in ids:
            running.ok("DELETE", f"/reservations/{selection_id}")
    assert running.call("POST", "/select", request)[0] == 200
    assert len(running.service.core.reservations) == 0


def test_a_worker_whose_http_endpoint_is_down_is_skipped_and_shown(running: Running, wait_until):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    worker = running.workers[0]
    body = {"instance_id": 3, "endpoint": worker.events[0], "model_name": "skip", "http_endpoint": dead}
    running.ok("POST", "/register", body)
    try:

        def skipped() -> bool:
            _, workers, _ = running.call("GET", "/workers?model_name=skip")
            return bool(workers[0]["skipped"])

        wait_until(skipped, what="worker 3 skipped")
        status, answer, _ = running.call("POST", "/select", {"model_name": "skip", "token_ids": [1, 2, 3]})
        assert status == 503
        assert "no schedulable worker" in answer["error"]
    finally:
        running.ok("POST", "/unregister", {"instance_id": 3, "model_name": "skip"})


BAD_BODIES: list[tuple[str, Any, int]] = [
    ("/select", b"{not json", 400),
    ("/select", [1, 2], 400),
    ("/select", {"model_name": MODEL}, 400),
    ("/select", {"model_name": MODEL, "token_ids": "abc"}, 400),
    ("/select", {"model_name": MODEL, "token_ids": [1, 2**32]}, 400),
    ("/select", {"model_name": MODEL, "token_ids": [-1]}, 400),
    ("/select", {"model_name": MODEL, "token_ids": [1.5]}, 400),
    ("/select", {"model_name": MODEL, "token_ids": [[1], [2]]}, 400),
    ("/select", {"model_name": MODEL, "token_ids": [1, "2"]}, 400),
    ("/select", {"model_name": MODEL, "token_ids": [1], "explain": "yes"}, 400),
    ("/select", {"model_name": MODEL, "token_ids": [1], "fallbacks": -1}, 400),
    ("/select", {"model_name": MODEL, "block_hashes": [2**64]}, 400),
    ("/select", {"model_name": 5, "token_ids": [1]}, 400),
    ("/select", {"model_name": "nope", "token_ids": [1]}, 404),
    ("/select", {"model_name": MODEL, "routing_group": "nope", "token_ids": [1]}, 404),
    ("/select_and_reserve", {"model_name": MODEL, "token_ids": [1], "selection_id": 7}, 400),
    ("/query", {"model_name": MODEL}, 400),
    ("/query_by_hash", {"model_name": MODEL, "block_hashes": [1], "cache_salt": "x"}, 400),
    ("/query_by_hash", {"model_name": MODEL, "block_hashes": [None]}, 400),
    ("/register", {"instance_id": -1, "endpoint": "tcp://127.0.0.1:1"}, 400),
    ("/register", {"instance_id": 5, "endpoint": "http://nowhere"}, 400),
    ("/register", {"instance_id": 5, "endpoint": "tcp://127.0.0.1:1", "format": "trt"}, 400),
    ("/register", {"instance_id": 5, "endpoint": "tcp://127.0.0.1:1", "block_size": 0}, 400),
    ("/unregister", {"instance_id": 99, "model_name": MODEL}, 404),
    ("/reservations/none/prefill_complete", None, 404),
    ("/no_such_route", {}, 404),
]


def test_malformed_requests_are_refused_and_the_service_keeps_serving(running: Running):
    for path, body, expected in BAD_BODIES:
        raw = body if isinstance(body, bytes) else None
        status, answer, _ = running.call("POST", path, None if raw else body, raw=raw)
        assert status == expected, (path, body, status, answer)
        assert isinstance(answer["error"], str), (path, answer)
    big = b'{"model_name": "m", "token_ids": [' + b"1," * (5 << 20) + b"1]}"  # 10 MiB > 8 MiB
    status, answer, _ = running.call("POST", "/select", raw=big)
    assert status == 413
    assert "error" in answer
    assert running.call("GET", "/select")[0] == 405
    assert running.call("GET", "/health")[0] == 200
    assert running.call("POST", "/select", {"model_name": MODEL, "token_ids": prompt(3, 2)})[0] == 200
    assert len(running.service.core.reservations) == 0
    assert running.service.core.counters.http_errors


def test_write_routes_need_the_bearer_token(running: Running):
    body = {"model_name": MODEL, "token_ids": prompt(4, 1)}
    for token in (None, "wrong", "s3cret-but-longer"):
        status, answer, headers = running.call("POST", "/select_and_reserve", body, token=token)
        assert status == 401
        assert answer["error"]
        assert headers.get("WWW-Authenticate") == "Bearer"
        assert running.call("POST", "/register", {"instance_id": 8}, token=token)[0] == 401
        assert running.call("DELETE", "/reservations/x", token=token)[0] == 401
    assert running.call("POST", "/select", body, token=None)[0] == 200  # reads stay open
    assert running.call("GET", "/loads", token=None)[0] == 200
    assert len(running.service.core.reservations) == 0


def test_dropped_batches_are_replayed_and_query_ends_equal_to_the_engine(running: Running, wait_until):
    """A real vLLM-format publisher registered with its replay endpoint drops batches on the wire; the
    applier sees the gap, asks the replay socket for them, and ``/query`` ends equal to the engine's own
    cache, with the gap counted detected and recovered in ``GET /workers``."""
    worker = running.workers[0]
    assert worker.call("POST", "/faults", {"drop_batches": 3})[0] == 200
    for i in range(6):
        worker.complete(prompt(500 + i, blocks=2 + i % 3), max_tokens=2)
    wait_until(lambda: query_matches_cache(running, worker), what="/query equal to the engine's cache after a gap")

    def gaps() -> dict[str, Any]:
        rows = running.call("GET", f"/workers?model_name={MODEL}")[1]
        (row,) = [w for w in rows if w["instance_id"] == 1]
        return dict(row["listeners"]["0"])

    wait_until(lambda: gaps().get("gaps_recovered", 0) >= 1, what="the gap counted as recovered")
    listener = gaps()
    assert listener["gaps_detected"] >= 1
    assert listener["gaps_lost"] == 0
    assert listener["state"] == "exact"


def test_a_last_batch_lost_on_the_wire_is_fetched_once_the_stream_goes_quiet(running: Running, wait_until):
    """The one batch of a completion is dropped on the wire and the engine then stays silent: no later
    batch reveals the gap, so only the quiet-tail check (``plane/stream.py`` ``TAIL_CHECK_S``) can bring it
    back from the replay socket. ``/query`` ends equal to the engine's cache, the gap counted recovered."""
    worker = running.workers[1]

    def listener() -> dict[str, Any]:
        rows = running.call("GET", f"/workers?model_name={MODEL}")[1]
        (row,) = [w for w in rows if w["instance_id"] == 2]
        return dict(row["listeners"]["0"])

    before = listener()
    assert worker.call("POST", "/faults", {"drop_batches": 1})[0] == 200
    worker.complete(prompt(900, blocks=3, tail=0), max_tokens=1)
    wait_until(lambda: query_matches_cache(running, worker), what="the dropped last batch fetched after the quiet")
    wait_until(lambda: listener()["gaps_recovered"] > before["gaps_recovered"], what="the gap counted recovered")
    after = listener()
    assert after["gaps_detected"] == before["gaps_detected"] + 1
    assert after["gaps_lost"] == before["gaps_lost"]
