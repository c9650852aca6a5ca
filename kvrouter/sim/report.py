"""Simulation results as a table, JSON rows and a PNG: one row per (trace, workers, speedup, policy).

``spec/routing-benchmark.md`` §5 asks for each policy relative to round robin in the same simulation,
because ratios transfer between simulators better than milliseconds; so the table adds a ``xRR`` column
whenever its group (same trace, workers and speedup) has a ``round_robin`` row, and a ``ceiling``
column (hit over the pooled-LRU ceiling, §6.3). The JSON keeps absolute figures only, with a fixed key
set (``JSON_KEYS``), so files from different runs compare field by field; ratios are derived data.

The plot imports matplotlib lazily (the ``plot`` extra), with the Agg backend so it runs headless;
everything else needs only rich, which typer already brings.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from rich import box
from rich.table import Table

from .disagg import DisaggResult
from .metrics import RunResult

__all__ = [
    "DISAGG_JSON_KEYS",
    "JSON_KEYS",
    "Disagg",
    "ReportRow",
    "format_table",
    "hit_ratios",
    "rich_table",
    "row_from_disagg",
    "row_from_result",
    "to_json",
    "write_json",
    "write_plot",
]

JSON_KEYS: Final = (
    "trace",
    "workers",
    "speedup",
    "policy",
    "hit_rate",
    "ttft_ms",
    "itl_ms",
    "imbalance",
    "decision_us",
    "ceiling_fraction",
)
"""Every JSON row has exactly these keys (tests/sim/test_report.py::test_json_keys_are_exact)."""
DISAGG_JSON_KEYS: Final = (
    *JSON_KEYS,
    "prefill_workers",
    "decode_workers",
    "output_tokens_per_s",
    "bytes_transferred",
    "local_prefill_share",
)
"""A disaggregated run's row: ``JSON_KEYS``, its pools, its throughput and its transfers; its ``itl_ms`` has
``p90`` beside ``p50``."""

BASELINE: Final = "round_robin"
"""The policy the ``xRR`` column divides by (spec §5)."""


@dataclass(frozen=True, slots=True)
class Disagg:
    """What a disaggregated run adds to its row (``sim/disagg.py``)."""

    prefill_workers: int
    decode_workers: int
    output_tokens_per_s: float
    bytes_transferred: int
    local_prefill_share: float


@dataclass(frozen=True, slots=True)
class ReportRow:
    """One policy's run on one workload, in the units the report prints."""

    trace: str
    workers: int
    speedup: float
    policy: str
    """The policy's name, or a variant label such as ``kvrouter T=0.5``."""
    hit_rate: float
    """Reused input tokens over input tokens, measured by the engines at admission (§5)."""
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    imbalance: float
    """Uncached prefill tokens, max over mean across workers."""
    decision_p50_us: float
    decision_p99_us: float
    ceiling: float | None = None
    """The pooled-LRU hit-rate ceiling of this trace and worker count; None if not computed."""
    ttfts_ms: tuple[float, ...] = field(default=(), repr=False)
    """Every request's TTFT, for the plot; not part of the JSON."""
    itl_p90_ms: float | None = None
    """In a disaggregated comparison's table and JSON (the aggregated JSON keeps ``itl_ms.p50`` alone)."""
    disagg: Disagg | None = None
    """A disaggregated run's own figures; None for an aggregated one."""

    @property
    def group(self) -> tuple[str, int, float]:
        """Rows of one group ran the same requests on the same fleet and compare directly."""
        return (self.trace, self.workers, self.speedup)

    @property
    def ceiling_fraction(self) -> float | None:
        if not self.ceiling:
            return None
        return self.hit_rate / self.ceiling


def row_from_result(
    result: RunResult | DisaggResult,
    *,
    trace: str,
    workers: int,
    speedup: float,
    policy: str | None = None,
    ceiling: float | None = None,
) -> ReportRow:
    """The report's view of one simulation run.

    Args:
        result: what ``kvrouter.sim.simulator.simulate`` (or ``simulate_disagg``) measured.
        trace: the trace's or workload's name.
        workers: the fleet size the run used.
        speedup: the arrival speedup the requests were loaded with.
        policy: the row's label; the policy's own name when None.
        ceiling: the pooled-LRU ceiling of these requests on this fleet, if computed.
    """
    return ReportRow(
        trace=trace,
        workers=workers,
        speedup=speedup,
        policy=policy if policy is not None else result.policy,
        hit_rate=result.hit_rate,
        ttft_p50_ms=result.ttft_p50_ms,
        ttft_p90_ms=result.ttft_p90_ms,
        ttft_p99_ms=result.ttft_p99_ms,
        itl_p50_ms=result.itl_p50_ms,
        itl_p90_ms=result.itl_p90_ms,
        imbalance=result.prefill_imbalance,
        decision_p50_us=result.decision_us_p50,
        decision_p99_us=result.decision_us_p99,
        ceiling=ceiling,
        ttfts_ms=tuple(result.ttft_ms),
    )


def row_from_disagg(result: DisaggResult, *, trace: str, speedup: float, ceiling: float | None = None) -> ReportRow:
    """The report's view of one disaggregated run (``sim/disagg.py``); ``workers`` is both pools."""
    workers = result.prefill_workers + result.decode_workers
    row = row_from_result(result, trace=trace, workers=workers, speedup=speedup, ceiling=ceiling)
    disagg = Disagg(
        prefill_workers=result.prefill_workers,
        decode_workers=result.decode_workers,
        output_tokens_per_s=result.output_tokens_per_s,
        bytes_transferred=result.bytes_transferred,
        local_prefill_share=result.local_prefill_share,
    )
    return dataclasses.replace(row, disagg=disagg)


def hit_ratios(rows: Sequence[ReportRow]) -> list[float | None]:
    """Per row, its hit over round_robin's hit in the same group; None where the group has no round_robin."""
    baseline = {row.group: row.hit_rate for row in rows if row.policy == BASELINE}
    out: list[float | None] = []
    for row in rows:
        base = baseline.get(row.group)
        if base is None:
            out.append(None)
        else:
            out.append(row.hit_rate / base if base > 0 else math.inf)
    return out


def to_json(row: ReportRow) -> dict[str, Any]:
    """The row with exactly ``JSON_KEYS`` (``DISAGG_JSON_KEYS`` for a disaggregated run): nested ``ttft_ms``,
    ``itl_ms`` and ``decision_us`` percentiles."""
    out = {
        "trace": row.trace,
        "workers": row.workers,
        "speedup": row.speedup,
        "policy": row.policy,
        "hit_rate": row.hit_rate,
        "ttft_ms": {"p50": row.ttft_p50_ms, "p90": row.ttft_p90_ms, "p99": row.ttft_p99_ms},
        "itl_ms": {"p50": row.itl_p50_ms},
        "imbalance": row.imbalance,
        "decision_us": {"p50": row.decision_p50_us, "p99": row.decision_p99_us},
        "ceiling_fraction": row.ceiling_fraction,
    }
    disagg = row.disagg
    if disagg is not None:
        out["itl_ms"] = {"p50": row.itl_p50_ms, "p90": row.itl_p90_ms}
        out["prefill_workers"] = disagg.prefill_workers
        out["decode_workers"] = disagg.decode_workers
        out["output_tokens_per_s"] = disagg.output_tokens_per_s
        out["bytes_transferred"] = disagg.bytes_transferred
        out["local_prefill_share"] = disagg.local_prefill_share
    return out


def write_json(rows: Iterable[ReportRow], path: Path, **extra: Any) -> None:
    """``{"rows": [...], **extra}`` as indented JSON; ``extra`` carries run metadata (seed, machine)."""
    import json

    path.write_text(json.dumps({"rows": [to_json(row) for row in rows], **extra}, indent=2) + "\n")


_HEADERS: Final = (
    "trace",
    "W",
    "speedup",
    "policy",
    "hit",
    "xRR",
    "TTFT p50",
    "p90",
    "p99 ms",
    "ITL p50",
    "imbal",
    "dec µs p50",
    "p99",
    "ceiling",
    "ITL p90",
    "out tok/s",
    "moved GB",
    "local",
)
_DISAGG_HEADERS: Final = frozenset({"ITL p90", "out tok/s", "moved GB", "local"})
"""The columns of a disaggregated comparison only (``--prefill-workers``)."""


def _cells(rows: Sequence[ReportRow]) -> tuple[list[list[str]], list[int]]:
    """Formatted cells per row, and the columns to show: xRR when a row has a figure for it, the
    disaggregated ones when a row is disaggregated."""
    ratios = hit_ratios(rows)
    out = []
    for row, ratio in zip(rows, ratios, strict=True):
        fraction = row.ceiling_fraction
        disagg = row.disagg
        out.append(
            [
                row.trace,
                str(row.workers),
                f"{row.speedup:g}",
                row.policy,
                f"{row.hit_rate:.3f}",
                "" if ratio is None else f"x{ratio:.2f}",
                f"{row.ttft_p50_ms:.0f}",
                f"{row.ttft_p90_ms:.0f}",
                f"{row.ttft_p99_ms:.0f}",
                f"{row.itl_p50_ms:.2f}",
                f"{row.imbalance:.2f}",
                f"{row.decision_p50_us:.1f}",
                f"{row.decision_p99_us:.1f}",
                "" if fraction is None else f"{fraction:.0%}",
                "" if row.itl_p90_ms is None else f"{row.itl_p90_ms:.2f}",
                "" if disagg is None else f"{disagg.output_tokens_per_s:.0f}",
                "" if disagg is None else f"{disagg.bytes_transferred / 1e9:.1f}",
                "" if disagg is None else f"{disagg.local_prefill_share:.0%}",
            ]
        )
    with_ratio = any(ratio is not None for ratio in ratios)
    with_disagg = any(row.disagg is not None for row in rows)
    keep = [
        i
        for i, name in enumerate(_HEADERS)
        if (with_ratio or name != "xRR") and (with_disagg or name not in _DISAGG_HEADERS)
    ]
    return out, keep


def format_table(rows: Sequence[ReportRow]) -> str:
    """A plain-text table (for logs, CI output and files), one line per row, columns aligned."""
    cells, keep = _cells(rows)
    table = [[_HEADERS[i] for i in keep], *([line[i] for i in keep] for line in cells)]
    widths = [max(len(line[c]) for line in table) for c in range(len(keep))]
    left = {_HEADERS.index("trace"), _HEADERS.index("policy")}
    lines = []
    for line in table:
        parts = [
            text.ljust(width) if keep[c] in left else text.rjust(width)
            for c, (text, width) in enumerate(zip(line, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


_RICH_HEADERS: Final = {
    "TTFT p50": "TTFT ms\np50",
    "p90": "\np90",
    "p99 ms": "\np99",
    "ITL p50": "ITL ms\np50",
    "imbal": "prefill\nimbal",
    "dec µs p50": "decide µs\np50",
    "p99": "\np99",
    "ITL p90": "ITL ms\np90",
    "out tok/s": "output\ntok/s",
    "moved GB": "KV moved\nGB",
    "local": "local\nprefill",
}
"""Two-line headers for the terminal table, so it fits 80 columns."""


def rich_table(rows: Sequence[ReportRow], *, title: str | None = None) -> Table:
    """The same table for a terminal, with a rule between groups.

    When every row is of one group, its trace, workers and speedup columns are left out: the title
    should say them, and the table then fits an 80-column terminal.
    """
    cells, keep = _cells(rows)
    if len({row.group for row in rows}) <= 1:
        keep = [i for i in keep if _HEADERS[i] not in ("trace", "W", "speedup")]
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0))
    for i in keep:
        name = _HEADERS[i]
        header = _RICH_HEADERS.get(name, name)
        justify: Literal["left", "right"] = "left" if name in ("trace", "policy") else "right"
        table.add_column(header, justify=justify, no_wrap=True)
    previous = None
    for row, line in zip(rows, cells, strict=True):
        if previous is not None and row.group != previous:
            table.add_section()
        previous = row.group
        table.add_row(*(line[i] for i in keep))
    return table


def _group_title(group: tuple[str, int, float]) -> str:
    trace, workers, speedup = group
    return f"{trace}, {workers} workers, arrivals x{speedup:g}"


def write_plot(rows: Sequence[ReportRow], path: Path, *, title: str | None = None) -> None:
    """A PNG with one line of panels per group: TTFT cumulative distribution per policy (left, log
    scale) and hit rate per policy with the group's pooled-LRU ceiling (right). A policy keeps its
    colour in every group.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install 'kvrouter[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib, which is not installed: pip install 'kvrouter[plot]'") from exc

    groups: dict[tuple[str, int, float], list[ReportRow]] = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row)
    policies = list(dict.fromkeys(row.policy for row in rows))
    palette = plt.get_cmap("tab20")  # dark shades for the first ten policies, then the light ones
    colour = {name: palette((2 * i) % 20 + (2 * i // 20) % 2) for i, name in enumerate(policies)}
    heights = [max(3.5, 0.3 * len(members) + 1.2) for members in groups.values()] or [3.5]
    fig, axes = plt.subplots(
        max(len(groups), 1),
        2,
        figsize=(13, sum(heights) + (0.5 if title else 0)),
        gridspec_kw={"width_ratios": [3, 2], "height_ratios": heights},
        squeeze=False,
    )
    try:
        for (cdf, bars), (group, members) in zip(axes, groups.items(), strict=False):
            for row in members:
                if row.ttfts_ms:
                    values = sorted(row.ttfts_ms)
                    n = len(values)
                    fractions = [(i + 1) / n for i in range(n)]
                    cdf.step(values, fractions, where="post", color=colour[row.policy], label=row.policy)
            cdf.set_xscale("log")
            cdf.set_xlabel("TTFT [ms]")
            cdf.set_ylabel("fraction of requests")
            cdf.set_title(f"TTFT, {_group_title(group)}", fontsize="medium")
            cdf.grid(True, which="both", alpha=0.3)
            if any(row.ttfts_ms for row in members):
                cdf.legend(fontsize="x-small", loc="lower right")
            positions = list(range(len(members)))
            bars.barh(positions, [row.hit_rate for row in members], color=[colour[row.policy] for row in members])
            ceiling = next((row.ceiling for row in members if row.ceiling), None)
            if ceiling:
                bars.axvline(ceiling, color="black", linestyle="--", linewidth=1, label="pooled-LRU ceiling")
                bars.legend(fontsize="x-small", loc="lower right")
            bars.set_yticks(positions, [row.policy for row in members], fontsize="small")
            bars.invert_yaxis()
            bars.set_xlabel("prefix-cache hit rate")
            bars.set_title("hit rate", fontsize="medium")
            bars.grid(True, axis="x", alpha=0.3)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)
