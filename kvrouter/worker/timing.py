"""How long one engine iteration takes: Dynamo's mocker polynomials (``spec/routing-benchmark.md`` §2.3).

The worker model only ever asks "this iteration prefilled T new tokens and decoded with KV usage p: how
many milliseconds?". Both curves are the mocker's ``PerfModel::Polynomial`` (ai-dynamo-runtime 1.6.1),
fitted to roughly an 8B model on one GPU; absolute milliseconds are not hardware numbers, ratios are.

- ``prefill_ms(T)`` takes the *uncached* tokens of the whole iteration, summed over every sequence that
  prefilled a chunk in it, so the 16.5 ms constant is paid once per iteration, not once per sequence
  (cached tokens cost nothing: that is what turns hit rate into TTFT). One 8192-token chunk is
  169.14 ms, hence the §2.3 single-request check (512 / 1024 / 4096 / 8192 / 16384 tokens →
  24.39 / 32.49 / 85.76 / 169.14 / 338.27 ms), pinned by ``tests/worker/test_timing.py``.
- ``decode_ms(p)`` takes the KV usage ``p`` = blocks held by running sequences (the active pool,
  partial blocks included) / blocks per worker: the mocker's ``num_active_blocks * block_size /
  (num_gpu_blocks * block_size)``. Cached-but-idle (inactive) blocks do not count. This is the
  definition under which the calibration gate (§7, ``tests/sim/test_calibration.py``) holds.
"""

from __future__ import annotations

from typing import Final

__all__ = ["DECODE_COEFFS", "DECODE_FLOOR_MS", "PREFILL_COEFFS", "decode_ms", "prefill_ms"]

PREFILL_COEFFS: Final = (4.209989e-7, 1.518344e-2, 16.50142)
"""``a·T² + b·T + c`` milliseconds for T uncached tokens (mocker ``perf_model.rs``, §2.3)."""

DECODE_COEFFS: Final = (-25.74, 54.01, 5.74)
"""``a·p² + b·p + c`` milliseconds at KV usage p (mocker ``perf_model.rs``, §2.3)."""

DECODE_FLOOR_MS: Final = 1.0
"""The mocker's floor on a decode step, so token timestamps never collapse."""


def prefill_ms(tokens: int) -> float:
    """Milliseconds to prefill ``tokens`` uncached tokens in one iteration; 0 when there are none."""
    if tokens <= 0:
        return 0.0
    a, b, c = PREFILL_COEFFS
    return a * tokens * tokens + b * tokens + c


def decode_ms(usage: float) -> float:
    """Milliseconds of one decode step at KV usage ``usage`` (active blocks / capacity, clamped to 1)."""
    p = min(usage, 1.0)
    a, b, c = DECODE_COEFFS
    return max(DECODE_FLOOR_MS, a * p * p + b * p + c)
