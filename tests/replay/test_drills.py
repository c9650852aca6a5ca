"""Every built drill in its short form, through the real command: ``python -m kvrouter replay`` starts
``kvrouter up`` (again for the router restart) and four ``kvrouter mock-worker`` processes (a fifth for
the churn), drives 30 requests of the packaged trace at x8 once without a fault and once per drill, and
writes ``--json``. Each drill must have been seen by the router, end with the index equal to every
engine's own cache, and account for every gap; the command must exit 0 and leave nothing of its
routers in ``/dev/shm``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.replay.conftest import drill_of, run_replay

BUILT = ["gap", "engine-restart", "applier-kill", "worker-churn", "router-restart", "slow-consumer"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_replay(tmp_path_factory.mktemp("replay") / "drills.json", BUILT, 30)


def test_the_command_exits_0_and_leaves_no_segment(report):
    assert report["exit_code"] == 0, report["output"]
    assert report["version"] == 1
    assert report["workload"]["requests"] == 30
    pid = report["workload"]["router_pid"]
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"kvrouter-{pid}-")]
    assert report["baseline"]["converged"]
    assert report["baseline"]["wrong_answers"] == 0


@pytest.mark.parametrize("name", BUILT)
def test_each_drill_is_seen_converges_and_accounts_for_every_gap(report, name):
    drill = drill_of(report, name)
    assert drill["status"] == "ok", drill
    assert drill["fault_seen"]
    assert drill["converged"], drill["mismatch"]
    gaps = drill["gaps"]
    assert gaps["detected"] == gaps["recovered"] + gaps["lost"]
    assert drill["converge_s"] is not None
    assert drill["probe_answers"] > 0
    assert drill["requests"] == 30
    assert set(drill["ttft_ms"]) == {"p50", "p90"}
    assert set(drill["baseline"]) == {"hit_rate", "ttft_ms"}


def test_the_gap_drill_recovers_its_gap_by_replay(report):
    gaps = drill_of(report, "gap")["gaps"]
    assert gaps["detected"] >= 1
    assert gaps["lost"] == 0


def test_the_engine_restart_drill_is_a_restart_not_a_gap(report):
    drill = drill_of(report, "engine-restart")
    assert drill["restarts"] >= 1


def test_the_applier_kill_drill_killed_the_victims_applier(report):
    drill = drill_of(report, "applier-kill")
    assert drill["fault"]["pid"] > 0
    assert drill["fault_seen"]  # the shard's applier pid changed: the supervisor started another


def test_the_worker_churn_drill_added_one_worker_and_removed_another(report):
    fault = drill_of(report, "worker-churn")["fault"]
    assert fault["added"] == 5  # after the four engines of the stack
    assert fault["removed"] in (1, 2, 3, 4)


def test_the_router_restart_drill_ran_another_router_and_both_left_no_segment(report):
    fault = drill_of(report, "router-restart")["fault"]
    assert fault["pid"] != fault["old_pid"]
    for pid in (fault["old_pid"], fault["pid"]):
        assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"kvrouter-{pid}-")]


def test_the_slow_consumer_drill_overflowed_the_victims_queue_and_replay_filled_the_hole(report):
    drill = drill_of(report, "slow-consumer")
    fault = drill["fault"]
    assert fault["pid"] > 0
    assert fault["published"] >= 32  # the burst, published while the applier was stopped
    gaps = drill["gaps"]
    assert gaps["detected"] >= 1  # the publisher dropped: the router saw it by sequence numbers
    assert gaps["detected"] == gaps["recovered"] + gaps["lost"]


def test_the_routers_log_is_kept_where_asked(report):
    """``--keep-logs``: the stack's routers wrote their stderr there (the router-restart drill ran two), and
    it stays after the run."""
    log = (report["logs"] / "up.log").read_text()
    assert log.count("SIGTERM, stopping") >= 1, log[-2000:]
    assert not (report["logs"] / "replicas").exists()  # no replica drill ran


def test_the_plot_is_a_png(report):
    assert report["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_names_every_drill_and_nothing_is_left_unbuilt(report):
    for name in BUILT:
        assert name in report["output"]
    assert "not built yet" not in report["output"]
    assert report["not_built"] == []
