"""Shared fixtures: the reference data in ``../shared/fixtures``, resolved once.

Tests never open fixture paths themselves; they take these fixtures and use case / scenario names as
test ids (see ``pytest_generate_tests``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
ENGINES = ("vllm-0.33.0", "vllm-0.23.0", "sglang-0.5.23")


def _load_json(name: str) -> Any:
    with (FIXTURES / name).open() as fh:
        return json.load(fh)


_cache: dict[str, Any] = {}


def _cached(name: str) -> Any:
    if name not in _cache:
        _cache[name] = _load_json(name)
    return _cache[name]


@pytest.fixture(scope="session")
def hash_vectors() -> list[dict[str, Any]]:
    """Cases of ``hash_vectors.json``: ``{name, inputs, block_hashes, sequence_hashes}``."""
    return list(_cached("hash_vectors.json")["cases"])


@pytest.fixture(scope="session")
def radix_contract() -> list[dict[str, Any]]:
    """Scenarios of ``radix_contract.json`` (kvrouter's index contract)."""
    return list(_cached("radix_contract.json")["scenarios"])


@pytest.fixture(scope="session")
def router_view() -> dict[str, Any]:
    """``engine_frames/router_view.json``: per engine, converted events and the scores after each batch."""
    return dict(_cached("engine_frames/router_view.json")["engines"])


def load_engine_frames(engine: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(captured msgpack file, its JSON twin) for one engine name of ``ENGINES``."""
    with (FIXTURES / "engine_frames" / f"{engine}.msgpack").open("rb") as fh:
        captured = msgpack.unpackb(fh.read(), raw=False, strict_map_key=False)
    return captured, _cached(f"engine_frames/{engine}.json")


@pytest.fixture(scope="session", params=ENGINES)
def engine_frames(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(engine name, captured msgpack content, JSON twin), once per captured engine."""
    captured, twin = load_engine_frames(request.param)
    return request.param, captured, twin


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise ``hash_case`` and ``contract_scenario`` by their fixture names, for readable ids."""
    if "hash_case" in metafunc.fixturenames:
        cases = _cached("hash_vectors.json")["cases"]
        metafunc.parametrize("hash_case", cases, ids=[c["name"] for c in cases])
    if "contract_scenario" in metafunc.fixturenames:
        scenarios = _cached("radix_contract.json")["scenarios"]
        metafunc.parametrize("contract_scenario", scenarios, ids=[s["name"] for s in scenarios])
