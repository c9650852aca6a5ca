"""``POST /v1/completions`` through a real service to real mock engines, and session affinity.

Four ``kvrouter mock-worker`` processes: workers 1 and 2 (partition ``m``) answer in microseconds; worker
3 (partition ``slow``) runs at real speed, so a long decode keeps a stream open while the test looks at
the load and then walks away; worker 4 (partition ``r``) is the live fallback beside worker 5, whose
``http_endpoint`` is a port nothing listens on. The health loop is slowed to once a minute so the proxy,
not the health probe, is what finds worker 5 dead. Every test ends with no reservation left booked.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvrouter.routing.config import RouterConfig
from kvrouter.service import Service, ServiceConfig
from kvrouter.service.core.affinity import SESSION_HEADER, Affinity
from kvrouter.service.edges.proxy import WORKER_HEADER
from tests.conftest import _wait_until, free_port
from tests.service.conftest import BLOCK, TOKEN, MockSpec, Running, serving

pytestmark = pytest.mark.timeout(120)

TTL = 3.0
"""Session affinity TTL of the fixture's service [s]."""
T = TypeVar("T")


def prompt(seed: int, blocks: int, tail: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(blocks * BLOCK + tail)]


def tokenizer_file(path: Path) -> Path:
    """A word-level ``tokenizer.json`` built locally (no download): ``a`` .. ``z`` are ids 1 .. 26."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{chr(ord("a") + i): i + 1 for i in range(26)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("proxy")
    config = ServiceConfig(
        port=0,
        shards=1,
        auth_token=TOKEN,
        health_interval_secs=60.0,
        drain_secs=2.0,
        router=RouterConfig(),
        session_affinity_ttl_secs=TTL,
        tokenizer=str(tokenizer_file(tmp / "tokenizer.json")),
    )
    fleet = [
        MockSpec(wid, model, speedup="1" if wid == 3 else "10000")
        for wid, model in ((1, "m"), (2, "m"), (3, "slow"), (4, "r"))
    ]
    with serving(config, tmp, fleet=fleet) as run:
        _wait_until(lambda: listening(run.service, 4), what="the engine following the four mock engines")
        yield run


def on_loop(service: Service, fn: Callable[[], T]) -> T:
    """Run ``fn`` on the service's event loop (its state has one user) and return its result."""
    loop = service._loop
    assert loop is not None

    async def call() -> T:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(10)


def listening(service: Service, count: int) -> bool:
    """The engine follows ``count`` streams, each past its first restore (events sent now are kept)."""
    rows = on_loop(service, service.engine.workers)
    return len(rows) == count and all(row.state in ("exact", "partial") for row in rows.values())


def booked(run: Running) -> int:
    return on_loop(run.service, lambda: len(run.service.core.reservations))


def load(run: Running, model: str, worker_id: int) -> dict[str, Any]:
    _, answer, _ = run.call("GET", "/loads")
    (partition,) = [p for p in answer if p["model_name"] == model]
    (entry,) = [e for e in partition["loads"] if e["worker_id"] == worker_id]
    return entry  # type: ignore[no-any-return]


def open_completion(
    run: Running, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    parts = urllib.parse.urlsplit(run.url)
    assert parts.hostname is not None
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(body),
        {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}", **(headers or {})},
    )
    return conn, conn.getresponse()


def complete(
    run: Running, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    """A whole completion through the proxy: (status, parsed JSON or the SSE events, headers)."""
    conn, response = open_completion(run, body, headers)
    try:
        data = response.read()
        if response.getheader("Content-Type", "").startswith("text/event-stream"):
            events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
            return response.status, events, dict(response.getheaders())
        return response.status, json.loads(data), dict(response.getheaders())
    finally:
        conn.close()


def test_non_streamed_completion_books_the_chosen_worker_and_frees_it(proxied: Running):
    before = proxied.service.core.counters.reservations
    status, answer, headers = complete(proxied, {"model": "m", "prompt": prompt(1, blocks=2), "max_tokens": 4})
    assert status == 200, answer
    worker_id, rank = (int(x) for x in headers[WORKER_HEADER].split(":"))
    assert answer["kvrouter"]["worker_id"] == worker_id
    assert answer["usage"]["prompt_tokens"] == 2 * BLOCK + 3
    assert proxied.service.core.counters.reservations == before + 1
    _, ring, _ = proxied.call("GET", "/decisions?since=0")
    (decision,) = [d for d in ring["decisions"] if d["selection_id"] == headers["X-Kvrouter-Selection-Id"]]
    assert decision["reserved"] is True
    assert (decision["worker_id"], decision["dp_rank"]) == (worker_id, rank)
    assert booked(proxied) == 0
    assert load(proxied, "m", worker_id)["active_requests"] == 0
    # a batch of one is one prompt; the partition default model when none is named is refused as unknown
    status, answer, _ = complete(proxied, {"model": "m", "prompt": [prompt(2, blocks=1)], "max_tokens": 1})
    assert status == 200, answer
    assert complete(proxied, {"prompt": prompt(3, blocks=1)})[0] == 404  # "default" has no workers here
    assert booked(proxied) == 0


def test_streamed_completion_passes_chunks_through_and_frees(proxied: Running):
    body = {"model": "m", "prompt": prompt(4, blocks=3), "max_tokens": 3, "stream": True}
    status, events, headers = complete(proxied, body)
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]
    assert str(chunks[0]["kvrouter"]["worker_id"]) == headers[WORKER_HEADER].split(":")[0]
    assert booked(proxied) == 0


def test_a_stream_holds_its_load_until_the_client_goes_away(proxied: Running, wait_until):
    """Worker 3 decodes at real speed: 4,000 tokens keep the stream open for many seconds."""
    gone_before = proxied.service.proxy.client_gone
    tokens = prompt(5, blocks=4)
    conn, response = open_completion(proxied, {"model": "slow", "prompt": tokens, "max_tokens": 4000, "stream": True})
    try:
        assert response.status == 200
        assert response.getheader(WORKER_HEADER) == "3:0"
        first = response.readline()
        assert first.startswith(b"data: ")
        # the first chunk is out: prefill is complete, the request is still booked with its blocks
        entry = load(proxied, "slow", 3)
        assert entry["active_requests"] == 1
        assert entry["potential_prefill_tokens"] == 0
        assert entry["potential_decode_blocks"] >= 4
        assert booked(proxied) == 1
    finally:
        response.close()
        conn.close()
    wait_until(lambda: booked(proxied) == 0, what="the reservation freed after the client left")
    assert load(proxied, "slow", 3)["active_requests"] == 0
    assert proxied.service.proxy.client_gone == gone_before + 1


def test_a_refused_connection_is_retried_on_the_next_worker(proxied: Running):
    proxy = proxied.service.proxy
    retried = proxy.retried
    # book load on worker 4 so that the dead worker 5, registered next with no load, wins the decision
    held = proxied.ok("POST", "/select_and_reserve", {"model_name": "r", "token_ids": prompt(6, blocks=8)})
    assert held["worker_id"] == 4
    dead = f"http://127.0.0.1:{free_port()}"
    registration = {"instance_id": 5, "endpoint": f"tcp://127.0.0.1:{free_port()}", "model_name": "r"}
    proxied.ok("POST", "/register", {**registration, "block_size": BLOCK, "http_endpoint": dead})
    assert proxied.ok("POST", "/select", {"model_name": "r", "token_ids": prompt(7, blocks=1)})["worker_id"] == 5
    try:
        status, answer, headers = complete(proxied, {"model": "r", "prompt": prompt(7, blocks=1), "max_tokens": 2})
        assert status == 200, answer
        assert headers[WORKER_HEADER] == "4:0"
        assert proxy.retried == retried + 1
        (dead_worker,) = [w for w in proxied.call("GET", "/workers?model_name=r")[1] if w["instance_id"] == 5]
        assert dead_worker["skipped"] == {"0": "http_endpoint down"}
        # with worker 4 the only one left, a refusal of it is a 502, and nothing stays booked
        assert booked(proxied) == 1  # the held reservation only
    finally:
        proxied.ok("DELETE", f"/reservations/{held['selection_id']}")
        proxied.ok("POST", "/unregister", {"instance_id": 5, "model_name": "r"})
    assert booked(proxied) == 0


def test_overload_and_bad_prompts_get_an_error_and_book_nothing(proxied: Running):
    held = proxied.ok("POST", "/select_and_reserve", {"model_name": "slow", "token_ids": prompt(8, blocks=2)})
    proxied.ok("POST", "/busy_threshold", {"model_name": "slow", "active_prefill_tokens_threshold": 0})
    try:
        status, answer, _ = complete(proxied, {"model": "slow", "prompt": prompt(9, blocks=1), "max_tokens": 1})
        assert status == 529
        assert "overloaded" in answer["error"]
    finally:
        proxied.ok("POST", "/busy_threshold", {"model_name": "slow", "active_prefill_tokens_threshold": None})
        proxied.ok("DELETE", f"/reservations/{held['selection_id']}")
    for bad in ({"model": "m"}, {"model": "m", "prompt": []}, {"model": "m", "prompt": [[1, 2], [3]]}):
        status, answer, _ = complete(proxied, bad)
        assert status == 400, (bad, answer)
        assert "prompt" in answer["error"]
    assert complete(proxied, {"model": "m", "prompt": [1, 2**32]})[0] == 400
    assert booked(proxied) == 0


def test_text_prompts_go_through_the_configured_tokenizer(proxied: Running):
    status, answer, _ = complete(proxied, {"model": "m", "prompt": "a b c d e", "max_tokens": 1})
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == 5
    assert booked(proxied) == 0


def test_a_session_sticks_to_its_first_worker_until_its_ttl_lapses(proxied: Running, wait_until):
    w1, w2 = proxied.workers[0], proxied.workers[1]
    on_1, on_2, also_2 = (prompt(seed, blocks=6, tail=0) for seed in (10, 11, 12))
    w1.complete(on_1, max_tokens=1)
    w2.complete(on_2, max_tokens=1)
    w2.complete(also_2, max_tokens=1)

    def cached(tokens: list[int], worker_id: int) -> bool:
        answer = proxied.ok("POST", "/query", {"model_name": "m", "token_ids": tokens})
        return bool(answer["instances"].get(str(worker_id), {}).get("gpu") == len(tokens))

    def choice(tokens: list[int], session: str | None = None) -> str:
        status, answer, headers = complete(
            proxied,
            {"model": "m", "prompt": [*tokens, 1, 2], "max_tokens": 1},
            {SESSION_HEADER: session} if session else None,
        )
        assert status == 200, answer
        return headers[WORKER_HEADER]

    for tokens, worker_id in ((on_1, 1), (on_2, 2), (also_2, 2)):
        wait_until(lambda t=tokens, w=worker_id: cached(t, w), what=f"a prompt indexed on worker {worker_id}")
    assert choice(on_2) == "2:0"  # without a session the overlap decides
    assert choice(on_1, "chat-a") == "1:0"  # the session's first request binds it to worker 1
    assert choice(on_2, "chat-a") == "1:0"  # worker 2 holds this prompt, but the session stays
    selected = proxied.ok("POST", "/select", {"model_name": "m", "token_ids": also_2, "session_id": "chat-a"})
    assert selected["worker_id"] == 1  # /select reads the body's session_id
    status, selected, _ = proxied.call(
        "POST", "/select", {"model_name": "m", "token_ids": also_2}, headers={SESSION_HEADER: "chat-a"}
    )
    assert (status, selected["worker_id"]) == (200, 1)  # ... and the reference's header
    service = proxied.service
    wait_until(
        lambda: on_loop(service, lambda: service.core.affinity.worker("m:default", "chat-a")) is None, what="TTL"
    )
    assert choice(also_2, "chat-a") == "2:0"  # lapsed: decided afresh, and bound to worker 2 now
    assert on_loop(service, lambda: service.core.affinity.worker("m:default", "chat-a")) == (2, 0)
    assert booked(proxied) == 0


def test_affinity_bindings_expire_since_the_last_request_and_need_a_schedulable_worker(clock):
    affinity = Affinity(10.0, clock=lambda: clock.now)
    both = ((1, 0), (2, 0))
    assert affinity.candidates("p", "s", both) is both  # unbound: every candidate
    affinity.bind("p", "s", (2, 0))
    assert affinity.candidates("p", "s", both) == ((2, 0),)
    assert affinity.candidates("p", "s", both) is affinity.candidates("p", "s", both)  # one cached tuple
    assert affinity.candidates("q", "s", both) is both  # sessions are per partition
    assert affinity.candidates("p", "s", ((1, 0),)) == ((1, 0),)  # its worker is not schedulable
    clock.now += 9.0
    affinity.bind("p", "s", (2, 0))  # a request refreshes the TTL
    clock.now += 9.0
    assert affinity.worker("p", "s") == (2, 0)
    clock.now += 1.5
    assert affinity.worker("p", "s") is None
    assert len(affinity) == 0
    off = Affinity(None)
    off.bind("p", "s", (1, 0))
    assert off.candidates("p", "s", both) is both
    assert off.candidates("p", None, both) is both
