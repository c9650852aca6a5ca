"""``kvrouter.worker.timing``: the mocker's polynomials and the §2.3 single-request TTFT check."""

from __future__ import annotations

import pytest

from kvrouter.worker.timing import decode_ms, prefill_ms

CHUNK = 8192
"""``max_num_batched_tokens``: a lone prompt is prefilled in chunks of this size."""


@pytest.mark.parametrize(
    ("isl", "ttft_ms"), [(512, 24.39), (1024, 32.49), (4096, 85.76), (8192, 169.14), (16384, 338.27)]
)
def test_single_request_ttft_is_the_formula_summed_per_chunk(isl, ttft_ms):
    chunks = [min(CHUNK, isl - start) for start in range(0, isl, CHUNK)]
    assert sum(prefill_ms(chunk) for chunk in chunks) == pytest.approx(ttft_ms, abs=0.005)


def test_no_new_tokens_cost_nothing():
    assert prefill_ms(0) == 0.0


@pytest.mark.parametrize(("usage", "ms"), [(0.0, 5.74), (0.075, 9.65), (0.6, 28.9)])
def test_decode_polynomial(usage, ms):
    assert decode_ms(usage) == pytest.approx(ms, abs=0.05)


def test_decode_usage_is_clamped_to_one():
    assert decode_ms(3.0) == decode_ms(1.0) == pytest.approx(-25.74 + 54.01 + 5.74)
