"""How values read: short counts, signed rates, durations, and colour for state only."""

from __future__ import annotations

import pytest

from tui import cells


@pytest.mark.parametrize(
    ("value", "shown"),
    [(0, "0"), (850, "850"), (12_345, "12.3k"), (123_456, "123k"), (4_100_000, "4.1M"), (2.5, "2.5")],
)
def test_counts_fit_five_characters(value: float, shown: str) -> None:
    assert cells.count(value) == shown


@pytest.mark.parametrize(
    ("seconds", "shown"), [(0.26, "0.3s"), (37, "37s"), (724, "12m04s"), (11_520, "3h12m"), (187_200, "2d04h")]
)
def test_durations(seconds: float, shown: str) -> None:
    assert cells.duration(seconds) == shown


def test_rates_and_unknowns() -> None:
    assert cells.signed_rate(12) == "+12"
    assert cells.signed_rate(-3.5) == "-3.5"
    assert cells.signed_rate(None) == cells.DASH
    assert cells.age(None, 10.0) == cells.DASH
    assert cells.latency_us(210) == "0.21"


def test_numbers_are_right_aligned_and_only_states_have_colour() -> None:
    assert cells.number(12).justify == "right"
    assert cells.number(12).style == ""
    assert cells.state("exact").style == ""
    assert "red" in str(cells.state("unhealthy").style)
    assert "yellow" in str(cells.state("stale").style)
