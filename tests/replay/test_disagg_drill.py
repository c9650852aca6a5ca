"""The disaggregated drill in its short form, through the real command: ``python -m kvrouter replay --drill
prefill-kill`` starts ``kvrouter up`` and two prefill and two decode ``kvrouter mock-worker`` processes,
drives 30 requests of the packaged trace at x8 through the router's proxy (both hops of every split
request), once without a fault and once with a prefill engine SIGKILLed while a decode engine pulls KV
from it. The issue's bar: every client answered or refused, nothing left booked, the index equal to every
engine's cache; and the command exits 0 and leaves nothing in ``/dev/shm``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.replay.conftest import drill_of, run_replay


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_replay(tmp_path_factory.mktemp("replay") / "disagg.json", ["prefill-kill"], 30)


def test_the_command_exits_0_on_its_own_disaggregated_stack(report):
    assert report["exit_code"] == 0, report["output"]
    stack = report["workload"]["disaggregated"]
    assert stack["prefill_workers"] == [1, 2]
    assert stack["decode_workers"] == [3, 4]
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"kvrouter-{stack['router_pid']}-")]
    baseline = report["workload"]["disagg_baseline"]
    assert baseline["booked"] == {}
    assert baseline["unanswered"] == 0
    assert (report["logs"] / "disagg" / "up.log").exists()


def test_a_prefill_engine_is_killed_mid_transfer_and_the_router_notices(report):
    drill = drill_of(report, "prefill-kill")
    fault = drill["fault"]
    assert fault["worker"] in report["workload"]["disaggregated"]["prefill_workers"]
    assert fault["mid_transfer"]
    assert fault["pulls_in_progress"] >= 1
    assert fault["noticed_s"] is not None  # listed unhealthy: a refused prefill hop or the health probe
    assert drill["fault_seen"]


def test_every_client_is_answered_or_refused_and_nothing_stays_booked(report):
    drill = drill_of(report, "prefill-kill")
    assert drill["status"] == "ok", drill
    assert drill["unanswered"] == 0
    assert drill["booked"] == {}
    assert drill["errors"] >= 1  # the pull the kill cut reached its client as an error
    assert set(drill["error_kinds"]) <= {"status 502", "engine error"}, drill["error_kinds"]
    assert drill["requests"] == 30


def test_the_index_equals_every_engines_cache_after_the_kill(report):
    drill = drill_of(report, "prefill-kill")
    assert drill["converged"], drill["mismatch"]
    assert drill["gaps"] == {"detected": 0, "recovered": 0, "lost": 0}
