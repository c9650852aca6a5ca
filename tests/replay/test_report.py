"""The exit status and the JSON from run results: 1 when any drill that ran was not seen, did not converge
or left a gap unaccounted; skipped drills do not count; each drill object has the issue's fields."""

from __future__ import annotations

import pytest

from kvrouter.replay import exit_status, report_json
from kvrouter.replay.report import Skipped
from kvrouter.replay.run import RunResult
from kvrouter.replay.truth import ProbeLog
from kvrouter.replay.workload import Outcome


def _result(
    name: str = "gap", *, converged: bool = True, seen: bool = True, lost: int = 0, recovered: int | None = None
) -> RunResult:
    outcomes = [Outcome(1.0, 100, "1:0", 40, 30.0), Outcome(1.1, 100, "2:0", 0, 50.0), Outcome(1.2, 100, error="x")]
    result = RunResult(name, outcomes, ProbeLog(), converged=converged, fault_seen=seen, converge_s=0.5)
    result.gaps = {"detected": 2, "recovered": 2 - lost if recovered is None else recovered, "lost": lost}
    return result


def test_every_drill_seen_converged_and_accounted_exits_0_skipped_ones_do_not_count():
    assert exit_status([_result(), Skipped("applier-kill", "needs local processes")]) == 0


@pytest.mark.parametrize(
    "bad",
    [_result(converged=False), _result(seen=False), _result(recovered=1)],
    ids=["not-converged", "fault-not-seen", "gap-unaccounted"],
)
def test_one_failed_drill_exits_1(bad):
    assert exit_status([_result(), bad]) == 1


def test_a_lost_gap_is_accounted_and_passes():
    assert exit_status([_result(lost=1)]) == 0


def test_the_json_has_the_issues_fields_per_drill():
    baseline = _result("baseline")
    document = report_json([_result(), Skipped("applier-kill", "why")], baseline, {"requests": 3}, ["slow-consumer"])
    gap, skipped = document["drills"]
    assert {"drill", "gaps", "converged", "converge_s", "wrong_answers", "hit_rate", "ttft_ms", "baseline"} <= set(gap)
    assert gap["hit_rate"] == 0.2  # 40 cached of the 200 prompt tokens that completed
    assert gap["errors"] == 1
    assert gap["ttft_ms"] == {"p50": 40.0, "p90": 48.0}
    assert gap["baseline"] == {"hit_rate": 0.2, "ttft_ms": {"p50": 40.0, "p90": 48.0}}
    assert skipped == {"drill": "applier-kill", "status": "skipped", "reason": "why"}
    assert document["not_built"] == ["slow-consumer"]
