"""Replaying ``radix_contract.json`` scenarios into any index with the contract's interface."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from kvrouter.errors import EventError
from kvrouter.events.model import WorkerKey


class ContractIndex(Protocol):
    def apply_event(self, worker_id: int, event: Any) -> None: ...
    def find_matches(self, local_hashes: list[int], early_exit: bool = False) -> dict[WorkerKey, int]: ...
    def remove_worker(self, worker_id: int) -> None: ...
    def clear_all_blocks(self, worker_id: int) -> None: ...


def error_kind(index: ContractIndex, worker_id: int, event: Any) -> str | None:
    """Apply one event; the kind of the error it raised, or None."""
    try:
        index.apply_event(worker_id, event)
    except EventError as exc:
        return exc.kind
    return None


def score_list(scores: Mapping[WorkerKey, int]) -> list[list[int]]:
    """Scores in the fixtures' form: ``[[worker_id, dp_rank, score], ...]`` sorted."""
    return sorted([worker, rank, score] for (worker, rank), score in scores.items())


def replay(index: ContractIndex, scenario: Mapping[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """Run each op; yield ``(where, got, expected)`` for every op that has an expectation."""
    for i, op in enumerate(scenario["ops"]):
        where = f"{scenario['name']} op {i}: {op}"
        match op["op"]:
            case "apply_event":
                yield where, error_kind(index, op["worker_id"], op["event"]), op["expect_error"]
            case "find_matches":
                yield where, score_list(index.find_matches(op["tokens_hashes"], op["early_exit"])), op["expected"]
            case "remove_worker":
                index.remove_worker(op["worker_id"])
            case "clear_all_blocks":
                index.clear_all_blocks(op["worker_id"])
            case other:
                raise AssertionError(f"unknown op {other!r} in {where}")
