"""``/select``'s spliced answer (no ``explain``, no ``fallbacks``) is the dict-built one, member for member
and in the same order, against a real service and a real mock engine's cache."""

from __future__ import annotations

from typing import Any

import orjson

from tests.service.conftest import BLOCK, MODEL, Running


def members(answer: dict[str, Any]) -> bytes:
    """The answer's members in order, re-encoded (so ``64`` and ``64.0`` differ), without those that may
    move between two calls (the index summary) or that only the dict-built answer has (``explain``)."""
    assert set(answer["index"]) == {"epoch", "events_applied", "last_event_age_ms", "recovering"}
    return orjson.dumps([(k, v) for k, v in answer.items() if k not in ("index", "explain")])


def test_spliced_answer_equals_the_dict_built_one(running: Running, wait_until: Any) -> None:
    warm = [50_000 + i for i in range(3 * BLOCK)]
    running.workers[1].complete(warm, max_tokens=2)  # worker 2 caches the prompt's 3 blocks
    request = {"model_name": MODEL, "token_ids": [*warm, 7, 8]}

    def overlapped() -> bool:
        return bool(running.ok("POST", "/select", request)["overlap"]["gpu"] == 3 * BLOCK)

    wait_until(overlapped, what="worker 2 indexed")
    status, spliced, headers = running.call("POST", "/select", request)
    assert status == 200
    assert headers["Content-Type"].startswith("application/json")
    assert "X-Kvrouter-Index-Epoch" in headers
    assert headers["X-Gateway-Destination-Endpoint"] == spliced["address"]
    built = running.ok("POST", "/select", {**request, "explain": True})
    assert "explain" in built
    assert members(spliced) == members(built)
    assert spliced["worker_id"] == 2
    assert spliced["overlap"] == {"longest_matched": 48, "gpu": 48, "dp": {"0": 48}, "cpu": 48, "disk": 48}

    body = {**request, "selection_id": 'r "1"'}
    booked = running.ok("POST", "/select_and_reserve", body)
    running.ok("DELETE", "/reservations/r%20%221%22")
    again = running.ok("POST", "/select_and_reserve", {**body, "explain": True})
    running.ok("DELETE", "/reservations/r%20%221%22")
    assert booked["selection_id"] == 'r "1"'
    assert members(booked) == members(again)
