"""Explain by id and the decision log (``service/decisions.py``).

Through a real service with two real mock engines: a reservation fetched by id later says what its
``explain`` said when it was made, with the runner-up and the prefill spent on balance; unknown ids are a
404. The decision log and its summary, from decisions a real router made over a real index.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvrouter.cli import app
from kvrouter.events.model import EngineHash, LocalHash, Stored, StoredBlock
from kvrouter.hashing import block_hashes
from kvrouter.index import RadixIndex
from kvrouter.routing import Router
from kvrouter.service.core.decisions import (
    DecisionLog,
    DecisionRecords,
    Recorded,
    decision_json,
    summarise,
)
from tests.service.conftest import BLOCK, MODEL, Running, running

__all__ = ["running"]  # the module's service, from conftest

pytestmark = pytest.mark.timeout(120)


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(blocks * BLOCK)]


def test_a_decision_fetched_by_id_is_the_one_explained_at_the_time(running: Running, wait_until) -> None:
    tokens = prompt(1, 6)
    first = running.ok("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": tokens})
    running.ok("POST", f"/reservations/{first['selection_id']}/prefill_complete")
    # the same prompt again, explained: the first reservation's load is on its worker now
    answer = running.ok("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": tokens, "explain": True})
    selection_id = answer["selection_id"]
    # load moves on after the decision: the record must not
    running.ok("DELETE", f"/reservations/{first['selection_id']}")
    kept = running.ok("GET", f"/decisions/{selection_id}")
    assert kept["workers"] == answer["explain"]["workers"]
    assert (kept["worker_id"], kept["dp_rank"]) == (answer["worker_id"], answer["dp_rank"])
    assert kept["cost"] == answer["cost"]
    assert kept["reserved"] is True
    assert kept["prompt_blocks"] == 6
    chosen = next(w for w in kept["workers"] if w["selected"])
    runner = kept["runner_up"]
    other = next(w for w in kept["workers"] if not w["selected"])
    assert (runner["worker_id"], runner["cost"]) == (other["worker_id"], other["cost"])
    assert runner["lost_by"] == pytest.approx(other["cost"] - chosen["cost"])
    best = max(w["overlap_blocks"] for w in kept["workers"] if not w["busy"])
    assert kept["avoidable_prefill_tokens"] == (best - chosen["overlap_blocks"]) * BLOCK
    running.ok("DELETE", f"/reservations/{selection_id}")
    # a /select that names its id is kept too; an unknown id is a 404
    running.ok("POST", "/select", {"model_name": MODEL, "token_ids": prompt(2, 2), "selection_id": "mine-1"})
    assert running.ok("GET", "/decisions/mine-1")["reserved"] is False
    status, error, _ = running.call("GET", "/decisions/never-made")
    assert status == 404
    assert "no decision" in error["error"]


def recorded_decisions(count: int) -> list[Recorded]:
    """Decisions of a real router over a real index: worker 2 holds the shared prefix."""
    index = RadixIndex()
    shared = prompt(9, 4)
    local = block_hashes(shared, BLOCK)
    index.apply_event(
        2, Stored(2, None, tuple(StoredBlock(EngineHash(i + 1), LocalHash(h)) for i, h in enumerate(local)))
    )
    router = Router(block_size=BLOCK, seed=3)
    out = []
    for n in range(count):
        tokens = shared + prompt(100 + n, 2)
        selection = router.select(index, [(1, 0), (2, 0)], tokens=tokens, request_id=f"r{n}", record=True)
        assert selection.record is not None
        out.append(Recorded(f"r{n}", n + 1, 1000.0 + n, MODEL, "default", BLOCK, len(tokens), True, selection.record))
    return out


def test_the_ring_is_bounded_and_the_log_summarises(tmp_path: Path) -> None:
    decisions = recorded_decisions(12)
    ring = DecisionRecords(max_records=5)
    for recorded in decisions:
        ring.add(recorded)
    assert len(ring) == 5
    assert ring.evicted == 7
    assert ring.get("r0") is None
    newest = ring.get("r11")
    assert newest is not None
    assert decision_json(newest)["selection_id"] == "r11"
    small = DecisionRecords(max_bytes=decisions[0].record.nbytes * 2)
    for recorded in decisions:
        small.add(recorded)
    assert len(small) == 2
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(str(path))
    log.open()
    for recorded in decisions:
        log.add(recorded)
    log.close()
    with path.open("ab") as out:
        out.write(b"not a decision\n")
    with path.open("rb") as lines:
        found = summarise(lines)
    assert found["decisions"] == 12
    assert found["bad_lines"] == 1
    expected = [decision_json(r) for r in decisions]
    assert found["hit_rate"] == pytest.approx(
        sum(d["overlap_blocks"] for d in expected) / sum(d["prompt_blocks"] for d in expected)
    )
    assert found["avoidable_prefill_tokens"] == sum(d["avoidable_prefill_tokens"] for d in expected)
    assert sum(w["decisions"] for w in found["workers"]) == 12
    result = CliRunner().invoke(app, ["decision-log", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == found
    result = CliRunner().invoke(app, ["decision-log", str(path)])
    assert result.exit_code == 0
    assert "12 decisions" in result.output
    result = CliRunner().invoke(app, ["decision-log", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2
