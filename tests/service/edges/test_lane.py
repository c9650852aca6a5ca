"""The hot lane (``service/lane.py``) against aiohttp, on one real service: the same answers, a
reservation's whole life on one kept-alive connection, pipelining in order, and every request the lane
does not take handed to aiohttp with the connection still serving.

The tests speak raw HTTP/1.1 over a socket (keep-alive, what the lane takes); ``conftest.http`` sends
``Connection: close``, which the lane leaves to aiohttp, so it is the other side of each comparison.
"""

from __future__ import annotations

import json
import socket
import urllib.request
from typing import Any
from urllib.parse import urlparse

import pytest

from kvrouter.hashing import block_hashes
from kvrouter.service.edges import lane as lane_module
from tests.service.conftest import BLOCK, MODEL, TOKEN, Running, all_trusted, http


class Raw:
    """One kept-alive HTTP/1.1 connection, written and read byte for byte."""

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.sock = socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 80), timeout=10)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> tuple[int, dict[str, str], Any]:
        """The next response: (status, headers with lower-case names, parsed JSON body)."""
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        if headers.get("content-type", "").startswith("application/json"):
            return status, headers, json.loads(body)
        return status, headers, body  # aiohttp's own refusals of what is not HTTP are plain text

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the service closed the connection")
        self.buffer += chunk


def request(method: str, path: str, body: object = None, *, token: str | None = TOKEN, extra: str = "") -> bytes:
    data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = f"{method} {path} HTTP/1.1\r\nHost: kvrouter\r\n{auth}{extra}Content-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


@pytest.fixture
def raw(running: Running) -> Any:
    conn = Raw(running.url)
    yield conn
    conn.close()


def http_text(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


def handed_over(running: Running) -> int:
    return running.service.core.counters.handovers


def comparable(answer: Any) -> Any:
    """An answer without what moves between two calls: the index summary, a fresh selection id."""
    if isinstance(answer, dict):
        return {k: v for k, v in answer.items() if k not in ("index", "selection_id")}
    return answer


OVER_LIMIT = (8 << 20) + 1
"""One byte past ``ServiceConfig.max_body_bytes``' default."""
PROMPT = [90_000 + i for i in range(3 * BLOCK + 5)]
SAME = [
    ("/select", {"model_name": MODEL, "token_ids": PROMPT}),
    ("/select", {"model_name": MODEL, "token_ids": PROMPT, "explain": True, "fallbacks": 1}),
    ("/select", {"model_name": "nobody", "token_ids": PROMPT}),  # 404
    ("/select", {"model_name": MODEL, "token_ids": [1, 2, 1 << 33]}),  # 400: not a u32
    ("/select", b'{"model_name": "m", "token_ids": [1, 2'),  # 400: not JSON
    ("/select", {"model_name": MODEL}),  # 400: no prompt
    ("/select_and_reserve", {"model_name": MODEL, "token_ids": PROMPT, "selection_id": "lane-1"}),
    ("/select_and_reserve", {"model_name": MODEL, "token_ids": PROMPT, "selection_id": "lane-1"}),  # 409
    ("/query", {"model_name": MODEL, "token_ids": PROMPT}),
    ("/query", {"model_name": MODEL, "routing_group": "default", "token_ids": PROMPT, "lora_name": None}),
    ("/query", {"model_name": "nobody", "token_ids": PROMPT}),  # 404
    ("/query", {"model_name": MODEL, "token_ids": [1, -2]}),  # 400: not a u32
    ("/query_by_hash", {"model_name": MODEL, "block_hashes": block_hashes(PROMPT, BLOCK)}),
    ("/query_by_hash", {"model_name": MODEL, "token_ids": PROMPT}),  # 400: no hashes
]


def test_the_lane_answers_as_aiohttp_does(running: Running, raw: Raw, wait_until: Any) -> None:
    running.workers[1].complete(PROMPT[: 3 * BLOCK], max_tokens=2)  # worker 2 caches 3 blocks: no tie to break

    def settled() -> bool:
        answer = running.ok("POST", "/select", SAME[1][1])
        return answer["overlap"]["gpu"] == 3 * BLOCK and all_trusted(answer)

    wait_until(settled, what="worker 2 indexed, both workers trusted")
    before = handed_over(running)
    ours = []
    for path, body in SAME:
        raw.send(request("POST", path, body))
        ours.append(raw.read())
    assert handed_over(running) == before  # every one answered by the lane, on one connection
    running.ok("DELETE", "/reservations/lane-1")
    for (path, body), (status, headers, answer) in zip(SAME, ours, strict=True):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        theirs = http(running.url + path, "POST", raw=data)
        assert (status, comparable(answer)) == (theirs[0], comparable(theirs[1])), (path, body)
        assert headers["content-type"] == theirs[2]["Content-Type"], (path, body, status)
        assert headers.get("x-gateway-destination-endpoint") == theirs[2].get("X-Gateway-Destination-Endpoint")
        if status == 200:
            assert int(headers["x-kvrouter-index-epoch"]) >= 0
        else:
            assert set(answer) == {"error"}
    running.ok("DELETE", "/reservations/lane-1")
    assert [status for status, _, _ in ours] == [200, 200, 404, 400, 400, 400, 200, 409, 200, 200, 404, 400, 200, 400]
    assert ours[8][2]["scores"] == {"2": {"0": 3 * BLOCK}}  # the query saw worker 2's three blocks


def by_lane(answer: tuple[int, dict[str, str], Any]) -> tuple[int, Any]:
    """(status, body) of an answer the lane gave: aiohttp names itself in ``Server``, the lane sends none."""
    status, headers, body = answer
    assert "server" not in headers, headers
    return status, body


def test_a_reservation_lives_and_ends_on_one_connection(running: Running, raw: Raw) -> None:
    body = {"model_name": MODEL, "token_ids": [70_000 + i for i in range(2 * BLOCK)], "selection_id": "lane-2"}
    raw.send(request("POST", "/select_and_reserve", body, token=None))
    status, headers, answer = raw.read()
    assert status == 401, answer  # a write needs the token
    assert headers["www-authenticate"] == "Bearer"
    assert "server" not in headers
    raw.send(request("POST", "/select_and_reserve", body))
    status, booked = by_lane(raw.read())
    assert status == 200, booked
    worker = booked["worker_id"]

    def row() -> dict[str, Any]:
        loads = running.ok("GET", "/loads")
        return next(r for group in loads for r in group["loads"] if r["worker_id"] == worker)

    assert row()["active_requests"] == 1
    assert row()["potential_prefill_tokens"] == 2 * BLOCK
    raw.send(request("POST", "/reservations/lane-2/prefill_complete", {"cached_tokens": "x"}))
    assert by_lane(raw.read())[0] == 400  # a bad report is refused and changes nothing
    raw.send(request("POST", "/reservations/lane-2/prefill_complete"))
    assert by_lane(raw.read()) == (200, {"status": "ok"})
    assert row()["potential_prefill_tokens"] == 0
    raw.send(request("DELETE", "/reservations/lane-2"))
    assert by_lane(raw.read()) == (200, {"status": "ok"})
    assert row()["active_requests"] == 0
    raw.send(request("DELETE", "/reservations/lane-2"))
    assert by_lane(raw.read())[0] == 404  # freed once
    status, text = http_text(running.url + "/metrics")
    assert status == 200
    lane_line = 'kvrouter_http_connections_total{layer="lane"}'
    (lane_served,) = [line for line in text.splitlines() if line.startswith(lane_line)]
    assert float(lane_served.split()[-1]) >= 1  # this connection, served by the lane to the end


def test_pipelined_requests_are_answered_in_order_across_the_hand_over(running: Running, raw: Raw) -> None:
    before = handed_over(running)
    select = {"model_name": MODEL, "token_ids": PROMPT}
    raw.send(
        request("POST", "/select", select)
        + request("POST", "/select", {"model_name": "nobody", "token_ids": PROMPT})
        + request("GET", "/health")  # not the lane's: the connection goes to aiohttp from here
        + request("POST", "/select", select)
    )
    answers = [raw.read() for _ in range(4)]
    assert [status for status, _, _ in answers] == [200, 404, 200, 200]
    assert answers[2][2]["status"] == "ok"
    assert comparable(answers[0][2]) == comparable(answers[3][2])
    assert handed_over(running) == before + 1


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (request("POST", "/select", b"x" * 64, extra="Content-Length: 64\r\n"), 400),  # two lengths
        (request("POST", "/select", b"1" * (OVER_LIMIT)), 413),
        (b"POST /select HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{}x\r\n0\r\n\r\n", 400),
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"POST /select HTTP/1.1\r\nX-Folded: a\r\n b\r\nContent-Length: 2\r\n\r\n{}", 400),
    ],
    ids=["two-lengths", "oversized", "chunked", "garbage", "folded-header"],
)
def test_what_the_lane_does_not_take_aiohttp_refuses_and_the_service_serves_on(
    running: Running, data: bytes, status: int
) -> None:
    conn = Raw(running.url)
    try:
        before = handed_over(running)
        conn.send(data)
        got, _, answer = conn.read()
        assert got == status, answer
        assert handed_over(running) == before + 1
    finally:
        conn.close()
    status, answer, _ = http(running.url + "/select", "POST", {"model_name": MODEL, "token_ids": PROMPT})
    assert status == 200, answer


def test_a_request_in_pieces_is_answered_once_whole(running: Running, raw: Raw) -> None:
    before = handed_over(running)
    data = request("POST", "/select", {"model_name": MODEL, "token_ids": PROMPT})
    for i in range(0, len(data), 7):  # the head and the body split anywhere
        raw.send(data[i : i + 7])
    status, _, answer = raw.read()
    assert status == 200, answer
    raw.send(data)
    assert raw.read()[0] == 200
    assert handed_over(running) == before


def test_an_idle_connection_is_closed_at_the_keep_alive_sweep(
    running: Running, raw: Raw, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw.send(request("POST", "/select", {"model_name": MODEL, "token_ids": PROMPT}))
    assert by_lane(raw.read())[0] == 200
    lane = running.service.lane
    assert lane is not None
    monkeypatch.setattr(lane_module, "KEEPALIVE_S", -1.0)  # every lane connection is idle past it now
    loop = running.service._loop
    assert loop is not None
    loop.call_soon_threadsafe(lane._sweep)
    with pytest.raises(ConnectionError):
        raw.read()  # closed by the service, not by a request
