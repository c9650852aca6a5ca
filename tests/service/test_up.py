"""``kvrouter up`` as a real process: the embedded demo routes, SIGTERM / SIGINT end it cleanly.

The command runs as ``python -m kvrouter up --port 0`` with its own mock engines (real subprocesses)
and engine (real applier processes in /dev/shm). The test reads the URL from the first stdout line,
sees the API answer and the built-in client's decisions in the status line and the registered mocks in
``GET /workers``, then signals the process and checks it exits 0 within the issue's 10 s, that every
process it started (mock engines, fork server, appliers) is gone, and that /dev/shm holds nothing under
its pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrouter.index.sweep import sweep_leftovers
from tests.conftest import ROOT, wait_for_stacks

START_TIMEOUT_S = 120.0
"""Cold numba caches on 2 shared cores: the engine and the mock engines compile before they answer."""
EXIT_BOUND_S = 10.0
"""Issue 11, item 9: SIGTERM → exit 0 within 10 s."""

URL_LINE = re.compile(r"kvrouter up: API at (http://\S+)")
STATUS_LINE = re.compile(r"decisions/s .* (\d+) decisions, (\d+) errors")


class Up:
    """A running ``kvrouter up`` with its stdout read line by line into a queue (stderr to a file)."""

    def __init__(
        self, *args: str, stderr: Path, env_extra: dict[str, str] | None = None, session: bool = False
    ) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")} | (env_extra or {})
        self.stderr_path = stderr
        self._stderr = stderr.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvrouter", "up", "--port", "0", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=session,  # a process group of its own, to be signalled whole
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(
        self, pattern: re.Pattern[str], timeout: float, accept: Callable[[re.Match[str]], bool] = bool
    ) -> re.Match[str]:
        """The first stdout line from now on matching ``pattern`` (and ``accept``); fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.proc.poll() is not None and self.lines.empty()):
                pytest.fail(
                    f"no line matching {pattern.pattern!r} (exit {self.proc.poll()}); stdout so far: {self.seen}"
                )
            try:
                line = self.lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            self.seen.append(line)
            match = pattern.search(line)
            if match and accept(match):
                return match

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


@pytest.fixture
def start_up(tmp_path: Path) -> Iterator[Callable[..., Up]]:
    started: list[Up] = []

    def start(*args: str, env: dict[str, str] | None = None, session: bool = False) -> Up:
        up = Up(*args, stderr=tmp_path / f"up-{len(started)}.err", env_extra=env, session=session)
        started.append(up)
        return up

    yield start
    for up in started:
        tree = descendants(up.proc.pid)
        up.close()
        kill_survivors(tree)  # a failed test still leaves nothing behind


def get(url: str) -> tuple[int, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, json.loads(response.read())


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a live process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[19]


def _comm(pid: int) -> str:
    """A process's name, as ``ps -o comm`` shows it ('' when it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _name(pid: int) -> str:
    """What ``ps`` shows for a process: its name and command line ('' when it is gone)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
    return f"{pid} {_comm(pid)}: {command[:200]}"


def descendants(root: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process below ``root`` now; the start time tells a reused pid apart."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(stat[0], []).append(int(entry))
    found: list[tuple[int, str]] = []
    stack = [root]
    while stack:
        for pid in children.get(stack.pop(), []):
            stat = _stat(pid)
            if stat is not None:
                found.append((pid, stat[1]))
                stack.append(pid)
    return found


def other_fronts(root: int) -> list[int]:
    """The pids of fronts 1..N-1 of the ``kvrouter up`` ``root``: forked, so named by their process name."""
    return [pid for pid, _ in descendants(root) if _comm(pid).startswith("kvrouter-front")]


def still_there(tree: list[tuple[int, str]]) -> list[int]:
    return [pid for pid, started in tree if (stat := _stat(pid)) is not None and stat[1] == started]


def kill_survivors(tree: list[tuple[int, str]]) -> None:
    """SIGKILL what is left of ``tree`` (a failed or killed ``kvrouter up``'s children) and wait for it to go."""
    for pid in still_there(tree):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + EXIT_BOUND_S
    while still_there(tree) and time.monotonic() < deadline:
        time.sleep(0.1)


def kill_and_sweep(tree: list[tuple[int, str]]) -> None:
    """What a SIGKILLed ``kvrouter up`` leaves: its children, then its segments (as the next engine's start
    sweeps them)."""
    kill_survivors(tree)
    sweep_leftovers()


def stop_and_check(up: Up, signum: int, shm_entries: Callable[[int], list[str]], *, group: bool = False) -> None:
    """Signal ``kvrouter up`` (``group``: its whole process group, as systemd's stop and ``kill -- -pgid``
    do); it must exit 0 within the bound and leave no process and no segment."""
    tree = descendants(up.proc.pid)
    if group:
        os.killpg(up.proc.pid, signum)
    else:
        up.proc.send_signal(signum)
    try:
        code = up.proc.wait(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvrouter up still running {EXIT_BOUND_S}s after {signal.Signals(signum).name}")
    assert code == 0
    left = still_there(tree)
    assert left == [], f"processes kvrouter up started outlived it: {[_name(pid) for pid in left]}"
    assert shm_entries(up.proc.pid) == []


def test_up_routes_the_demo_workload_and_stops_cleanly_on_sigterm(start_up, shm_entries):
    up = start_up("--mock-workers", "2", "--shards", "2", "--status-secs", "1", "--client-rate", "6")
    url = up.expect(URL_LINE, START_TIMEOUT_S)[1]
    assert get(url + "/health")[0] == 200
    up.expect(re.compile(r"Ctrl-C stops everything"), START_TIMEOUT_S)  # the banner: mocks up and registered
    assert any("curl -s " + url + "/select" in line and '"explain":true' in line for line in up.seen)
    status, workers = get(url + "/workers")
    assert status == 200
    rows = workers if isinstance(workers, list) else workers["workers"]
    assert sorted(row["instance_id"] for row in rows) == [1, 2]
    decided = up.expect(STATUS_LINE, START_TIMEOUT_S, accept=lambda m: int(m[1]) >= 5)
    assert int(decided[2]) == 0, up.seen  # no request of the client failed
    status, ring = get(url + "/decisions?since=0")
    assert status == 200
    assert {d["worker_id"] for d in ring["decisions"]} <= {1, 2}
    assert ring["last"] >= 5
    status, loads = get(url + "/loads")
    assert status == 200
    assert sorted(load["worker_id"] for group in loads for load in group["loads"]) == [1, 2]
    assert len(descendants(up.proc.pid)) >= 2 + 2  # two mock engines, fork server and appliers
    stop_and_check(up, signal.SIGTERM, shm_entries)


def test_a_disaggregated_demo_registers_its_roles_and_routes_to_the_decode_workers(start_up, shm_entries):
    """--mock-prefill-workers 1 --mock-decode-workers 2 replace the four role-both engines, registered with their
    roles; the client's requests go through the proxy, which splits them or not, and each decision's worker (the
    decode worker) is a decode engine."""
    up = start_up(
        "--mock-prefill-workers", "1", "--mock-decode-workers", "2", "--shards", "1", "--status-secs", "1",
        "--client-rate", "6",
    )  # fmt: skip
    url = up.expect(URL_LINE, START_TIMEOUT_S)[1]
    up.expect(re.compile(r"Ctrl-C stops everything"), START_TIMEOUT_S)
    assert any("1=http" in line and "(prefill)" in line for line in up.seen)
    status, workers = get(url + "/workers")
    assert status == 200
    assert {row["instance_id"]: row["role"] for row in workers} == {1: "prefill", 2: "decode", 3: "decode"}
    decided = up.expect(STATUS_LINE, START_TIMEOUT_S, accept=lambda m: int(m[1]) >= 5)
    assert int(decided[2]) == 0, up.seen  # no request of the client failed
    status, ring = get(url + "/decisions?since=0")
    assert {d["worker_id"] for d in ring["decisions"]} <= {2, 3}
    assert all("split" in d for d in ring["decisions"])  # a disaggregated partition's decisions, say split or not
    deadline = time.monotonic() + START_TIMEOUT_S  # a session that opens with a long document is split
    while not any(d.get("split") for d in get(url + "/decisions?since=0")[1]["decisions"]):
        assert time.monotonic() < deadline, "no request of the demo was split"
        time.sleep(0.2)
    assert int(up.expect(STATUS_LINE, START_TIMEOUT_S)[2]) == 0, up.seen  # the two hops failed none
    stop_and_check(up, signal.SIGTERM, shm_entries)


def test_a_sigterm_to_the_whole_process_group_is_one_clean_stop(start_up, shm_entries):
    """systemd's default stop (``KillMode=control-group``) and ``kill -TERM -- -<pgid>`` signal every process
    at once. The appliers and the fork server leave their stop to the supervisor, as they do Ctrl-C's
    SIGINT: the drain keeps its index, and nothing dies before it is asked to."""
    up = start_up("--mock-workers", "2", "--shards", "2", "--status-secs", "1", "--client-rate", "6", session=True)
    up.expect(STATUS_LINE, START_TIMEOUT_S, accept=lambda m: int(m[1]) >= 3)
    stop_and_check(up, signal.SIGTERM, shm_entries, group=True)
    log = up.stderr_path.read_text()
    assert "died" not in log, log[-2000:]
    assert "restart" not in log, log[-2000:]


def test_up_without_a_demo_serves_and_stops_on_sigint(start_up, shm_entries):
    up = start_up("--mock-workers", "0", "--shards", "1")
    url = up.expect(URL_LINE, START_TIMEOUT_S)[1]
    assert get(url + "/health")[0] == 200
    up.expect(re.compile(r"curl -s http://\S+/metrics"), START_TIMEOUT_S)  # the banner
    assert not any("mock engines" in line for line in up.seen)
    stop_and_check(up, signal.SIGINT, shm_entries)


def test_up_in_approximate_mode_starts_routes_and_stops(start_up, shm_entries):
    """``--no-router-kv-events`` (the reference's approximate mode): the start compiles the kernels with an
    exact router (approximate mode's are the same), and decisions are recorded in the approximate index."""
    up = start_up("--mock-workers", "0", "--shards", "1", "--no-router-kv-events")
    url = up.expect(URL_LINE, START_TIMEOUT_S)[1]
    up.expect(re.compile(r"curl -s http://\S+/metrics"), START_TIMEOUT_S)
    assert not any("did not start" in line for line in up.seen)
    registration = {"instance_id": 1, "model_name": "m", "block_size": 16}
    assert post(url + "/register", registration)[0] == 201
    tokens = list(range(64))
    first = post(url + "/select_and_reserve", {"model_name": "m", "token_ids": tokens})
    assert first[0] == 200, first
    again = post(url + "/select", {"model_name": "m", "token_ids": tokens})
    assert again[1]["overlap"]["gpu"] == 64  # the first decision, recorded as cached on its worker
    stop_and_check(up, signal.SIGINT, shm_entries)


def test_up_stops_cleanly_on_sighup_too(start_up, shm_entries):
    """Closing the terminal (or its tmux) sends SIGHUP: a clean stop, not a death with leftovers."""
    up = start_up("--mock-workers", "0", "--shards", "1")
    up.expect(URL_LINE, START_TIMEOUT_S)
    up.expect(re.compile(r"curl -s http://\S+/metrics"), START_TIMEOUT_S)
    stop_and_check(up, signal.SIGHUP, shm_entries)


def test_sigusr1_writes_every_threads_stack_and_up_keeps_serving(start_up, shm_entries):
    """What an operator (or a test about to kill it) asks a router that seems hung; a stop in time then
    writes no stacks of its own (it exits before ``cli/stacks.py``'s watchdog is due)."""
    up = start_up("--mock-workers", "0", "--shards", "1")
    url = up.expect(URL_LINE, START_TIMEOUT_S)[1]
    up.expect(re.compile(r"curl -s http://\S+/metrics"), START_TIMEOUT_S)
    up.proc.send_signal(signal.SIGUSR1)
    wait_for_stacks(up.stderr_path, ('cli/up.py", line', "in serve", "in run_forever"), 30)  # the main thread's
    assert get(url + "/health")[0] == 200
    stop_and_check(up, signal.SIGTERM, shm_entries)
    assert "Timeout (" not in up.stderr_path.read_text()


def test_the_demos_mock_engines_exit_when_kvrouter_up_is_killed(start_up, shm_entries):
    up = start_up("--mock-workers", "2", "--shards", "1", "--client-rate", "0")
    up.expect(URL_LINE, START_TIMEOUT_S)
    up.expect(re.compile(r"Ctrl-C stops everything"), START_TIMEOUT_S)
    tree = descendants(up.proc.pid)
    mocks = [pid for pid, _ in tree if b"mock-worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(mocks) >= 2  # the two engines (and whatever processes they run)
    up.proc.kill()  # no shutdown at all
    up.proc.wait()
    try:
        deadline = time.monotonic() + EXIT_BOUND_S
        while any(pid in still_there(tree) for pid in mocks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid in still_there(tree) for pid in mocks), "a demo engine outlived kvrouter up"
    finally:
        kill_and_sweep(tree)  # its appliers and fork server (and any engine left)
    assert shm_entries(up.proc.pid) == []


def test_health_answers_while_a_cold_cache_compiles_and_a_stop_then_ends_the_start(start_up, shm_entries, tmp_path):
    """Item 1: ``/health`` answers before the index is up. On an empty numba cache the appliers and the
    front compile their kernels for minutes on 2 cores; the API listens first, ``/ready`` says why it is
    not ready, and a SIGTERM in the middle of the start still exits 0 and leaves nothing behind."""
    up = start_up("--mock-workers", "0", "--shards", "1", env={"NUMBA_CACHE_DIR": str(tmp_path / "cold-cache")})
    url = up.expect(URL_LINE, START_TIMEOUT_S)[1]
    assert get(url + "/health")[0] == 200
    with pytest.raises(urllib.error.HTTPError) as refused:  # not ready: the index is not up yet
        get(url + "/ready")
    assert refused.value.code == 503
    assert "engine starting" in json.loads(refused.value.read())["reasons"]
    assert not any("the index is up" in line for line in up.seen)
    up.expect(re.compile(r"still starting: the first run compiles"), START_TIMEOUT_S)  # not a silent minute
    stop_and_check(up, signal.SIGTERM, shm_entries)


def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, json.loads(response.read())


def scrape(url: str) -> dict[str, float]:
    """``GET /metrics`` as ``{"name{labels}": value}`` (labels as written)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def follow(start_up: Callable[..., Up], pub: Any, cap: int, wait_until: Any, *more: str) -> tuple[Up, str]:
    """``kvrouter up`` with ``--max-index-blocks cap`` (and ``more`` arguments), following ``pub`` (kvrouter
    format, no query endpoint) once one of its batches landed (a PUB drops what it sends before the SUB
    joined)."""
    up = start_up("--mock-workers", "0", "--shards", "1", "--max-index-blocks", str(cap), *more)
    url = up.expect(URL_LINE, START_TIMEOUT_S)[1]
    up.expect(re.compile(r"curl -s http://\S+/metrics"), START_TIMEOUT_S)  # the banner: the engine is up
    registration = {"instance_id": pub.worker_id, "endpoint": pub.endpoint, "format": "kvrouter"}
    assert post(url + "/register", {**registration, "block_size": pub.block_size})[0] == 201

    def subscribed() -> bool:
        pub.store([10**6], [10**8 + t for t in range(pub.block_size)])
        pub.publish()
        return int(listener(url).get("cached_blocks", 0)) > 0

    wait_until(subscribed, timeout=60, what="the router follows the publisher")
    return up, url


def listener(url: str) -> dict[str, Any]:
    rows = get(url + "/workers")[1]
    return dict(rows[0]["listeners"]["0"]) if rows else {}


def test_the_index_cap_holds_under_a_flood_of_stores_whose_removals_are_lost(start_up, shm_entries, wait_until):
    """An engine (a ``KvPublisher`` in this process, no query endpoint) stores 30 chains of 40 blocks; after
    each chain it evicts its oldest one, and that Removed batch is lost on the wire (``send=False``), so the
    router sees a gap it cannot recover and 1,200 blocks that never leave. With ``--max-index-blocks 400``
    the index holds at most 400 entries; every entry beyond is evicted and counted (the worker is not
    ``exact`` once its gap is lost, hence ``untrusted``) in ``/metrics``, ``/workers`` and ``/ready``, and no
    event is counted as an error."""
    from kvrouter import KvPublisher

    block, chains, length, cap = 4, 30, 40, 400
    with KvPublisher(7, block_size=block, endpoint="tcp://127.0.0.1:*") as pub:
        up, url = follow(start_up, pub, cap, wait_until)
        for chain in range(chains):
            hashes = [chain * 1000 + i for i in range(length)]
            pub.store(hashes, [chain * 100_000 + t for t in range(length * block)])
            pub.publish()
            if chain >= 2:
                pub.remove([(chain - 2) * 1000 + i for i in range(length)])
                pub.publish(send=False)  # the engine evicted; the router never hears of it
        pub.store([10**6 + 1], [10**9 + t for t in range(block)])
        pub.publish()  # a last batch after the lost one: the router sees the gap
        wait_until(lambda: listener(url).get("last_id") == pub.last_event_id, timeout=60, what="the last batch")

        metrics = scrape(url)
        held = metrics["kvrouter_index_blocks"]
        evicted = metrics['kvrouter_index_evictions_total{reason="untrusted"}']
        assert held <= cap
        assert metrics["kvrouter_index_blocks_cap"] == cap
        assert evicted + metrics['kvrouter_index_evictions_total{reason="lru"}'] == 2 + chains * length - held
        assert evicted > 0
        assert metrics['kvrouter_kv_events_rejected_total{kind="block_not_found"}'] == 0
        assert metrics['kvrouter_kv_events_rejected_total{kind="parent_not_found"}'] == 0
        row = listener(url)
        assert row["state"] == "partial"
        assert row["cached_blocks"] == held
        assert row["evicted"]["untrusted"] == evicted
        assert "--max-index-blocks" in row["note"]
        ready = get(url + "/ready")[1]["index"]
        assert ready["blocks_cap"] == cap
        assert ready["blocks"] == held
        stop_and_check(up, signal.SIGTERM, shm_entries)


def test_the_index_cap_keeps_what_decisions_matched(start_up, shm_entries, wait_until):
    """Chains A and B of 40 blocks, A stored first; a ``/select`` whose prompt is A matches all of it on the
    one worker, and the front feeds that match to the applier (``kvrouter_index_matched_blocks_total``).
    A third chain then takes the index past its cap of 100 (121 entries, brought down to 99): the oldest
    leaves go, the first block and 21 of B's, while A, stored before B but matched after it, stays whole."""
    a_matched_chain_outlives_a_newer_one(
        start_up, shm_entries, wait_until, lambda url, body: post(f"{url}/select", body)
    )


def a_matched_chain_outlives_a_newer_one(
    start_up: Callable[..., Up],
    shm_entries: Callable[[int], list[str]],
    wait_until: Any,
    select: Callable[[str, dict[str, Any]], tuple[int, Any]],
    *more: str,
) -> None:
    """The cap test above, with ``select(url, body)`` making the ``/select`` and ``more`` arguments for
    ``kvrouter up`` (``test_fronts``: through front 1)."""
    from kvrouter import KvPublisher

    block, length, cap = 4, 40, 100
    tokens = {
        name: [base + t for t in range(length * block)] for name, base in (("a", 0), ("b", 10**5), ("c", 2 * 10**5))
    }
    with KvPublisher(7, block_size=block, endpoint="tcp://127.0.0.1:*") as pub:
        up, url = follow(start_up, pub, cap, wait_until, *more)
        for chain, name in enumerate("ab"):
            pub.store([chain * 1000 + i for i in range(length)], tokens[name])
            pub.publish()
        wait_until(lambda: listener(url).get("last_id") == pub.last_event_id, timeout=60, what="A and B applied")
        status, answer = select(url, {"token_ids": tokens["a"]})
        assert status == 200
        assert answer["worker_id"] == 7
        wait_until(lambda: scrape(url)["kvrouter_index_matched_blocks_total"] >= length, what="the match fed back")
        pub.store([2000 + i for i in range(length)], tokens["c"])
        pub.publish()
        wait_until(lambda: listener(url).get("last_id") == pub.last_event_id, timeout=60, what="C applied")

        def matched(name: str) -> int:
            scores = post(url + "/query", {"token_ids": tokens[name]})[1]["scores"]
            return int(scores.get("7", {}).get("0", 0)) // block

        assert scrape(url)["kvrouter_index_blocks"] == cap - cap // 64
        assert (matched("a"), matched("b"), matched("c")) == (length, length - 21, length)
        stop_and_check(up, signal.SIGTERM, shm_entries)
