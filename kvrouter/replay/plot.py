"""``--plot FILE.png``: hit rate and TTFT over each run's time, the fault marked, the baseline beside it.

One row of two panels per drill (hit rate, TTFT p50), each with the baseline's line in grey, so a reader
sees what the fault did and when it stopped mattering: a dip that recovers, or one that stays. The time
axis is seconds since the run's first request; the values are over a sliding window of
:data:`WINDOW` requests in send order (per-request values are too noisy to read). matplotlib is imported
lazily with the Agg backend, as ``kvrouter simulate --plot`` does (``sim/report.py``): it is the ``plot``
extra, not a dependency.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from .run import RunResult

__all__ = ["WINDOW", "series", "write_plot"]

WINDOW: Final = 20
"""Requests per point of the sliding window."""


def series(result: RunResult, window: int = WINDOW) -> tuple[list[float], list[float], list[float]]:
    """(seconds since the run's first request, hit rate, TTFT p50 in ms) over a sliding window of completed
    requests in send order; empty lists when fewer than ``window`` completed."""
    done = sorted(result.completed, key=lambda o: o.sent)
    if len(done) < window:
        return [], [], []
    start = min(o.sent for o in result.outcomes)
    times, hits, ttfts = [], [], []
    for end in range(window, len(done) + 1):
        chunk = done[end - window : end]
        prompt = sum(o.prompt_tokens for o in chunk)
        times.append(chunk[-1].sent - start)
        hits.append(sum(o.cached_tokens for o in chunk) / prompt if prompt else 0.0)
        values = [o.ttft_ms for o in chunk if o.ttft_ms is not None]
        ttfts.append(statistics.median(values) if values else float("nan"))
    return times, hits, ttfts


def write_plot(results: Sequence[RunResult], baseline: RunResult | None, path: Path) -> None:
    """Write the PNG (see the module docstring); drills without outcomes (skipped) are left out.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install 'kvrouter[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib, which is not installed: pip install 'kvrouter[plot]'") from exc

    runs = [r for r in results if r.outcomes]
    default_base = series(baseline) if baseline is not None else ([], [], [])
    fig, axes = plt.subplots(max(len(runs), 1), 2, figsize=(12, 2.6 * max(len(runs), 1) + 0.6), squeeze=False)
    try:
        for (hit_axis, ttft_axis), result in zip(axes, runs, strict=False):
            own = result.baseline  # the replica drills': the same workload on their stack
            base = series(own) if own is not None else default_base
            times, hits, ttfts = series(result)
            for axis, values, base_values, label in (
                (hit_axis, hits, base[1], "hit rate"),
                (ttft_axis, ttfts, base[2], "TTFT p50 [ms]"),
            ):
                if base[0]:
                    axis.plot(base[0], base_values, color="grey", linewidth=1, label="baseline")
                axis.plot(times, values, color="tab:blue", linewidth=1.2, label=result.drill)
                if result.fault_at is not None:
                    fault = result.fault_at - min(o.sent for o in result.outcomes)
                    axis.axvline(fault, color="tab:red", linestyle="--", linewidth=1, label="fault")
                axis.set_ylabel(label)
                axis.set_title(f"{result.drill}: {label}", fontsize="medium")
                axis.grid(True, alpha=0.3)
                axis.legend(fontsize="x-small", loc="best")
            ttft_axis.set_xlabel("s since the run's first request")
            hit_axis.set_xlabel("s since the run's first request")
        fig.suptitle(f"kvrouter replay: sliding windows of {WINDOW} requests")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
