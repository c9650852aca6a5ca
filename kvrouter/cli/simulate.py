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
from collections.abc import Collection
from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path
from time import perf_counter
from typing import Annotated, Final

import typer
from rich.console import Console

from ..routing.disagg import DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_MAX_LOCAL_PREFILL_TOKENS, Link
from ..sim.ceiling import pooled_lru_ceiling
from ..sim.disagg import DEFAULT_OVERHEAD_MS, simulate_disagg
from ..sim.policies import POLICIES, make_policy
from ..sim.policies.disagg import DISAGG_POLICIES, make_disagg_policy
from ..sim.report import ReportRow, format_table, rich_table, row_from_disagg, row_from_result, write_json
from ..sim.simulator import simulate as run_simulation
from ..sim.trace import SAMPLE_NAME, Trace, load_sample, load_trace
from ..sim.workloads import WORKLOADS, generate, parse_workload_options

__all__ = ["parse_policies", "simulate"]

log = logging.getLogger(__name__)

DEFAULT_POLICIES: Final = "round_robin,dynamo_t0,kvrouter"
"""The baseline, the reference's cost and the project's router: the comparison §7 is about."""
DEFAULT_DISAGG_POLICIES: Final = "kvrouter_disagg,kvrouter_always_split,dynamo_disagg,random_pairs,kvrouter"
"""With ``--prefill-workers``: the disaggregated policies, and ``kvrouter`` on as many aggregated workers."""

_WORKLOAD: Final = "Workload"


class PrefixSharing(enum.StrEnum):
    """``WorkerConfig.prefix_sharing``'s choices, as typer lists them."""

    scheduled = "scheduled"
    computed = "computed"


_ROUTING: Final = "Routing"
_DISAGG: Final = "Disaggregated (--prefill-workers P --decode-workers D)"
_OUTPUT: Final = "Output"

EPILOG: Final = (
    "Examples:\n\n"
    "  kvrouter simulate                                   # packaged sample, 4 workers, x2\n\n"
    "  kvrouter simulate --policy round_robin,kvrouter --workers 8 --speedup 4 --plot c8.png\n\n"
    "  kvrouter simulate --trace conversation_trace.jsonl --json results.json --event-lag-ms 50\n\n"
    "  kvrouter simulate --workload fanout --workers 8 --speedup 15 -o seed=3 -o group_max=12\n\n"
    "  kvrouter simulate --prefill-workers 4 --decode-workers 4 --speedup 4   # disaggregated against aggregated"
)


def parse_policies(value: str, known: Collection[str] = tuple(POLICIES)) -> list[str]:
    """Policy names from ``"a,b , c"``: stripped, in order, each once.

    Raises:
        typer.BadParameter: an empty list or a name not in ``known`` (the message lists them).
    """
    names = list(dict.fromkeys(part.strip() for part in value.split(",") if part.strip()))
    if not names:
        raise typer.BadParameter(f"no policy given; choose from: {', '.join(known)}", param_hint="--policy")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise typer.BadParameter(
            f"unknown policy {', '.join(repr(n) for n in unknown)}; choose from: {', '.join(known)}",
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
        str | None,
        typer.Option(
            "--policy",
            "-p",
            metavar="P[,P…]",
            envvar="KVROUTER_SIM_POLICY",
            show_envvar=True,
            help=f"Comma-separated routing policies, each run on the same requests: {', '.join(POLICIES)}; "
            f"with --prefill-workers also {', '.join(DISAGG_POLICIES)} (the aggregated ones then run on P+D "
            "workers).",
            show_default=f"{DEFAULT_POLICIES}; disaggregated: {DEFAULT_DISAGG_POLICIES}",
            rich_help_panel=_ROUTING,
        ),
    ] = None,
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
    prefill_workers: Annotated[
        int | None,
        typer.Option(
            "--prefill-workers",
            min=1,
            metavar="P",
            envvar="KVROUTER_SIM_PREFILL_WORKERS",
            show_envvar=True,
            help="Simulate a disaggregated fleet of P prefill workers and --decode-workers D (replaces --workers).",
            show_default="aggregated",
            rich_help_panel=_DISAGG,
        ),
    ] = None,
    decode_workers: Annotated[
        int | None,
        typer.Option(
            "--decode-workers",
            min=1,
            metavar="D",
            envvar="KVROUTER_SIM_DECODE_WORKERS",
            show_envvar=True,
            help="The disaggregated fleet's decode workers.",
            show_default="aggregated",
            rich_help_panel=_DISAGG,
        ),
    ] = None,
    domains: Annotated[
        int,
        typer.Option(
            "--domains",
            metavar="N",
            envvar="KVROUTER_SIM_DOMAINS",
            show_envvar=True,
            min=1,
            help="Topology domains each pool is spread over in turn; a transfer across two is a slow one.",
            rich_help_panel=_DISAGG,
        ),
    ] = 1,
    kv_bytes_per_token: Annotated[
        int,
        typer.Option(
            "--kv-bytes-per-token",
            metavar="B",
            envvar="KVROUTER_SIM_KV_BYTES_PER_TOKEN",
            show_envvar=True,
            min=1,
            help=r"KV bytes a token's cache takes (Llama-3-8B-like: 32 x 8 x 128 x 2 x 2). \[bytes]",
            rich_help_panel=_DISAGG,
        ),
    ] = DEFAULT_KV_BYTES_PER_TOKEN,
    kv_transfer_gbps: Annotated[
        float,
        typer.Option(
            "--kv-transfer-gbps",
            metavar="G",
            envvar="KVROUTER_SIM_KV_TRANSFER_GBPS",
            show_envvar=True,
            min=0.001,
            help=r"Transfer bandwidth between domains. \[Gbit/s]",
            rich_help_panel=_DISAGG,
        ),
    ] = 25.0,
    kv_transfer_gbps_local: Annotated[
        float,
        typer.Option(
            "--kv-transfer-gbps-local",
            metavar="G",
            envvar="KVROUTER_SIM_KV_TRANSFER_GBPS_LOCAL",
            show_envvar=True,
            min=0.001,
            help=r"Transfer bandwidth inside one domain. \[Gbit/s]",
            rich_help_panel=_DISAGG,
        ),
    ] = 200.0,
    transfer_overhead_ms: Annotated[
        float,
        typer.Option(
            "--transfer-overhead-ms",
            metavar="MS",
            envvar="KVROUTER_SIM_TRANSFER_OVERHEAD_MS",
            show_envvar=True,
            min=0.0,
            help=r"A transfer's fixed cost, before its bytes (an assumption: handshake and round trips). \[ms]",
            rich_help_panel=_DISAGG,
        ),
    ] = DEFAULT_OVERHEAD_MS,
    max_local_prefill_tokens: Annotated[
        int,
        typer.Option(
            "--disagg-max-local-prefill-tokens",
            metavar="T",
            envvar="KVROUTER_SIM_DISAGG_MAX_LOCAL_PREFILL_TOKENS",
            show_envvar=True,
            min=0,
            help=r"kvrouter_disagg: the decode worker prefills a prompt it lacks at most this much of. \[tokens]",
            rich_help_panel=_DISAGG,
        ),
    ] = DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    prefill_busy_tokens: Annotated[
        int | None,
        typer.Option(
            "--disagg-prefill-busy-tokens",
            metavar="T",
            envvar="KVROUTER_SIM_DISAGG_PREFILL_BUSY_TOKENS",
            show_envvar=True,
            min=0,
            help=r"kvrouter_disagg: prefill locally when every prefill worker has more queued. \[tokens]",
            show_default="off",
            rich_help_panel=_DISAGG,
        ),
    ] = None,
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
    pools: tuple[int, int] | None = None
    if prefill_workers is not None or decode_workers is not None:
        if prefill_workers is None or decode_workers is None:
            raise typer.BadParameter(
                "give --prefill-workers and --decode-workers together", param_hint="--prefill-workers"
            )
        pools = (prefill_workers, decode_workers)
    if pools is not None:
        names = parse_policies(policy or DEFAULT_DISAGG_POLICIES, (*DISAGG_POLICIES, *POLICIES))
    else:
        names = parse_policies(policy or DEFAULT_POLICIES)
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
    if pools is not None:
        workers = sum(pools)
    ceiling = pooled_lru_ceiling(loaded.requests, workers=workers)
    link = Link(kv_bytes_per_token, kv_transfer_gbps, kv_transfer_gbps_local, transfer_overhead_ms)
    rows: list[ReportRow] = []
    for name in names:
        started = perf_counter()
        if pools is not None and name in DISAGG_POLICIES:
            options: dict[str, int | None] = {}
            if name == "kvrouter_disagg":
                options = {
                    "max_local_prefill_tokens": max_local_prefill_tokens,
                    "prefill_busy_tokens": prefill_busy_tokens,
                }
            outcome = simulate_disagg(
                loaded.requests,
                prefill_workers=pools[0],
                decode_workers=pools[1],
                policy=make_disagg_policy(name, seed=seed, **options),
                link=link,
                domains=domains,
                seed=seed,
                event_lag_ms=event_lag_ms,
                prefix_sharing=prefix_sharing.value,
            )
            rows.append(row_from_disagg(outcome, trace=loaded.name, speedup=speedup, ceiling=ceiling))
        else:
            result = run_simulation(
                loaded.requests,
                workers=workers,
                policy=make_policy(name, seed=seed),
                seed=seed,
                event_lag_ms=event_lag_ms,
                prefix_sharing=prefix_sharing.value,
            )
            row = row_from_result(
                result, trace=loaded.name, workers=workers, speedup=speedup, policy=name, ceiling=ceiling
            )
            rows.append(row if pools is not None else replace(row, itl_p90_ms=None))
        log.info("policy simulated policy=%s secs=%.2f", name, perf_counter() - started)
    fleet = f"{pools[0]}P+{pools[1]}D against {workers} aggregated" if pools is not None else f"{workers}"
    title = (
        f"{loaded.name}: {len(loaded.requests)} requests, {fleet} workers, arrivals x{speedup:g}, "
        f"seed {seed}, event lag {event_lag_ms:g} ms, prefix sharing {prefix_sharing.value}; "
        f"pooled-LRU ceiling {ceiling:.3f}"
    )
    if pools is not None:
        title += (
            f"; transfers {kv_bytes_per_token} B/token at {kv_transfer_gbps_local:g} Gbit/s in a domain, "
            f"{kv_transfer_gbps:g} across ({domains} domains), +{transfer_overhead_ms:g} ms each"
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
