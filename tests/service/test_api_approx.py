"""Approximate mode (``use_kv_events=False``) and the parts of the API that need no engine running.

The front's ``ApproxIndex`` takes every decision as cached on the chosen worker, so the next request
with the same prefix follows it and ``/query`` answers from it; ``/dump`` lists its blocks. Served by
aiohttp's test server on 127.0.0.1 over the service's own ``app`` (no engine is started: approximate
mode never asks it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from kvrouter.routing.config import RouterConfig
from kvrouter.service import Service, ServiceConfig

BLOCK = 4


async def exchange(service: Service, steps: list[tuple[str, str, Any]]) -> list[tuple[int, Any]]:
    answers = []
    async with TestClient(TestServer(service.app, host="127.0.0.1")) as client:
        for method, path, body in steps:
            response = await client.request(method, path, json=body)
            answers.append((response.status, await response.json()))
    return answers


def test_approximate_mode_routes_a_prefix_back_to_where_it_went():
    service = Service(ServiceConfig(port=0, shards=1, router=RouterConfig(use_kv_events=False, router_ttl_secs=60)))
    register = [
        ("POST", "/register", {"instance_id": wid, "model_name": "a", "block_size": BLOCK, "dp_rank": 0})
        for wid in (1, 2)
    ]
    tokens = list(range(1, 4 * BLOCK + 1))
    steps = [
        *register,
        ("POST", "/select_and_reserve", {"model_name": "a", "token_ids": tokens, "selection_id": "x"}),
        ("DELETE", "/reservations/x", None),
        ("POST", "/select", {"model_name": "a", "token_ids": [*tokens, 99], "explain": True}),
        ("POST", "/query", {"model_name": "a", "token_ids": tokens}),
        ("GET", "/workers", None),
        ("GET", "/dump", None),
        ("GET", "/ready", None),
    ]
    answers = asyncio.run(exchange(service, steps))
    assert [status for status, _ in answers] == [201, 201, 200, 200, 200, 200, 200, 200, 503]
    first, second = answers[2][1], answers[4][1]
    assert second["worker_id"] == first["worker_id"]  # the recorded decision is the overlap
    assert second["overlap"]["gpu"] == 4 * BLOCK
    query = answers[5][1]
    assert query["instances"][str(first["worker_id"])]["gpu"] == 4 * BLOCK
    assert {w["source"] for w in answers[6][1]} == {"approximate"}
    dump = answers[7][1]["a:default"]
    assert dump["block_size"] == BLOCK
    assert dump["complete"] is True
    assert len(dump["events"]) >= 1
    ready = answers[8][1]
    assert "engine starting" in ready["reasons"]
    assert len(service.core.reservations) == 0


def test_register_without_an_endpoint_is_refused_when_events_are_on():
    service = Service(ServiceConfig(port=0, shards=1))
    answers = asyncio.run(exchange(service, [("POST", "/register", {"instance_id": 1, "model_name": "a"})]))
    assert answers[0][0] == 400
    assert "endpoint" in answers[0][1]["error"]
