from __future__ import annotations

from typing import Any

import pytest

from kvrouter.errors import EventError
from kvrouter.index import RadixIndex


def _scores(index: RadixIndex, query: list[int], early_exit: bool) -> list[list[int]]:
    return sorted([w, r, s] for (w, r), s in index.find_matches(query, early_exit=early_exit).items())


def test_contract_scenario(contract_scenario: dict[str, Any]):
    """Every op of every scenario: the expected error kind, or exactly the expected score list."""
    index = RadixIndex()
    for i, op in enumerate(contract_scenario["ops"]):
        where = f"op {i}: {op}"
        match op["op"]:
            case "apply_event":
                try:
                    index.apply_event(op["worker_id"], op["event"])
                except EventError as exc:
                    assert exc.kind == op["expect_error"], where
                else:
                    assert op["expect_error"] is None, where
            case "find_matches":
                assert _scores(index, op["tokens_hashes"], op["early_exit"]) == op["expected"], where
            case "remove_worker":
                index.remove_worker(op["worker_id"])
            case "clear_all_blocks":
                index.clear_all_blocks(op["worker_id"])
            case other:
                pytest.fail(f"unknown op {other!r}")
