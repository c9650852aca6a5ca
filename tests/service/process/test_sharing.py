"""``kvrouter up --fronts 2``: every front serves every connection (``service/process/sharing.py``), over real sockets.

What they check: on one kept-alive connection, either front answers while the other is stopped; the
requests of kept-alive connections sent from several threads are all answered; pipelined requests are
answered in order; a request that arrives in two parts is answered, and its connection stays with the
front that read it, as does one handed to aiohttp; ``Connection: close`` on a front's own connection
reaches the client at once although the other front held a copy; connections the clients close leave no
copy open in either front; no front ever holds two descriptors of one socket (its request lock would go
with the close of either); a shared connection is still served after the other front is killed; SIGTERM
stops everything and leaves nothing.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from kvrouter.service.process.sharing import Serving, serving_name
from tests.service.test_up import START_TIMEOUT_S, URL_LINE, other_fronts, start_up, stop_and_check

__all__ = ["start_up"]  # the fixture, shared with test_up

THREADS = 4
REQUESTS = 150
BOUND_S = 20.0


def select_body(seed: int) -> bytes:
    return json.dumps({"model_name": "default", "token_ids": [(seed * 7919 + j) % 30000 for j in range(64)]}).encode()


def raw_request(method: str, path: str, body: bytes = b"", headers: str = "") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{headers}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class Reader:
    """Responses off one raw socket, in order: ``(status, front, body)``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.data = b""

    def response(self) -> tuple[int, int, bytes]:
        while b"\r\n\r\n" not in self.data:
            self._more()
        head, _, self.data = self.data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        fields = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(fields["content-length"])
        while len(self.data) < length:
            self._more()
        body, self.data = self.data[:length], self.data[length:]
        return int(lines[0].split()[1]), int(fields["x-kvrouter-front"]), body

    def ended(self) -> bool:
        """Whether the server closed the connection (end of file) within the socket's timeout."""
        try:
            return self.sock.recv(1) == b""
        except TimeoutError:
            return False

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, "the server closed the connection"
        self.data += chunk


def connect(url: str) -> socket.socket:
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 80), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def copies_of(pids: list[int], peers: set[int]) -> int:
    """How many descriptors ``pids`` hold of server-side TCP sockets whose peer port is in ``peers``."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if int(fields[2].rsplit(":", 1)[1], 16) in peers:
                    inodes.add(f"socket:[{fields[9]}]")
    count = 0
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # closed since listed
                count += os.readlink(f"/proc/{pid}/fd/{fd}") in inodes
    return count


def twice_held(pid: int) -> list[str]:
    """The sockets ``pid`` holds more than one descriptor of (none: each shared socket's one lock is safe)."""
    seen: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed since listed
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:"):
                seen[target] = seen.get(target, 0) + 1
    return [target for target, count in seen.items() if count > 1]


def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_every_front_serves_every_connection(start_up, shm_entries):
    up = start_up("--fronts", "2", "--mock-workers", "2", "--shards", "1", "--client-rate", "0")
    url = up.expect(URL_LINE, START_TIMEOUT_S)[1]
    up.expect(re.compile(r"Ctrl-C stops everything"), START_TIMEOUT_S)
    fronts = [up.proc.pid, *other_fronts(up.proc.pid)]
    assert len(fronts) == 2

    # one kept-alive connection, either front stopped in turn: the other answers on it
    with connect(url) as sock:
        reader = Reader(sock)
        for stopped, serving in ((fronts[1], 0), (fronts[0], 1)):
            time.sleep(0.05)  # whichever front answered last has unlocked the connection by now
            os.kill(stopped, signal.SIGSTOP)
            try:
                for i in range(5):
                    sock.sendall(raw_request("POST", "/select", select_body(50 + i)))
                    assert reader.response()[:2] == (200, serving)
            finally:
                os.kill(stopped, signal.SIGCONT)

    # kept-alive connections from several threads at once: every request answered
    failures: list[str] = []

    def client(k: int) -> None:
        parsed = urlparse(url)
        conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=10)
        try:
            for i in range(REQUESTS):
                conn.request("POST", "/select", body=select_body(k * REQUESTS + i))
                response = conn.getresponse()
                answer = json.loads(response.read())
                if response.status != 200 or answer.get("worker_id") not in (1, 2):
                    failures.append(f"{response.status} {answer}")
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert all(twice_held(pid) == [] for pid in fronts)

    # pipelined: two requests in one write, answered in order (by whichever front reads them)
    with connect(url) as sock:
        reader = Reader(sock)
        sock.sendall(raw_request("POST", "/select", select_body(1)) + raw_request("DELETE", "/reservations/none"))
        assert reader.response()[0] == 200
        assert reader.response()[0] == 404

    # a request in two parts: answered, and the connection stays with the front that read its first part
    with connect(url) as sock:
        reader = Reader(sock)
        whole = raw_request("POST", "/select", select_body(2))
        sock.sendall(whole[:100])
        time.sleep(0.2)
        sock.sendall(whole[100:])
        status, owner, _ = reader.response()
        assert status == 200
        for i in range(20):
            sock.sendall(raw_request("POST", "/select", select_body(3 + i)))
            assert reader.response()[:2] == (200, owner)

    # handed to aiohttp: the connection stays with that front; its Connection: close reaches the client now
    with connect(url) as sock:
        reader = Reader(sock)
        sock.sendall(raw_request("GET", "/health"))
        status, owner, _ = reader.response()
        assert status == 200
        for i in range(10):
            sock.sendall(raw_request("POST", "/select", select_body(30 + i)))
            assert reader.response()[:2] == (200, owner)
        sock.sendall(raw_request("GET", "/health", headers="Connection: close\r\n"))
        assert reader.response()[:2] == (200, owner)
        sock.settimeout(2.0)
        assert reader.ended(), "the front closed its connection, but the client did not hear the end"

    # connections the clients close: no front keeps a copy open
    opened = [connect(url) for _ in range(16)]
    peers = {sock.getsockname()[1] for sock in opened}
    for i, sock in enumerate(opened):
        sock.sendall(raw_request("POST", "/select", select_body(100 + i)))
        assert Reader(sock).response()[0] == 200
    # each front holds a copy of each: the second copy reaches its front over the socketpair on its own time
    # (a request may be answered by front 0 first), so wait for it
    until(lambda: copies_of(fronts, peers) == 2 * len(opened), "both fronts to hold a copy of each connection")
    assert all(twice_held(pid) == [] for pid in fronts)
    for sock in opened:
        sock.close()
    until(lambda: copies_of(fronts, peers) == 0, "every front to close its copies")

    # front 1 killed: a connection both fronts shared is still answered, by front 0
    with connect(url) as sock:
        reader = Reader(sock)
        sock.sendall(raw_request("POST", "/select", select_body(200)))
        assert reader.response()[0] == 200
        segment = Serving.attach(serving_name(fronts[0]))
        try:  # front 1 killed between requests, not while answering one (front 0 would end that connection)
            until(lambda: int(segment.words[1]) == 0, "front 1 to finish answering")
            os.kill(fronts[1], signal.SIGKILL)
        finally:
            segment.close()
        until(lambda: not Path(f"/proc/{fronts[1]}").exists() or b"Z" in _state(fronts[1]), "front 1 to die")
        for i in range(10):
            sock.sendall(raw_request("POST", "/select", select_body(201 + i)))
            assert reader.response()[:2] == (200, 0)
    stop_and_check(up, signal.SIGTERM, shm_entries)


def _state(pid: int) -> bytes:
    try:
        text = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return b"X"
    return text[text.rindex(b")") + 2 :].split()[0]


def copies_by_front(pids: list[int], peers: set[int]) -> list[int]:
    return [copies_of([pid], peers) for pid in pids]


def test_with_three_fronts_each_connection_is_served_by_two_and_front_0_holds_the_rest(start_up, shm_entries):
    """More fronts than two: a connection is served by two of them, in turn, and front 0 holds a copy of the
    others only to end them or read them when a front dies; a front killed leaves its connections served."""
    up = start_up("--fronts", "3", "--mock-workers", "2", "--shards", "1", "--client-rate", "0")
    url = up.expect(URL_LINE, START_TIMEOUT_S)[1]
    up.expect(re.compile(r"Ctrl-C stops everything"), START_TIMEOUT_S)
    fronts = [up.proc.pid, *other_fronts(up.proc.pid)]
    assert len(fronts) == 3
    opened = [connect(url) for _ in range(12)]
    try:
        peers = {sock.getsockname()[1] for sock in opened}
        readers = [Reader(sock) for sock in opened]
        for i, (sock, reader) in enumerate(zip(opened, readers, strict=True)):
            sock.sendall(raw_request("POST", "/select", select_body(300 + i)))
            assert reader.response()[0] == 200
        held = copies_by_front(fronts, peers)
        assert held[0] == len(opened)  # front 0: every connection, served or only held
        assert all(0 < n < len(opened) for n in held[1:]), held  # the others: their share, not all
        assert sum(held[1:]) + held[0] >= 2 * len(opened)
        assert all(twice_held(pid) == [] for pid in fronts)
        os.kill(fronts[2], signal.SIGKILL)  # its connections: served on by their other front, or front 0
        until(lambda: not Path(f"/proc/{fronts[2]}").exists() or b"Z" in _state(fronts[2]), "front 2 to die")
        for round_ in range(3):
            for i, (sock, reader) in enumerate(zip(opened, readers, strict=True)):
                sock.sendall(raw_request("POST", "/select", select_body(400 + 20 * round_ + i)))
                assert reader.response()[0] == 200
    finally:
        for sock in opened:
            sock.close()
    until(lambda: copies_of(fronts[:2], peers) == 0, "the fronts to close their copies")
    stop_and_check(up, signal.SIGTERM, shm_entries)
