"""``kvrouter decision-log FILE``: what a ``kvrouter up --decision-log FILE`` run decided, summarised."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

EPILOG = (
    "The hit rate is the chosen workers' predicted overlap over the prompts' blocks; the best hit rate the same "
    "with every decision going to the candidate with the most overlap; avoidable prefill is the difference "
    "in tokens, what the router spent on balancing load. Skew: the busiest worker's share of the decisions "
    "times the number of workers (1.0 is even)."
)


def decision_log(
    path: Annotated[Path, typer.Argument(help="A decision log (kvrouter up --decision-log FILE).", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Summarise a decision log: hit rate, avoidable prefill, per-worker skew."""
    from ..service.core.decisions import summarise  # here: the service package imports aiohttp and the engine

    try:
        with path.open("rb") as lines:
            found = summarise(lines)
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint="FILE") from exc
    if json_out:
        typer.echo(json.dumps(found, indent=2))
        return
    console = Console()
    console.print(
        f"{found['decisions']} decisions ({found['reserved']} reserved) over {found['seconds']:.0f} s; "
        f"hit rate {100 * found['hit_rate']:.1f}% (best {100 * found['best_hit_rate']:.1f}%); "
        f"avoidable prefill {found['avoidable_prefill_tokens']:,} tokens; skew {found['skew']:.2f}"
        + (f"; {found['bad_lines']} lines not decisions" if found["bad_lines"] else "")
    )
    table = Table("worker", "decisions", "share", "hit rate", "avoidable prefill tokens")
    for row in found["workers"]:
        table.add_row(
            f"{row['worker_id']}:{row['dp_rank']}",
            str(row["decisions"]),
            f"{100 * row['share']:.1f}%",
            f"{100 * row['hit_rate']:.1f}%",
            f"{row['avoidable_prefill_tokens']:,}",
        )
    console.print(table)
