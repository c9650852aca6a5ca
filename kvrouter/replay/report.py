"""What ``kvrouter replay`` prints and writes: a ``rich`` table, the ``--json`` document, the exit status.

The JSON is versioned (:data:`JSON_VERSION`); ``drills`` holds one object per drill with the issue's
fields (``drill``, ``gaps``, ``converged``, ``converge_s``, ``wrong_answers``, ``hit_rate``, ``ttft_ms``,
``baseline``) plus what an operator needs to read them: ``status`` (``ok``, ``failed``, ``skipped``),
``fault`` (what was done), ``fault_seen``, ``probe_answers``, ``errors`` (requests that failed, e.g. in
flight on a restarted engine), ``restarts`` and ``mismatch``. ``docs/replay.md`` documents each field.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from rich.console import Console
from rich.table import Table

from .run import RunResult

__all__ = ["JSON_VERSION", "Skipped", "drill_json", "exit_status", "quality", "render", "report_json"]

JSON_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class Skipped:
    """A drill the stack does not allow (``--url``: no local processes)."""

    drill: str
    reason: str


def ok(result: RunResult) -> bool:
    """Converged, every gap accounted, and the fault was seen (a fault never seen tested nothing); with
    replicas, also their loads agreeing and every loss of the sync counted; on a disaggregated stack, also
    every client answered or refused and nothing left booked."""
    agree = result.replicas is None or bool(result.replicas["loads_agree"])
    settled = result.booked is None or (not result.booked and not result.unanswered)
    return result.converged and result.accounted and result.fault_seen and agree and settled


def quality(result: RunResult) -> dict[str, Any]:
    return {"hit_rate": round(result.hit_rate, 4), "ttft_ms": result.ttft_ms()}


def drill_json(result: RunResult | Skipped, baseline: RunResult | None) -> dict[str, Any]:
    """One entry of ``drills``."""
    if isinstance(result, Skipped):
        return {"drill": result.drill, "status": "skipped", "reason": result.reason}
    baseline = result.baseline or baseline  # the replica drills' own, on their stack
    extra: dict[str, Any] = {} if result.replicas is None else {"replicas": result.replicas}
    if result.booked is not None:
        extra |= {"unanswered": result.unanswered, "booked": result.booked}
    return {
        "drill": result.drill,
        "status": "ok" if ok(result) else "failed",
        "fault": result.fault,
        "fault_seen": result.fault_seen,
        "gaps": dict(result.gaps),
        "restarts": result.restarts,
        "converged": result.converged,
        "converge_s": result.converge_s,
        "mismatch": result.mismatch,
        "wrong_answers": result.wrong_answers,
        "probe_answers": len(result.probes.answers),
        "requests": len(result.outcomes),
        "errors": result.errors,
        "error_kinds": dict(Counter(o.error for o in result.outcomes if o.error is not None)),
        **quality(result),
        "baseline": quality(baseline) if baseline is not None else None,
        "elapsed_s": result.elapsed_s,
        **extra,
    }


def report_json(
    results: Sequence[RunResult | Skipped],
    baseline: RunResult | None,
    workload: dict[str, Any],
    not_built: Sequence[str],
) -> dict[str, Any]:
    """The ``--json`` document."""
    base = None
    if baseline is not None:
        base = {
            **quality(baseline),
            "errors": baseline.errors,
            "wrong_answers": baseline.wrong_answers,
            "converged": baseline.converged,
        }
    return {
        "version": JSON_VERSION,
        "workload": workload,
        "baseline": base,
        "drills": [drill_json(r, baseline) for r in results],
        "not_built": list(not_built),
    }


def exit_status(results: Sequence[RunResult | Skipped]) -> int:
    """0 when every drill that ran converged with every gap accounted, else 1 (skipped drills do not count)."""
    return 0 if all(ok(r) for r in results if isinstance(r, RunResult)) else 1


def replicas_line(replicas: dict[str, Any]) -> str:
    """One line on the replicas' end state: loads, losses, and per replica what its sync counted."""
    parts = [
        f"{replicas['count']} replicas",
        "loads agree" if replicas["loads_agree"] else "[red]loads DIFFER[/red]",
        "every loss counted" if replicas["lost_counted"] else "[red]a loss NOT counted[/red]",
    ]
    for i, replica in enumerate(replicas["sync"]):
        counters = replica["counters"]
        fixed = sum(counters[k] for k in ("resync_added", "resync_freed", "resync_updated", "resync_republished"))
        parts.append(
            f"replica {i}: disconnects {counters['disconnects']}, reconnects {counters['reconnects']}, "
            f"resyncs {counters['resyncs']} ({fixed} corrected), dropped {counters['dropped']}"
        )
    return "; ".join(parts)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def render(console: Console, results: Sequence[RunResult | Skipped], baseline: RunResult | None) -> None:
    """The table: one row per drill, the baseline's quality beside each."""
    table = Table(title="kvrouter replay")
    for column in ("drill", "status", "gaps d/r/l", "converged", "converge s", "wrong/probes",
                   "hit rate (base)", "TTFT p50/p90 ms (base)", "errors"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("drill", "status") else "right")
    default_base = quality(baseline) if baseline is not None else None
    for result in results:
        if isinstance(result, Skipped):
            table.add_row(result.drill, "[yellow]skipped", *["-"] * 7)
            continue
        base = quality(result.baseline) if result.baseline is not None else default_base
        ttft = result.ttft_ms()
        hit = f"{result.hit_rate:.3f}"
        ttft_text = f"{_ms(ttft['p50'])}/{_ms(ttft['p90'])}"
        if base is not None:
            hit += f" ({base['hit_rate']:.3f})"
            ttft_text += f" ({_ms(base['ttft_ms']['p50'])}/{_ms(base['ttft_ms']['p90'])})"
        gaps = result.gaps
        table.add_row(
            result.drill,
            "[green]ok" if ok(result) else "[red]failed" + ("" if result.fault_seen else " (fault not seen)"),
            f"{gaps['detected']}/{gaps['recovered']}/{gaps['lost']}",
            "yes" if result.converged else "[red]no",
            "-" if result.converge_s is None else f"{result.converge_s:.2f}",
            f"{result.wrong_answers}/{len(result.probes.answers)}",
            hit,
            ttft_text,
            str(result.errors),
        )
    console.print(table)
    for result in results:
        if isinstance(result, Skipped):
            console.print(f"[yellow]{result.drill}[/yellow] skipped: {result.reason}")
    for result in results:
        if isinstance(result, RunResult) and result.replicas is not None:
            console.print(f"{result.drill}: {replicas_line(result.replicas)}")
    for result in results:
        if isinstance(result, RunResult) and result.booked is not None:
            booked = ", ".join(f"worker {w}: {load}" for w, load in result.booked.items()) or "nothing"
            console.print(f"{result.drill}: {result.unanswered} clients left unanswered; left booked: {booked}")
    for result in results:
        if isinstance(result, RunResult) and not result.converged and result.mismatch:
            console.print(f"[red]{result.drill}[/red]: the index differs from the engines: {result.mismatch}")
