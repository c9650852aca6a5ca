from __future__ import annotations

from typing import Any

from kvrouter.index import RadixIndex
from tests.index.contract import replay


def test_contract_scenario(contract_scenario: dict[str, Any]):
    """Every op of every scenario: the expected error kind, or exactly the expected score list."""
    for where, got, expected in replay(RadixIndex(), contract_scenario):
        assert got == expected, where
