"""``kvrouter up --fronts 2`` as real processes: two fronts on one port agree on loads and on the registry.

Every front serves every connection (``service/process/sharing.py``, tested in ``test_sharing.py``); a connection
whose first request is aiohttp's stays with the front that read it, and every answer names its front
(``X-Kvrouter-Front``). What they check: both fronts answer; reservations booked through either
show in both fronts' ``/loads`` and can be freed through either; a registration through one front is seen
on that same connection at once, refused as a duplicate through the other; a front killed with SIGKILL is
started again with the registry; SIGTERM stops every process and leaves nothing behind.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from kvrouter.routing import RouterConfig
from kvrouter.service.core.config import ServiceConfig
from kvrouter.service.core.decisions import summarise
from kvrouter.service.process.app import Service
from kvrouter.service.process.fronts import RESTART_DELAY_S
from kvrouter.stats import discovery
from tests.service.test_up import (
    START_TIMEOUT_S,
    URL_LINE,
    a_matched_chain_outlives_a_newer_one,
    other_fronts,
    start_up,
    stop_and_check,
)

__all__ = ["start_up"]  # the fixture, shared with test_up

BOUND_S = 30.0
TRIES = 400
"""New connections to make before giving up on reaching a front (whichever front reads a first request)."""


class Client:
    """One kept-alive connection: once its first request went to aiohttp (``/health``), every request on it
    reaches the same front."""

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=10)
        self.front: int | None = None

    def call(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        self.conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = self.conn.getresponse()
        self.front = int(response.headers["X-Kvrouter-Front"])
        return response.status, json.loads(response.read())

    def close(self) -> None:
        self.conn.close()


def on_front(url: str, front: int) -> Client:
    """A connection that landed on ``front``: ``TRIES`` connections at least, and on until ``BOUND_S`` (a front
    just started again on a loaded machine may lose every race for a while; a full CI run caught 400 lost)."""
    deadline, tries = time.monotonic() + BOUND_S, 0
    while tries < TRIES or time.monotonic() < deadline:
        tries += 1
        client = Client(url)
        try:
            client.call("GET", "/health")
        except ConnectionError:  # a front killed with connections in its backlog resets them
            client.close()
            continue
        if client.front == front:
            return client
        client.close()
    pytest.fail(f"no connection reached front {front} in {tries} tries and {BOUND_S:.0f} s")


def until(check: Any, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def decisions(client: Client) -> float:
    client.conn.request("GET", "/metrics")
    response = client.conn.getresponse()
    text = response.read().decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("kvrouter_decisions_total ")))


def loads(client: Client) -> dict[int, tuple[int, int, int]]:
    status, body = client.call("GET", "/loads")
    assert status == 200
    return {
        row["worker_id"]: (row["potential_prefill_tokens"], row["potential_decode_blocks"], row["active_requests"])
        for group in body
        for row in group["loads"]
    }


def test_two_fronts_share_a_port_the_loads_and_the_registry(start_up, shm_entries, tmp_path):
    decisions_log = tmp_path / "decisions.jsonl"
    up = start_up(
        *("--fronts", "2", "--mock-workers", "2", "--shards", "1", "--client-rate", "0"),
        *("--decision-log", str(decisions_log)),
    )
    url = up.expect(URL_LINE, START_TIMEOUT_S)[1]
    up.expect(re.compile(r"Ctrl-C stops everything"), START_TIMEOUT_S)  # mocks registered (through either front)
    # every front gets a copy of every connection (front 0 accepts, SCM_RIGHTS; test_sharing.py): a
    # connection whose first request goes to aiohttp stays with the front that read it
    fronts = [on_front(url, 0), on_front(url, 1)]
    try:
        for client in fronts:
            status, ready = client.call("GET", "/ready")
            assert status == 200, ready
            assert ready["fronts"]["fronts"] == 2
            assert ready["fronts"]["front"] == client.front
            assert ready["replica_sync"]["peers"] in (0, 1)  # presence comes every 2 s
            status, workers = client.call("GET", "/workers")
            assert sorted(row["instance_id"] for row in workers) == [1, 2]
        # reservations booked through both fronts: both views agree; each freed through the other front
        booked: list[tuple[int, str]] = []
        first_booking: dict[str, Any] = {}
        for i in range(8):
            client = fronts[i % 2]
            tokens = [(i * 7919 + j) % 30000 for j in range(64 + 16 * i)]
            status, answer = client.call("POST", "/select_and_reserve", {"model_name": "default", "token_ids": tokens})
            assert status == 200, answer
            booked.append((i % 2, answer["selection_id"]))
            first_booking = first_booking or {"tokens": tokens, "worker_id": answer["worker_id"]}
        until(lambda: loads(fronts[0]) == loads(fronts[1]), "both fronts' loads to agree")
        # what front 0 booked counts as predicted on front 1 (the AddRequest carried its blocks): no engine was
        # asked, so no event confirms them (a probe: explained, nothing booked or counted)
        follower = {"model_name": "default", "token_ids": first_booking["tokens"] + [7] * 16, "probe": True}
        status, answer = fronts[1].call("POST", "/select", follower)
        assert status == 200, answer
        row = next(w for w in answer["explain"]["workers"] if w["worker_id"] == first_booking["worker_id"])
        assert (row["overlap"]["device"], row["overlap"]["predicted"]) == (0, 64 // 16)
        # /metrics on either front counts every front's decisions (the others' as published each second)
        until(lambda: [decisions(c) for c in fronts] == [8.0, 8.0], "both fronts' /metrics to count 8 decisions")
        assert sum(active for _, _, active in loads(fronts[1]).values()) == 8
        for front, selection_id in booked:
            other = fronts[1 - front]
            status, kept = other.call("GET", f"/decisions/{selection_id}")  # kept by the front that decided
            assert status == 200, kept
            assert kept["selection_id"] == selection_id
            status, answer = other.call("POST", f"/reservations/{selection_id}/prefill_complete")
            assert status == 200, answer
            status, answer = other.call("DELETE", f"/reservations/{selection_id}")
            assert status == 200, answer
        until(lambda: loads(fronts[0]) == loads(fronts[1]) == {1: (0, 0, 0), 2: (0, 0, 0)}, "every reservation freed")
        # a registration through front 1: done by front 0, seen at once on the same connection, a duplicate
        # through front 0 is refused as on one front
        worker = {
            "instance_id": 9,
            "endpoint": "tcp://127.0.0.1:9",
            "model_name": "default",
            "block_size": 16,
            "role": "prefill",  # the role, domain and adapters travel with the registry to every front
            "topology_domain": "rack-9",
            "lora_adapters": ["sql"],
        }
        status, answer = fronts[1].call("POST", "/register", worker)
        assert status == 201, answer
        assert fronts[1].front == 1
        for either in fronts:
            status, workers = either.call("GET", "/workers")
            assert {row["instance_id"]: (row["role"], row["topology_domain"]) for row in workers}[9] == (
                "prefill",
                "rack-9",
            )
            assert {row["instance_id"]: row["lora_adapters"] for row in workers}[9] == ["sql"]
            status, models = either.call("GET", "/v1/models")
            assert {"id": "sql", "object": "model", "owned_by": "kvrouter", "parent": "default"} in models["data"]
        # a split reservation on front 0: both bookings reach front 1 over the local bus, and any front ends them
        for wid, role in ((11, "prefill"), (12, "decode")):
            body = {"instance_id": wid, "endpoint": f"tcp://127.0.0.1:{20000 + wid}", "model_name": "pd"}
            assert fronts[1].call("POST", "/register", {**body, "block_size": 16, "role": role})[0] == 201
        long_prompt = {"model_name": "pd", "token_ids": list(range(1, 4097)), "selection_id": "pd-split"}
        status, answer = fronts[0].call("POST", "/select_and_reserve", long_prompt)
        assert status == 200, answer
        assert (answer["split"], answer["prefill"]["worker_id"], answer["decode"]["worker_id"]) == (True, 11, 12)

        def pd_loads(client: Client) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
            every = loads(client)
            return every.get(11, (0, 0, 0)), every.get(12, (0, 0, 0))

        until(lambda: pd_loads(fronts[1]) == ((4096, 256, 1), (4096, 256, 1)), "both bookings on front 1")
        status, answer = fronts[1].call("POST", "/reservations/pd-split/prefill_complete")
        assert status == 200, answer
        until(lambda: pd_loads(fronts[0]) == ((0, 0, 0), (0, 256, 1)), "the prefill hop ended on front 0")
        assert fronts[0].call("DELETE", "/reservations/pd-split")[0] == 200
        until(lambda: pd_loads(fronts[0]) == pd_loads(fronts[1]) == ((0, 0, 0), (0, 0, 0)), "both freed")
        status, answer = fronts[0].call("POST", "/register", worker)
        assert status == 409, answer
        status, answer = fronts[1].call("POST", "/register", {**worker, "block_size": 32, "instance_id": 10})
        assert status == 409
        assert "block_size" in answer["error"]
        status, answer = fronts[1].call("POST", "/busy_threshold", {"active_decode_blocks_threshold": 4096})
        assert status == 200, answer
        status, answer = fronts[0].call("GET", "/busy_threshold")
        assert answer["thresholds"][0]["active_decode_blocks_threshold"] == 4096
        # front 1 killed: started again, with the registry
        for client in fronts:
            client.close()
        front_pids = other_fronts(up.proc.pid)
        assert len(front_pids) == 1
        # the log is written once a second: a front killed sooner loses its last second, so wait for it
        # (8 reservations, then the split one)
        until(lambda: decisions_log.read_bytes().count(b"\n") == 9, "both fronts to write their decisions")
        os.kill(front_pids[0], signal.SIGKILL)

        def restarted() -> bool:
            client = on_front(url, 0)
            try:
                status = client.call("GET", "/ready")[1]["fronts"]
                return bool(status["restarts"] == 1 and status["ready"] == 2)
            finally:
                client.close()

        until(restarted, "front 0 to start front 1 again")
        again = on_front(url, 1)
        try:
            status, workers = again.call("GET", "/workers")
            assert sorted(row["instance_id"] for row in workers) == [1, 2, 9, 11, 12]
            until(lambda: again.call("GET", "/ready")[0] == 200, "the new front 1 ready")
            # the killed front's decisions stay counted: front 0 keeps its last publication
            first = on_front(url, 0)
            try:
                assert decisions(first) == 9.0
            finally:
                first.close()
        finally:
            again.close()
    finally:
        for client in fronts:
            client.close()
    folder = discovery.runtime_dir() / f"fronts-{up.proc.pid}"
    assert folder.is_dir()
    stop_and_check(up, signal.SIGTERM, shm_entries)
    assert not folder.exists()
    with decisions_log.open("rb") as lines:  # both fronts appended theirs, none twice
        assert summarise(lines)["decisions"] == 9


def test_a_match_on_another_front_feeds_the_index_cap(start_up, shm_entries, wait_until):
    """``test_up``'s cap test with the ``/select`` answered by front 1, which maps the engine read-only: its
    match reaches the applier (``EngineView.touch``), so chain A, stored before B but matched after it,
    outlives B when a third chain takes the index past its cap."""

    def through_front_1(url: str, body: dict[str, Any]) -> tuple[int, Any]:
        front = on_front(url, 1)
        try:
            answer = front.call("POST", "/select", body)
        finally:
            front.close()
        assert front.front == 1
        return answer

    a_matched_chain_outlives_a_newer_one(start_up, shm_entries, wait_until, through_front_1, "--fronts", "2")


def test_a_registration_taken_before_front_0s_bus_opens_reaches_the_fronts_that_join_later():
    """Front 0 listens before its local bus is open (a client registers as soon as ``/health`` answers):
    that change still counts in the registry's version, so a front that joins later and takes the registry
    whole does not mistake it for the empty one it starts with."""
    config = ServiceConfig(port=0, shards=1, fronts=2, router=RouterConfig(use_kv_events=False))
    first, joining = Service(config), Service(config)
    assert first.fronts is not None
    assert joining.fronts is not None
    first.apply_control("register", {"instance_id": 7, "model_name": "m", "block_size": 16})
    joining.fronts.apply(first.fronts.registry())
    assert set(joining.core.registry.registrations) == {(7, 0)}
    assert joining.fronts.version == first.fronts.version == 1


def test_fronts_are_forked_by_a_single_threaded_server_and_a_stop_sees_a_restart_through(start_up, shm_entries):
    """Fronts 1..N-1 are children of one fork server, itself front 0's child with a single thread, and are
    named for ``ps``. A SIGTERM about when front 0 forks a killed front again stops that front too (the
    fork in flight is seen through) and leaves no process and no segment; the other fronts are still
    watched and stopped, not forgotten."""
    up = start_up("--fronts", "3", "--mock-workers", "2", "--shards", "1", "--client-rate", "0")
    up.expect(URL_LINE, START_TIMEOUT_S)
    up.expect(re.compile(r"Ctrl-C stops everything"), START_TIMEOUT_S)
    fronts = other_fronts(up.proc.pid)
    assert len(fronts) == 2
    names = sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in fronts)
    assert names == ["kvrouter-front1", "kvrouter-front2"]
    server = {_status(pid)["PPid"] for pid in fronts}
    assert len(server) == 1
    (server_pid,) = server
    assert _status(int(server_pid))["PPid"] == str(up.proc.pid)
    assert _status(int(server_pid))["Threads"] == "1"
    os.kill(fronts[0], signal.SIGKILL)
    time.sleep(RESTART_DELAY_S)  # front 0 forks it again about now
    stop_and_check(up, signal.SIGTERM, shm_entries)


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as fh:
        return dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)


def test_a_killed_fork_server_stops_its_fronts_and_front_0_serves_on_and_stops_cleanly(start_up, shm_entries):
    """The fronts' fork server SIGKILLed: its fronts see their parent go and stop, front 0 logs that no front
    can be forked again, answers on its own, and still stops with no process and no segment left."""
    up = start_up("--fronts", "2", "--mock-workers", "2", "--shards", "1", "--client-rate", "0")
    url = up.expect(URL_LINE, START_TIMEOUT_S)[1]
    up.expect(re.compile(r"Ctrl-C stops everything"), START_TIMEOUT_S)
    (front,) = other_fronts(up.proc.pid)
    os.kill(int(_status(front)["PPid"]), signal.SIGKILL)
    until(lambda: not Path(f"/proc/{front}").exists(), "front 1 to stop once its parent is gone")
    until(lambda: "front not started again front=1" in up.stderr_path.read_text(), "front 0 to give up on it")
    assert up.stderr_path.read_text().count("fronts' fork server exited") == 1
    client = on_front(url, 0)
    try:
        status, ready = client.call("GET", "/ready")
        assert status == 200, ready
        status, _ = client.call("POST", "/select", {"model_name": "default", "token_ids": list(range(64))})
        assert status == 200
    finally:
        client.close()
    stop_and_check(up, signal.SIGTERM, shm_entries)
