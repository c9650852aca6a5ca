"""``kvrouter simulate``: replay a Mooncake trace through simulated engines under each routing policy.

Every policy runs on the same requests, fleet and seed, one after another, and the results land in one
table with hit rate over round robin and over the pooled-LRU ceiling (``spec/routing-benchmark.md`` §5,
§6.3). With no ``--trace`` the packaged 2,000-request conversation sample runs, so the command works
from a bare ``pip install``; the defaults (4 workers, arrivals x2) are the C4 workload of §3.

Environment variables are ``KVROUTER_SIM_*`` rather than ``KVROUTER_<NAME>`` (``spec/interfaces.md`` §5)
because ``kvrouter up --workers`` already owns ``KVROUTER_WORKERS`` with another meaning.
"""

from __future__ import annotations

import enum
import logging
from importlib.util import find_spec
from pathlib import Path
from time import perf_counter
from typing import Annotated, Final

import typer
from rich.console import Console

from ..sim.ceiling import pooled_lru_ceiling
from ..sim.policies import POLICIES, make_policy
from ..sim.report import ReportRow, format_table, rich_table, row_from_result, write_json
from ..sim.simulator import simulate as run_simulation
from ..sim.trace import SAMPLE_NAME, Trace, load_sample, load_trace
from ..sim.workloads import WORKLOADS, generate, parse_workload_options

__all__ = ["parse_policies", "simulate"]

log = logging.getLogger(__name__)

DEFAULT_POLICIES: Final = "round_robin,dynamo_t0,kvrouter"
"""The baseline, the reference's cost and the project's router: the comparison §7 is about."""

_WORKLOAD: Final = "Workload"


class PrefixSharing(enum.StrEnum):
    """``WorkerConfig.prefix_sharing``'s choices, as typer lists them."""

    scheduled = "scheduled"
    computed = "computed"


_ROUTING: Final = "Routing"
_OUTPUT: Final = "Output"

EPILOG: Final = (
    "Examples:\n\n"
    "  kvrouter simulate                                   # packaged sample, 4 workers, x2\n\n"
    "  kvrouter simulate --policy round_robin,kvrouter --workers 8 --speedup 4 --plot c8.png\n\n"
    "  kvrouter simulate --trace conversation_trace.jsonl --json results.json --event-lag-ms 50\n\n"
    "  kvrouter simulate --workload fanout --workers 8 --speedup 15 -o seed=3 -o group_max=12"
)


def parse_policies(value: str) -> list[str]:
    """Policy names from ``"a,b , c"``: stripped, in order, each once.

    Raises:
        typer.BadParameter: an empty list or a name the registry does not know (the message lists them).
    """
    names = list(dict.fromkeys(part.strip() for part in value.split(",") if part.strip()))
    if not names:
        raise typer.BadParameter(f"no policy given; choose from: {', '.join(POLICIES)}", param_hint="--policy")
    unknown = [name for name in names if name not in POLICIES]
    if unknown:
        raise typer.BadParameter(
            f"unknown policy {', '.join(repr(n) for n in unknown)}; choose from: {', '.join(POLICIES)}",
            param_hint="--policy",
        )
    return names


def simulate(
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            metavar="FILE",
            exists=True,
            dir_okay=False,
            readable=True,
            envvar="KVROUTER_SIM_TRACE",
            show_envvar=True,
            help="Mooncake-format JSONL trace (timestamp ms, input/output tokens, 512-token hash ids).",
            show_default=f"the packaged sample, {SAMPLE_NAME}",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None,
    workload: Annotated[
        str | None,
        typer.Option(
            "--workload",
            metavar="NAME",
            envvar="KVROUTER_SIM_WORKLOAD",
            show_envvar=True,
            help="Generate a seeded trace instead of reading one: "
            + "; ".join(f"{name}: {spec.summary}" for name, spec in WORKLOADS.items())
            + ".",
            show_default="none",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None,
    workload_option: Annotated[
        list[str] | None,
        typer.Option(
            "--workload-option",
            "-o",
            metavar="KEY=VALUE",
            help="A --workload parameter (repeatable), e.g. seed=3 or requests=500; a wrong key lists them all.",
            show_default="the workload's defaults",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None,
    write_trace: Annotated[
        Path | None,
        typer.Option(
            "--write-trace",
            metavar="FILE",
            dir_okay=False,
            help="Also write the generated --workload trace to FILE as Mooncake JSONL (before --speedup).",
            rich_help_panel=_OUTPUT,
        ),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit",
            min=1,
            metavar="N",
            envvar="KVROUTER_SIM_LIMIT",
            show_envvar=True,
            help=r"Replay only the first N requests of the trace. \[requests]",
            show_default="all",
            rich_help_panel=_WORKLOAD,
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            "-w",
            min=1,
            metavar="W",
            envvar="KVROUTER_SIM_WORKERS",
            show_envvar=True,
            help=r"Simulated engines, 2048 KV blocks of 512 tokens each. \[workers]",
            rich_help_panel=_WORKLOAD,
        ),
    ] = 4,
    speedup: Annotated[
        float,
        typer.Option(
            "--speedup",
            "-s",
            min=0.001,
            metavar="S",
            envvar="KVROUTER_SIM_SPEEDUP",
            show_envvar=True,
            help=r"Arrival-time divisor: a request arrives at timestamp / S. \[factor]",
            rich_help_panel=_WORKLOAD,
        ),
    ] = 2.0,
    policy: Annotated[
        str,
        typer.Option(
            "--policy",
            "-p",
            metavar="P[,P…]",
            envvar="KVROUTER_SIM_POLICY",
            show_envvar=True,
            help=f"Comma-separated routing policies, each run on the same requests: {', '.join(POLICIES)}.",
            rich_help_panel=_ROUTING,
        ),
    ] = DEFAULT_POLICIES,
    seed: Annotated[
        int,
        typer.Option(
            "--seed",
            metavar="N",
            envvar="KVROUTER_SIM_SEED",
            show_envvar=True,
            help="Seed of the run's random source (random policy, tie-breaks, sampling).",
            rich_help_panel=_ROUTING,
        ),
    ] = 0,
    event_lag_ms: Annotated[
        float,
        typer.Option(
            "--event-lag-ms",
            min=0.0,
            metavar="L",
            envvar="KVROUTER_SIM_EVENT_LAG_MS",
            show_envvar=True,
            help=r"Simulated delay before a KV event reaches the router's index. \[ms]",
            rich_help_panel=_ROUTING,
        ),
    ] = 0.0,
    prefix_sharing: Annotated[
        PrefixSharing,
        typer.Option(
            "--prefix-sharing",
            envvar="KVROUTER_SIM_PREFIX_SHARING",
            show_envvar=True,
            help="What a request admitted beside a running prefill of its prefix reuses: the blocks already "
            "scheduled (vLLM v1, Dynamo's mocker) or only those computed (SGLang).",
            rich_help_panel=_WORKLOAD,
        ),
    ] = PrefixSharing.scheduled,
    json_out: Annotated[
        Path | None,
        typer.Option(
            "--json",
            metavar="FILE",
            dir_okay=False,
            help="Also write the rows as JSON to FILE.",
            rich_help_panel=_OUTPUT,
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="FILE.png",
            dir_okay=False,
            help="Also draw TTFT distributions and hit rates to FILE.png (needs the 'plot' extra: matplotlib).",
            rich_help_panel=_OUTPUT,
        ),
    ] = None,
) -> None:
    """Replay a trace through simulated engines under each routing policy and compare them.

    Prints hit rate (xRR: over round robin's; ceiling: share of the pooled-LRU ceiling), TTFT
    percentiles, ITL, uncached-prefill imbalance (max / mean over workers) and the policy's
    decision time per request.
    """
    names = parse_policies(policy)
    if plot is not None:
        _check_plotting()
    loaded = _load(trace, workload, workload_option or [], write_trace, speedup=speedup, limit=limit)
    if loaded.skipped:
        first_line, first_reason = loaded.skipped[0]
        typer.echo(
            f"warning: skipped {len(loaded.skipped)} bad line(s) of {loaded.name}; first: line {first_line}: "
            f"{first_reason}",
            err=True,
        )
    if not loaded.requests:
        raise typer.BadParameter(f"{loaded.name} has no usable request", param_hint="--trace")
    ceiling = pooled_lru_ceiling(loaded.requests, workers=workers)
    rows: list[ReportRow] = []
    for name in names:
        started = perf_counter()
        result = run_simulation(
            loaded.requests,
            workers=workers,
            policy=make_policy(name, seed=seed),
            seed=seed,
            event_lag_ms=event_lag_ms,
            prefix_sharing=prefix_sharing.value,
        )
        log.info("policy simulated policy=%s secs=%.2f", name, perf_counter() - started)
        rows.append(
            row_from_result(result, trace=loaded.name, workers=workers, speedup=speedup, policy=name, ceiling=ceiling)
        )
    title = (
        f"{loaded.name}: {len(loaded.requests)} requests, {workers} workers, arrivals x{speedup:g}, "
        f"seed {seed}, event lag {event_lag_ms:g} ms, prefix sharing {prefix_sharing.value}; "
        f"pooled-LRU ceiling {ceiling:.3f}"
    )
    console = Console()
    if console.is_terminal:
        console.print(rich_table(rows, title=title))
    else:
        typer.echo(title)
        typer.echo(format_table(rows))
    if json_out is not None:
        write_json(rows, json_out, seed=seed, event_lag_ms=event_lag_ms, requests=len(loaded.requests))
        typer.echo(f"wrote {json_out}")
    if plot is not None:
        from ..sim.report import write_plot

        write_plot(rows, plot, title=title)
        typer.echo(f"wrote {plot}")


def _load(
    trace: Path | None,
    workload: str | None,
    options: list[str],
    write_trace: Path | None,
    *,
    speedup: float,
    limit: int | None,
) -> Trace:
    """The requests to replay: a file, a generated workload (written out if asked), or the sample."""
    if workload is None:
        for given, flag in ((options, "--workload-option"), (write_trace, "--write-trace")):
            if given:
                raise typer.BadParameter("needs --workload", param_hint=flag)
        return load_trace(trace, speedup=speedup, limit=limit) if trace else load_sample(speedup=speedup, limit=limit)
    if trace is not None:
        raise typer.BadParameter("give --trace or --workload, not both", param_hint="--workload")
    if workload not in WORKLOADS:
        raise typer.BadParameter(
            f"unknown workload {workload!r}; choose from: {', '.join(WORKLOADS)}", param_hint="--workload"
        )
    try:
        parsed = parse_workload_options(workload, options)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--workload-option") from None
    generated = generate(workload, parsed, speedup=speedup, limit=limit, write_to=write_trace)
    if write_trace is not None:
        typer.echo(f"wrote {write_trace}")
    return generated


def _check_plotting() -> None:
    """Fail before the runs, not after them, when ``--plot`` cannot work."""
    if find_spec("matplotlib") is None:
        raise typer.BadParameter(
            "needs matplotlib, which is not installed: pip install 'kvrouter[plot]'", param_hint="--plot"
        )
