"""``tools/bench_service.py --quick`` runs end to end: both servers route on the same events (the tool
checks it before any clock runs), every point answers without an error, the ratios' points (concurrency 1
and 8) are measured in the rounds asked for, the JSON carries every ratio, the machine's floor and the
comparison with a second kvrouter of four fronts.
Speed is not asserted (speed claims are the tool's ratios from one run, not test conditions)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.service.test_up import descendants, kill_survivors, still_there
from tests.tools.runner import ROOT, TOOLS, run_tool

pytest.importorskip("dynamo._core", reason="the reference runtime comes with the anchors extra")
if shutil.which("wrk") is None:
    pytest.skip("wrk is not installed (tools/install_wrk.sh)", allow_module_level=True)


def test_quick_run_measures_both_servers_and_reports_both_ratios(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    run_tool("bench_service.py", "--quick", "--rounds", "2", "--json", str(out), timeout=400)
    figures: dict[str, Any] = json.loads(out.read_text())
    assert set(figures["ratios"]) == {"select_throughput", "select_p99", "select_p99_c1"}
    assert all(value > 0 for value in figures["ratios"].values())
    for side in ("reference", "kvrouter"):
        points = figures["points"][side]
        assert set(points) == {"1", "8", "64"}
        assert all(p["requests"] > 0 and p["errors"] == 0 for p in points.values())
        for c in ("1", "8"):  # the ratios' points, measured twice each; the row is their median
            rounds = figures["rounds"][side][c]
            assert len(rounds) == 2
            assert points[c]["rounds"] == 2
            assert points[c]["requests"] == sum(p["requests"] for p in rounds)
    compared = figures["points"]["kvrouter-4fronts"]  # the 4-front kvrouter: its concurrency-8 rounds only
    assert set(compared) == {"8"}
    assert compared["8"]["rounds"] == 2
    assert compared["8"]["errors"] == 0
    assert figures["fronts_cpu"]["compare"] == 4
    assert figures["fronts_cpu"]["cpu_ratio"] > 0
    for name in ("floor-2spawned", "floor-4spawned", "floor-2forked", "floor-4forked"):  # the fronts' floors:
        floor = figures["points"][name]  # plain processes on one port, measured in the same rounds
        assert set(floor) == {"8"}
        assert floor["8"]["rounds"] == 2
        assert floor["8"]["requests"] > 0
        assert floor["8"]["errors"] == 0
    assert set(figures["fronts_cpu"]["floor_cpu_ratios"]) == {"spawned", "forked"}
    assert all(ratio > 0 for ratio in figures["fronts_cpu"]["floor_cpu_ratios"].values())
    assert figures["floor"]["requests"] > 0
    fast = figures["fastpath"]["points"]  # the ZMQ fast path, kvrouter only
    assert set(fast) == {"1", "8"}
    assert all(p["requests"] > 0 and p["errors"] == 0 for p in fast.values())
    assert figures["fastpath"]["generator_ceiling"]["requests"] > 0
    assert figures["shm_left"] == []


@pytest.mark.parametrize("how", [[], ["--fork"]], ids=["spawned", "forked"])
def test_a_floor_of_several_processes_answers_and_stops_with_its_children(how: list[str]) -> None:
    """``_floor --processes 3 --work``: the three share one port and answer a ``/select`` body with its
    blocks; SIGTERM to the first stops the other two as well."""
    floor = subprocess.Popen(
        [sys.executable, str(TOOLS / "bench_service.py"), "_floor", "--port", "0", "--processes", "3", "--work", *how],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert floor.stdout is not None
    tree: list[tuple[int, str]] = []
    try:
        port = int(floor.stdout.readline())  # printed once the other two listen
        tree = descendants(floor.pid)
        assert len(tree) == 2
        body = json.dumps({"model_name": "m", "token_ids": list(range(40))})
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /select HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
            head, _, answer = sock.recv(4096).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert json.loads(answer)["blocks"] == 2  # 40 tokens: 2 whole blocks
        floor.send_signal(signal.SIGTERM)
        assert floor.wait(20) == 0
        assert still_there(tree) == []
    finally:
        if floor.poll() is None:
            floor.kill()
            floor.wait()
        floor.stdout.close()
        kill_survivors(tree)


def test_sigterm_stops_the_servers_it_started() -> None:
    """SIGTERM in the middle of a run, while the fast path's generator runs: the kvrouter server it started
    exits too and leaves no segment, and no process it started (the generator and the echo server
    included) outlives it."""
    bench = subprocess.Popen(
        [sys.executable, str(TOOLS / "bench_service.py"), "--quick", "--sides", "kvrouter", "--compare-fronts", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    tree: set[tuple[int, str]] = set()
    commands: dict[int, bytes] = {}
    try:
        deadline = time.monotonic() + 120
        while not any(b"_zmq_load" in command for command in commands.values()):
            assert time.monotonic() < deadline, f"no fast-path generator started: {commands}"
            assert bench.poll() is None
            for pid, started in descendants(bench.pid):
                tree.add((pid, started))
                with contextlib.suppress(OSError):
                    commands.setdefault(pid, Path(f"/proc/{pid}/cmdline").read_bytes())
            time.sleep(0.02)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        servers = [pid for pid, command in commands.items() if b"_serve" in command]
        assert servers
        for server in servers:
            assert [n for n in os.listdir("/dev/shm") if n.startswith(f"kvrouter-{server}-")] == []
        left = {pid: commands.get(pid) for pid in still_there(list(tree))}
        assert left == {}
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        kill_survivors(list(tree))  # a failed test still leaves nothing behind
