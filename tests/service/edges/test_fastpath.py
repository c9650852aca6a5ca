"""The ZMQ fast path end to end: a real service with its fast path installed, two real vLLM-format mock
engines registered through ``/register``, DEALER and REQ clients on real sockets.

Every op answers what its HTTP route answers for the same state (the ``index`` object's age aside: it
moves with the clock); reservations booked over ZMQ move the loads ``/loads`` shows; malformed,
oversized and unauthenticated messages get error replies and the socket keeps serving. The fixture
checks the shutdown: the fast path's socket is closed with the service, ``/dev/shm`` holds nothing.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvrouter.hashing import block_hashes
from kvrouter.routing.config import RouterConfig
from kvrouter.service import Service, ServiceConfig
from kvrouter.service.edges.fastpath import FRAME_SLACK, MAGIC, YIELD_EVERY, FastPath
from tests.conftest import free_port
from tests.service.conftest import BLOCK, MODEL, TOKEN, Running, all_trusted, serving

pytestmark = pytest.mark.timeout(120)

LIMIT = 64 << 10
REPLY_TIMEOUT_MS = 30_000


class Client:
    """One DEALER (or REQ) socket speaking the fast path; ``call`` sends a body and returns the reply."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str, kind: int = zmq.DEALER) -> None:
        self.sock = context.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.delimiter = kind == zmq.REQ

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_ms: int = REPLY_TIMEOUT_MS) -> list[bytes] | None:
        if not self.sock.poll(timeout_ms):
            return None
        return self.sock.recv_multipart()

    def call(self, body: dict[str, Any], *, delimiter: bool = False) -> dict[str, Any]:
        self.send(([b""] if delimiter and not self.delimiter else []) + [MAGIC, msgpack.packb(body)])
        frames = self.recv()
        assert frames is not None, "no reply"
        if delimiter and not self.delimiter:
            assert frames[0] == b""
            frames = frames[1:]
        assert frames[0] == MAGIC, frames
        reply = msgpack.unpackb(frames[1])
        assert isinstance(reply, dict)
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)


class FastRunning(Running):
    fastpath: FastPath
    context: zmq.Context[zmq.Socket[bytes]]

    def client(self, kind: int = zmq.DEALER) -> Client:
        return Client(self.context, self.fastpath.endpoint, kind)


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastRunning]:
    config = ServiceConfig(
        port=0,
        shards=1,
        auth_token=TOKEN,
        health_interval_secs=0.1,
        drain_secs=2.0,
        router=RouterConfig(),
        max_body_bytes=LIMIT,
    )
    assert config.zmq_port == 0  # port 0: the fast path on a free port too
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    fastpath: FastPath | None = None
    try:
        with serving(config, tmp_path_factory.mktemp("fastpath"), FastRunning) as run:
            assert isinstance(run, FastRunning)
            fastpath = run.service.fastpath  # installed by the service, bound and closed with its HTTP socket
            assert fastpath is not None
            run.fastpath, run.context = fastpath, context
            assert fastpath.endpoint.startswith("tcp://127.0.0.1:")
            yield run
    finally:
        context.destroy(linger=0)
    assert fastpath is not None
    assert fastpath._socket is None
    assert fastpath._context is None


@pytest.fixture
def client(fast: FastRunning) -> Iterator[Client]:
    c = fast.client()
    try:
        yield c
    finally:
        c.close()


def prompt(seed: int, blocks: int, tail: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(blocks * BLOCK + tail)]


def without_index(answer: dict[str, Any]) -> dict[str, Any]:
    assert set(answer["index"]) == {"epoch", "events_applied", "last_event_age_ms", "recovering"}
    return {k: v for k, v in answer.items() if k != "index"}


def indexed(fast: FastRunning, tokens: list[int], worker_id: int) -> bool:
    _, answer, _ = fast.call("POST", "/query", {"model_name": MODEL, "token_ids": tokens})
    return bool(answer["instances"].get(str(worker_id), {}).get("gpu", 0) == len(tokens) // BLOCK * BLOCK)


def loads(fast: FastRunning) -> dict[int, dict[str, Any]]:
    _, answer, _ = fast.call("GET", "/loads")
    (partition,) = [p for p in answer if p["model_name"] == MODEL]
    return {entry["worker_id"]: entry for entry in partition["loads"]}


def test_select_and_query_over_dealer_agree_with_http(fast: FastRunning, client: Client, wait_until):
    warm = prompt(7, blocks=4, tail=0)
    fast.workers[1].complete(warm, max_tokens=2)  # worker 2 caches the prompt's 4 blocks
    request = {"model_name": MODEL, "token_ids": [*warm, 11, 12, 13], "explain": True, "fallbacks": 1}

    def settled() -> bool:
        return indexed(fast, warm, 2) and all_trusted(fast.call("POST", "/select", request)[1])

    wait_until(settled, what="worker 2 indexed, both workers trusted")
    _, by_http, _ = fast.call("POST", "/select", request)
    by_zmq = client.call({"op": "select", "id": 7, **request})
    assert by_zmq.pop("id") == 7
    assert by_zmq["worker_id"] == 2
    assert without_index(by_zmq) == without_index(by_http)
    # the same with the delimiter frame (as REQ sends it), and with local block hashes
    assert without_index(client.call({"op": "select", **request}, delimiter=True)) == without_index(by_http)
    hashes = {"model_name": MODEL, "block_hashes": block_hashes(warm, BLOCK)}
    _, by_http, _ = fast.call("POST", "/select", hashes)
    assert without_index(client.call({"op": "select", **hashes})) == without_index(by_http)
    # token ids as msgpack bin of little-endian u32: the same answer as the list
    packed = {**request, "token_ids": np.array(request["token_ids"], dtype="<u4").tobytes()}
    _, by_http, _ = fast.call("POST", "/select", request)
    assert without_index(client.call({"op": "select", **packed})) == without_index(by_http)

    bin_warm = np.array(warm, dtype="<u4").tobytes()
    for op, body, zmq_body in (
        ("query", {"token_ids": warm}, {"token_ids": warm}),
        ("query", {"token_ids": warm}, {"token_ids": bin_warm}),  # msgpack bin of little-endian u32
        ("query_by_hash", {"block_hashes": block_hashes(warm, BLOCK)}, {"block_hashes": block_hashes(warm, BLOCK)}),
    ):
        _, by_http, _ = fast.call("POST", f"/{op}", {"model_name": MODEL, **body})
        by_zmq = client.call({"op": op, "model_name": MODEL, **zmq_body})
        assert without_index(by_zmq) == without_index(by_http)
        assert by_zmq["instances"]["2"]["gpu"] == 4 * BLOCK


def test_reserve_prefill_complete_free_over_dealer_move_the_loads(fast: FastRunning, client: Client, wait_until):
    warm = prompt(8, blocks=3, tail=0)
    fast.workers[0].complete(warm, max_tokens=2)
    wait_until(lambda: indexed(fast, warm, 1), what="worker 1 indexed")
    request = {"model_name": MODEL, "token_ids": [*warm, 1, 2]}
    isl = len(warm) + 2
    before = loads(fast)[1]
    _, by_http, _ = fast.call("POST", "/select_and_reserve", {**request, "selection_id": "h-1"})
    fast.ok("DELETE", "/reservations/h-1")

    booked = client.call({"op": "select_and_reserve", "token": TOKEN, "selection_id": "z-1", **request})
    assert booked["selection_id"] == "z-1"
    assert set(booked) == set(by_http)
    for key in ("worker_id", "dp_rank", "endpoint", "address", "overlap", "effective_prefill_tokens", "isl_tokens"):
        assert booked[key] == by_http[key], key
    assert booked["worker_id"] == 1
    after = loads(fast)[1]
    assert after["active_requests"] == before["active_requests"] + 1
    assert after["potential_prefill_tokens"] == before["potential_prefill_tokens"] + isl - 3 * BLOCK
    again = client.call({"op": "select_and_reserve", "token": TOKEN, "selection_id": "z-1", **request})
    assert again["status"] == 409
    assert "error" in again

    reports = fast.service.core.counters.reuse.get((1, 0), [0] * 6)[0]
    completed = {"op": "prefill_complete", "token": TOKEN, "selection_id": "z-1", "cached_tokens": 3 * BLOCK}
    assert client.call(completed) == {"status": "ok"}
    assert loads(fast)[1]["potential_prefill_tokens"] == before["potential_prefill_tokens"]
    assert fast.service.core.counters.reuse[1, 0][0] == reports + 1  # the engine's reuse, as over HTTP (accuracy.py)
    assert client.call({"op": "free", "token": TOKEN, "selection_id": "z-1", "id": "f"}) == {"status": "ok", "id": "f"}
    freed = loads(fast)[1]
    freed.pop("recent_prefill_tokens")
    assert freed == {k: v for k, v in before.items() if k != "recent_prefill_tokens"}
    gone = client.call({"op": "free", "token": TOKEN, "selection_id": "z-1"})
    assert gone["status"] == 404
    assert fast.call("DELETE", "/reservations/z-1")[0] == 404  # the same reservations as HTTP

    # a generated id, booked over ZMQ, freed over HTTP
    generated = client.call({"op": "select_and_reserve", "token": TOKEN, **request})["selection_id"]
    fast.ok("DELETE", f"/reservations/{generated}")


def test_req_clients_are_answered(fast: FastRunning):
    req = fast.client(zmq.REQ)
    try:
        for i in range(3):
            reply = req.call({"op": "select", "id": i, "model_name": MODEL, "token_ids": prompt(i, 2)})
            assert reply["id"] == i
            assert reply["worker_id"] in (1, 2)
    finally:
        req.close()


def test_a_burst_longer_than_one_turn_is_answered_in_full_and_in_order(fast: FastRunning):
    """The loop answers ``YIELD_EVERY`` messages a turn and must come back for the rest by itself: the
    socket's descriptor signals an arrival once, not while messages wait. Two clients' bursts, sent
    before either reads, each get every reply, in the order sent."""
    burst = 3 * YIELD_EVERY + 5
    body = {"op": "query", "model_name": MODEL, "token_ids": prompt(3, 2)}
    clients = [fast.client(), fast.client()]
    try:
        for client in clients:
            for n in range(burst):
                client.send([MAGIC, msgpack.packb({**body, "id": n})])
        for client in clients:
            ids: list[int] = []
            for _ in range(burst):
                frames = client.recv(timeout_ms=10_000)
                assert frames is not None, f"{len(ids)} of {burst} replies, then none"
                reply = msgpack.unpackb(frames[1])
                assert "error" not in reply, reply
                ids.append(reply["id"])
            assert ids == list(range(burst))
    finally:
        for client in clients:
            client.close()


def test_malformed_messages_get_errors_and_the_socket_keeps_serving(fast: FastRunning, client: Client):
    counters = fast.fastpath.counters
    malformed = counters.malformed
    good = {"op": "select", "model_name": MODEL, "token_ids": prompt(1, 2)}
    cases: list[tuple[list[bytes], int]] = [
        ([b"kvr2", msgpack.packb(good)], 400),  # another protocol version
        ([MAGIC], 400),  # no body
        ([MAGIC, msgpack.packb(good), b"extra"], 400),
        ([MAGIC, b"\xc1\xc1"], 400),  # not msgpack
        ([MAGIC, msgpack.packb(good) + b"\x00"], 400),  # trailing bytes
        ([MAGIC, msgpack.packb([1, 2, 3])], 400),  # not a map
        ([MAGIC, msgpack.packb({"op": "register", "instance_id": 1})], 400),  # HTTP-only
        ([MAGIC, msgpack.packb({"model_name": MODEL})], 400),  # no op
        ([MAGIC, msgpack.packb({1: 2})], 400),  # non-string key
    ]
    for frames, status in cases:
        client.send(frames)
        reply = client.recv()
        assert reply is not None, frames
        assert reply[0] == MAGIC, frames
        answer = msgpack.unpackb(reply[1])
        assert answer["status"] == status, (frames, answer)
        assert answer["error"]
    assert counters.malformed == malformed + len(cases)

    refused: list[tuple[dict[str, Any], int]] = [
        ({**good, "token_ids": "abc"}, 400),
        ({**good, "token_ids": [1, -1]}, 400),
        ({**good, "token_ids": [1 << 32]}, 400),
        ({**good, "token_ids": b"\x01\x00\x00"}, 400),  # bin: not a multiple of 4 bytes
        ({**good, "fallbacks": "x"}, 400),
        ({**good, "model_name": "nope"}, 404),
        ({"op": "free", "token": TOKEN, "selection_id": 5}, 400),
        ({"op": "prefill_complete", "token": TOKEN, "selection_id": "never"}, 404),
        ({"op": "prefill_complete", "token": TOKEN, "selection_id": "never", "cached_tokens": -1}, 400),
        ({"op": "query_by_hash", "model_name": MODEL, "block_hashes": [1, "x"]}, 400),
    ]
    for body, status in refused:
        answer = client.call({**body, "id": "r"})
        assert answer["status"] == status, (body, answer)
        assert answer["id"] == "r"
        assert "error" in answer
    # an id that is neither an int nor a short string is refused, not echoed
    answer = client.call({**good, "id": [1]})
    assert answer["status"] == 400
    assert "id" not in answer
    assert client.call(good)["worker_id"] in (1, 2)


def test_oversized_frames_are_refused_and_the_socket_keeps_serving(fast: FastRunning, client: Client):
    counters = fast.fastpath.counters
    oversized = counters.oversized
    good = {"op": "select", "model_name": MODEL, "token_ids": prompt(2, 2)}
    client.send([MAGIC, b"\x00" * (LIMIT + 1)])  # over the body limit: a 413 reply
    reply = client.recv()
    assert reply is not None
    assert msgpack.unpackb(reply[1])["status"] == 413
    assert counters.oversized == oversized + 1
    # far over it: libzmq drops the connection before buffering the frame; no reply, no harm
    big = fast.client()
    try:
        big.send([MAGIC, b"\x00" * (LIMIT + FRAME_SLACK + 1)])
        other = fast.client()
        try:
            assert other.call(good)["worker_id"] in (1, 2)
        finally:
            other.close()
    finally:
        big.close()
    assert client.call(good)["worker_id"] in (1, 2)
    assert fast.call("GET", "/health")[0] == 200


def test_write_ops_need_the_token_and_read_ops_do_not(fast: FastRunning, client: Client):
    counters = fast.fastpath.counters
    unauthorized = counters.unauthorized
    request = {"model_name": MODEL, "token_ids": prompt(3, 2)}
    for body in (
        {"op": "select_and_reserve", **request},
        {"op": "select_and_reserve", "token": "wrong", **request},
        {"op": "select_and_reserve", "token": TOKEN.encode(), **request},  # bytes, not a string
        {"op": "prefill_complete", "selection_id": "x"},
        {"op": "free", "token": None, "selection_id": "x"},
    ):
        answer = client.call(body)
        assert answer["status"] == 401, (body, answer)
    assert counters.unauthorized == unauthorized + 5
    assert len(fast.service.core.reservations) == 0
    assert client.call({"op": "select", **request})["worker_id"] in (1, 2)
    assert "instances" in client.call({"op": "query", **request})


def test_zmq_port_defaults_to_the_next_port_and_none_turns_it_off():
    assert ServiceConfig(port=9000).zmq_port == 9001
    assert ServiceConfig().zmq_port == 8491
    assert ServiceConfig(port=0).zmq_port == 0
    assert ServiceConfig(port=9000, zmq_port=7000).zmq_port == 7000
    off = ServiceConfig(zmq_port=None)
    assert off.zmq_port is None
    assert Service(off).fastpath is None


def test_a_disaggregated_partition_is_refused_with_a_clear_error(fast: FastRunning, client: Client):
    """Its answer has another shape (a prefill and a decode worker): HTTP answers it, the fast path says so."""
    for wid, role in ((71, "prefill"), (72, "decode")):
        body = {"instance_id": wid, "endpoint": f"tcp://127.0.0.1:{free_port()}", "model_name": "pd-fast"}
        fast.ok("POST", "/register", {**body, "block_size": BLOCK, "role": role})
    reply = client.call({"op": "select", "id": 3, "model_name": "pd-fast", "token_ids": list(range(1, 40))})
    assert reply["status"] == 400
    assert "disaggregated" in reply["error"]
    assert "use HTTP /select" in reply["error"]
    assert client.call({"op": "select", "model_name": MODEL, "token_ids": list(range(1, 40))})["worker_id"] in (1, 2)
