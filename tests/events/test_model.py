from __future__ import annotations

import pytest

from kvrouter.errors import BadEvent
from kvrouter.events.model import TIER_NAMES, StorageTier, parse_tier

ENGINE_SPELLINGS = {
    "vllm": {"GPU": "device", "CPU": "host", "STORAGE": "disk"},
    "sglang": {"GPU": "device", "CPU_PINNED": "host", "DISK": "disk", "EXTERNAL": "shared"},
    "dynamo": {"device": "device", "host_pinned": "host", "disk": "disk", "external": "shared"},
    "http": {"gpu": "device", "cpu": "host", "disk": "disk"},
}


@pytest.mark.parametrize("engine", sorted(ENGINE_SPELLINGS))
def test_every_engine_tier_name_maps(engine: str):
    for name, tier in ENGINE_SPELLINGS[engine].items():
        assert parse_tier(name) is StorageTier(tier)


def test_the_table_holds_nothing_else():
    known = {name for names in ENGINE_SPELLINGS.values() for name in names} | {t.value for t in StorageTier}
    assert set(TIER_NAMES) == known


def test_absent_medium_is_device():
    assert parse_tier(None) is StorageTier.DEVICE


def test_unknown_tier_is_a_bad_event():
    with pytest.raises(BadEvent, match="'VRAM'"):
        parse_tier("VRAM")


def test_tiers_are_ordered_fastest_first():
    assert [t.rank for t in StorageTier] == [0, 1, 2, 3]
    assert StorageTier.DEVICE.rank < StorageTier.HOST.rank < StorageTier.DISK.rank < StorageTier.SHARED.rank
