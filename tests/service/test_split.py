"""A disaggregated partition's decisions (``routing/disagg.py`` in the service): two choices, when not to split,
both answer shapes, the bookings of a split reservation and their end, and the proxy's one hop. A real
service on its own thread; the workers are registered endpoints that publish nothing (overlaps are 0), and
one real mock engine behind the proxy."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.client import HTTPConnection, HTTPResponse
from pathlib import Path
from typing import Any

import pytest

from kvrouter.routing.config import RouterConfig
from kvrouter.service import Service, ServiceConfig
from tests.conftest import Worker, free_port
from tests.service.conftest import BLOCK, http, own_segments, serve, start_mock, stop_mock, stop_served

pytestmark = pytest.mark.timeout(120)

MODEL = "pd"
LONG = list(range(1, 4096 + 1))  # 256 blocks: a fresh 4k prompt on an idle fleet splits
SHORT = list(range(5000, 5000 + 1000))  # 1,000 tokens: at most 2,048 uncached, so its decode worker prefills it
WORKERS = {
    81: ("prefill", "rack-a", 9081),
    82: ("prefill", "rack-b", 9082),
    83: ("decode", "rack-a", 9083),
    84: ("decode", "rack-b", 9084),
}


class Served:
    def __init__(self, url: str, mock: Worker) -> None:
        self.url = url
        self.mock = mock

    def call(self, method: str, path: str, body: object = None) -> tuple[int, Any, dict[str, str]]:
        return http(self.url + path, method, body)

    def select(self, prompt: list[int], *, reserve: bool = False, **fields: Any) -> tuple[int, Any, dict[str, str]]:
        route = "/select_and_reserve" if reserve else "/select"
        return self.call("POST", route, {"model_name": MODEL, "token_ids": prompt, **fields})

    def loads(self) -> dict[int, tuple[int, int, int]]:
        _, answer, _ = self.call("GET", "/loads")
        (partition,) = [p for p in answer if p["model_name"] == MODEL]
        return {
            row["worker_id"]: (row["potential_prefill_tokens"], row["potential_decode_blocks"], row["active_requests"])
            for row in partition["loads"]
        }


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("split")
    service = Service(ServiceConfig(port=0, shards=1, health_interval_secs=0.1, drain_secs=2.0, router=RouterConfig()))
    service.start()
    thread: threading.Thread | None = None
    mock: Worker | None = None
    try:
        mock = start_mock(85, folder / "worker85.err")
        thread, url = serve(service)
        run = Served(url, mock)
        for wid, (role, domain, port) in WORKERS.items():
            body = {
                "instance_id": wid,
                "endpoint": f"tcp://127.0.0.1:{free_port()}",
                "model_name": MODEL,
                "block_size": BLOCK,
                "role": role,
                "topology_domain": domain,
                "http_endpoint": f"http://127.0.0.1:{port}",
            }
            assert run.call("POST", "/register", body)[0] == 201
        yield run
    finally:
        stop_served(service, thread)
        if mock is not None:
            assert stop_mock(mock) == 0
    assert own_segments() == []


def test_a_fresh_long_prompt_is_split_and_both_choices_are_answered(served: Served):
    status, answer, headers = served.select(LONG, explain=True, fallbacks=1)
    assert status == 200, answer
    assert answer["split"] is True
    assert "selection_id" not in answer  # /select books nothing
    prefill, decode = answer["prefill"], answer["decode"]
    assert prefill["worker_id"] in (81, 82)
    # the decode worker in the prefill worker's domain: the other one's missing blocks cross a slow link
    expected = 83 if prefill["worker_id"] == 81 else 84
    assert decode["worker_id"] == expected
    for part in (prefill, decode):
        assert set(part) >= {"worker_id", "dp_rank", "endpoint", "address", "overlap", "cost", "explain", "fallbacks"}
    assert {w["worker_id"] for w in prefill["explain"]["workers"]} == {81, 82}
    costs = {c["worker_id"]: c["cost"] for c in decode["explain"]["decode_costs"]}
    assert costs == {expected: 256.0, ({83, 84} - {expected}).pop(): 256.0 * 8}
    assert [f["worker_id"] for f in decode["fallbacks"]] == [({83, 84} - {expected}).pop()]
    assert [f["worker_id"] for f in prefill["fallbacks"]] == [({81, 82} - {prefill["worker_id"]}).pop()]
    other = ({83, 84} - {expected}).pop()  # the decode worker, then its fallback
    assert (
        headers["X-Gateway-Destination-Endpoint"] == f"127.0.0.1:{WORKERS[expected][2]},127.0.0.1:{WORKERS[other][2]}"
    )
    assert headers["X-Kvrouter-Prefill-Endpoint"] == f"127.0.0.1:{WORKERS[prefill['worker_id']][2]}"


def test_a_short_prompt_is_prefilled_by_its_decode_worker(served: Served):
    status, answer, headers = served.select(SHORT)
    assert status == 200, answer
    assert answer["split"] is False
    assert answer["local_prefill_reason"].startswith("short_prefill: 1000 uncached tokens")
    assert answer["worker_id"] in (83, 84)  # today's flat shape, with the two keys
    assert "X-Kvrouter-Prefill-Endpoint" not in headers


def test_a_split_reservation_books_both_workers_and_its_first_token_ends_the_prefill_hop(served: Served):
    before = served.loads()
    status, answer, _ = served.select(LONG, reserve=True, selection_id="pd-1")
    assert status == 200, answer
    assert (answer["split"], answer["selection_id"]) == (True, "pd-1")
    p, d = answer["prefill"]["worker_id"], answer["decode"]["worker_id"]
    booked = served.loads()
    assert booked[p][0] - before[p][0] == 4096  # the prompt's prefill, queued on the prefill worker
    assert booked[p][2] - before[p][2] == 1
    assert booked[d][2] - before[d][2] == 1  # and the request on the decode worker
    assert booked[d][1] - before[d][1] == 256

    status, kept, _ = served.call("GET", "/decisions/pd-1")
    assert status == 200, kept
    assert (kept["worker_id"], kept["prefill"]["worker_id"]) == (d, p)  # both choices kept, each explained
    assert {w["worker_id"] for w in kept["prefill"]["workers"]} == {81, 82}

    assert served.call("POST", "/reservations/pd-1/prefill_complete", {})[0] == 200
    done = served.loads()
    assert done[p] == before[p]  # the prefill hop's booking is gone
    assert (done[d][0], done[d][2]) == (before[d][0], before[d][2] + 1)  # the decode worker's: decoding now
    assert served.call("DELETE", "/reservations/pd-1")[0] == 200
    assert served.loads() == before


def test_a_split_reservations_reuse_report_is_no_accuracy_sample(served: Served):
    """Its decode engine reports the KV it pulled as cached, which no index predicts: the report (a gateway's
    here, the proxy's alike) leaves the decode worker's index accuracy as it was."""

    def reports(worker: int) -> int:
        (row,) = [r for r in served.call("GET", "/workers")[1] if r["instance_id"] == worker]
        return int((row.get("accuracy") or {}).get("0", {}).get("reports", 0))

    status, answer, _ = served.select(LONG, reserve=True, selection_id="pd-acc")
    assert (status, answer["split"]) == (200, True)
    decode = answer["decode"]["worker_id"]
    before = reports(decode)
    assert served.call("POST", "/reservations/pd-acc/prefill_complete", {"cached_tokens": 4096})[0] == 200
    assert reports(decode) == before
    assert served.call("DELETE", "/reservations/pd-acc")[0] == 200


def test_freeing_a_split_reservation_before_its_first_token_frees_both(served: Served):
    before = served.loads()
    status, answer, _ = served.select(LONG, reserve=True, selection_id="pd-2")
    assert (status, answer["split"]) == (200, True)
    assert served.call("DELETE", "/reservations/pd-2")[0] == 200
    assert served.loads() == before


def test_the_proxy_forwards_a_short_prompt_whole_to_a_decode_worker(served: Served):
    """300 tokens: not split, so the request goes whole to a decode-capable worker (the real mock engine 85,
    registered as role both; the prefill worker 86 has no http endpoint and is not asked), nothing stays booked."""
    mock = served.mock
    body = {
        "instance_id": 85,
        "endpoint": mock.events[0],
        "replay_endpoint": mock.replay[0],
        "model_name": "pd-proxy",
        "block_size": BLOCK,
        "http_endpoint": mock.http,
    }
    assert served.call("POST", "/register", body)[0] == 201
    prefill = {"instance_id": 86, "endpoint": f"tcp://127.0.0.1:{free_port()}", "model_name": "pd-proxy"}
    assert served.call("POST", "/register", {**prefill, "block_size": BLOCK, "role": "prefill"})[0] == 201
    request = urllib.request.Request(
        served.url + "/v1/completions",
        data=b'{"model": "pd-proxy", "prompt": ' + str(LONG[:300]).encode() + b', "max_tokens": 3}',
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": "Bearer s3cret"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        assert response.headers["X-Kvrouter-Worker"].startswith("85")  # the decode-capable engine, whole
    _, loads, _ = served.call("GET", "/loads")
    (partition,) = [p for p in loads if p["model_name"] == "pd-proxy"]
    assert all(row["active_requests"] == 0 for row in partition["loads"])


@pytest.fixture(scope="module")
def hops(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Worker, Worker]]:
    """A real prefill engine (87) and decode engine (88) in partition ``pd-hops``, which speak vLLM's exchange."""
    folder = tmp_path_factory.mktemp("hops")
    started: list[Worker] = []
    try:
        for wid, role in ((87, "prefill"), (88, "decode")):
            worker = start_mock(wid, folder / f"worker{wid}.err", "--role", role)
            started.append(worker)
            body = {
                "instance_id": wid,
                "endpoint": worker.events[0],
                "replay_endpoint": worker.replay[0],
                "model_name": "pd-hops",
                "block_size": BLOCK,
                "http_endpoint": worker.http,
                "role": role,
            }
            assert served.call("POST", "/register", body)[0] == 201
        yield started[0], started[1]
    finally:
        assert [stop_mock(worker) for worker in started] == [0] * len(started)


def complete(served: Served, prompt: list[int], **extra: Any) -> tuple[int, bytes, dict[str, str]]:
    body = {"model": "pd-hops", "prompt": prompt, "max_tokens": 4, **extra}
    request = urllib.request.Request(
        served.url + "/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": "Bearer s3cret"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read(), dict(exc.headers)


def held_blocks(worker: Worker) -> int:
    return sum(len(rank["blocks"]) for rank in worker.cache()["ranks"])


def nothing_booked(served: Served, model: str) -> bool:
    _, loads, _ = served.call("GET", "/loads")
    return all(row["active_requests"] == 0 for p in loads if p["model_name"] == model for row in p["loads"])


@pytest.mark.parametrize("stream", [False, True])
def test_the_proxy_runs_both_hops_of_a_split_request(served: Served, hops: tuple[Worker, Worker], stream: bool):
    """The prefill hop on 87 (one token, kv_transfer_params), then the original request on 88 with the prefill
    answer's parameters: 88 pulls the KV over its socket, reuses it and answers; nothing stays booked."""
    prefill, decode = hops
    prompt = list(range(100_000 + 10_000 * stream, 100_000 + 10_000 * stream + 3000))  # fresh, 187 blocks: split
    before, computed = held_blocks(decode), held_blocks(prefill)
    status, data, headers = complete(served, prompt, stream=stream)
    assert status == 200, data
    assert headers["X-Kvrouter-Worker"] == "88:0"
    if stream:
        assert data.rstrip().endswith(b"data: [DONE]")
    else:
        answer = json.loads(data)
        assert answer["usage"]["completion_tokens"] == 4
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == (3000 // BLOCK) * BLOCK  # all pulled
    assert held_blocks(prefill) >= computed + 3000 // BLOCK  # the prefill engine computed the prompt
    assert held_blocks(decode) >= before + 3000 // BLOCK  # and the decode engine cached what it pulled
    assert nothing_booked(served, "pd-hops")


def test_a_failed_pull_reaches_the_client_as_an_error_and_nothing_stays_booked(served: Served, tmp_path: Path):
    """A prefill engine whose offers expire at once: the decode engine's pull finds nothing, answers 502, and the
    proxy passes it on."""
    prefill = start_mock(89, tmp_path / "worker89.err", "--role", "prefill", "--kv-hold-secs", "0.001")
    decode = start_mock(90, tmp_path / "worker90.err", "--role", "decode")
    try:
        for worker, wid, role in ((prefill, 89, "prefill"), (decode, 90, "decode")):
            body = {"instance_id": wid, "endpoint": worker.events[0], "model_name": "pd-expired"}
            body |= {"block_size": BLOCK, "http_endpoint": worker.http, "role": role}
            assert served.call("POST", "/register", body)[0] == 201
        request = {"model": "pd-expired", "prompt": list(range(200_000, 203_000)), "max_tokens": 2}
        status, answer, _ = served.call("POST", "/v1/completions", request)
        assert status == 502
        assert "KV pull" in json.dumps(answer)
        assert nothing_booked(served, "pd-expired")
    finally:
        assert [stop_mock(prefill), stop_mock(decode)] == [0, 0]


def test_a_prefill_worker_that_refuses_is_skipped_and_the_decode_worker_prefills(served: Served, hops: Any):
    """The only prefill worker of ``pd-refused`` listens nowhere: its refusal marks it down, the request is
    decided again, and with no prefill worker left the decode engine (88) prefills it itself."""
    _, decode = hops
    dead = {"instance_id": 91, "endpoint": f"tcp://127.0.0.1:{free_port()}", "model_name": "pd-refused"}
    dead |= {"block_size": BLOCK, "http_endpoint": f"http://127.0.0.1:{free_port()}", "role": "prefill"}
    assert served.call("POST", "/register", dead)[0] == 201
    live = {"instance_id": 92, "endpoint": decode.events[0], "model_name": "pd-refused", "block_size": BLOCK}
    assert served.call("POST", "/register", {**live, "http_endpoint": decode.http, "role": "decode"})[0] == 201
    request = {"model": "pd-refused", "prompt": list(range(300_000, 303_000)), "max_tokens": 2}
    status, answer, headers = served.call("POST", "/v1/completions", request)
    assert status == 200, answer
    assert headers["X-Kvrouter-Worker"] == "92:0"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed there, not pulled
    assert nothing_booked(served, "pd-refused")


@pytest.fixture
def slow_pair(served: Served, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Worker, Worker, str]]:
    """A prefill and a decode engine at real speed (a long answer takes seconds) in a partition of their own."""
    model = f"pd-slow-{request.node.name[-12:]}"
    base = 93 if "away" in request.node.name else 95
    started: list[Worker] = []
    try:
        for wid, role in ((base, "prefill"), (base + 1, "decode")):
            worker = start_mock(wid, tmp_path / f"worker{wid}.err", "--role", role, speedup="1")
            started.append(worker)
            body = {"instance_id": wid, "endpoint": worker.events[0], "model_name": model, "block_size": BLOCK}
            assert served.call("POST", "/register", {**body, "http_endpoint": worker.http, "role": role})[0] == 201
        yield started[0], started[1], model
    finally:
        for worker in started:
            if worker.proc.poll() is None:
                stop_mock(worker)


def open_stream(served: Served, model: str, prompt: list[int], max_tokens: int) -> HTTPResponse:
    """A streamed completion through the proxy, its first chunk read."""
    host, port = served.url.removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True})
    connection.request(
        "POST", "/v1/completions", body, {"Content-Type": "application/json", "Authorization": "Bearer s3cret"}
    )
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # the first token: both hops done
    return response


def test_a_client_that_goes_away_from_a_split_request_leaves_nothing_booked(served: Served, slow_pair: Any):
    _, _, model = slow_pair
    response = open_stream(served, model, list(range(400_000, 403_000)), 2000)
    response.close()  # gone, with 1,999 tokens still to come
    deadline = time.monotonic() + 10
    while not nothing_booked(served, model):
        assert time.monotonic() < deadline, "the split request stayed booked after its client left"
        time.sleep(0.05)


def test_a_decode_worker_dropping_mid_stream_is_an_error_in_band_and_nothing_stays_booked(
    served: Served, slow_pair: Any
):
    _, decode, model = slow_pair
    response = open_stream(served, model, list(range(500_000, 503_000)), 2000)
    decode.proc.kill()  # mid-stream
    rest = response.read()
    assert b"failed mid-stream" in rest
    deadline = time.monotonic() + 10
    while not nothing_booked(served, model):
        assert time.monotonic() < deadline, "the split request stayed booked after its decode worker died"
        time.sleep(0.05)
