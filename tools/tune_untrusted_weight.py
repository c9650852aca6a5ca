"""The default of ``--router-untrusted-overlap-weight``, measured: routing quality while a worker's history is lost.

    python tools/tune_untrusted_weight.py [--weights 1,0.5,0] [--seeds 0,1,2] [--requests 400] [--speed 4]
        [--drop 30] [--skip 0] [--mock-workers 4] [--json FILE]

Issue 15 item 2 asks for the option to stay off unless the replay drills show it helps. This runs that drill
with each weight and prints the routing quality of each. There is no reference column: the reference has
no trust state, so it routes as weight 1 does, and weight 1 is this tool's "without".

**The drill.** ``kvrouter replay``'s stack (``kvrouter.replay.stack.LocalStack``: ``kvrouter up`` with two
shards and ``--mock-workers`` vLLM-format mock engines). The engines are registered without their replay
endpoint, as vLLM runs unless ``replay_endpoint`` is set. A gap is then lost, not recovered, and the victim
stays ``partial`` for the rest of the run: its index keeps blocks that the engine evicted in the lost
batches and misses blocks that it stored then, along with their descendants. A third into the workload the
victim drops ``--drop`` event batches on the wire (``POST /faults``); the replay gap drill drops 3, and this
drill drops more, so the lost history spans several seconds of evictions.

**The runs.** For each seed (it picks the victim and the probe prompts), every weight gets one run, and the
order of the weights rotates from seed to seed. Before each run the router is restarted with
``KVROUTER_ROUTER_UNTRUSTED_OVERLAP_WEIGHT`` set, and every engine restarts empty (the replay reset). The
figures cover the requests sent after the fault: the hit rate (the cached tokens the engines reported over
the prompt tokens), TTFT p50 and p90 from the mock engines, the victim's share of those requests, and the
probes' wrong answers. For each weight the tool reports the median over the seeds. Each seed's hit rate
is also printed as the difference from weight 1 on the same seed, so the noise of one run's timing can be
seen beside the effect.

``--json FILE`` writes every run, the medians, and ``ratios``: the hit rate of each weight over weight 1's
(above 1, that weight routes better during the fault).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvrouter.replay.drills import Drill
from kvrouter.replay.run import RunResult, run
from kvrouter.replay.session import probe_prompts
from kvrouter.replay.stack import LocalStack, Mock, ReplayError, Stack, StackConfig
from kvrouter.replay.workload import requests_from_trace
from kvrouter.sim.trace import Trace, load_sample, load_trace

ENV = "KVROUTER_ROUTER_UNTRUSTED_OVERLAP_WEIGHT"
SETTLE_S = 3.0
"""After the load, how long a run waits for the index to equal the engines: it cannot (the history is lost),
and the 30 s a replay drill allows would only lengthen the tool."""


def lost_gap(batches: int) -> Drill:
    """A gap of ``batches`` on the victim that nothing can replay: seen when the router counts it lost."""

    async def inject(stack: Stack, victim: Mock) -> dict[str, Any]:
        status, answer = await stack.call("POST", victim.http + "/faults", {"drop_batches": batches})
        if status != 200:
            raise ReplayError(f"POST {victim.http}/faults answered {status}: {answer}")
        return {"worker": victim.worker_id, "dropped_batches": batches}

    def seen(_stack: Stack, victim: Mock, _done: dict[str, Any], before: Any, now: Any) -> bool:
        was = int(before.get(victim.worker_id, {}).get("gaps_lost", 0))
        return int(now.get(victim.worker_id, {}).get("gaps_lost", 0)) > was

    return Drill("lost-gap", needs_local=False, inject=inject, seen=seen)


def after_fault(result: RunResult, victim: Mock) -> dict[str, Any]:
    """The run's figures over the requests sent after the fault."""
    assert result.fault_at is not None
    done = [o for o in result.completed if o.sent >= result.fault_at]
    prompt = sum(o.prompt_tokens for o in done)
    ttfts = sorted(o.ttft_ms for o in done if o.ttft_ms is not None)
    cuts = statistics.quantiles(ttfts, n=10, method="inclusive") if len(ttfts) > 1 else [0.0] * 9
    on_victim = sum(o.worker.split(":")[0] == str(victim.worker_id) for o in done)
    return {
        "requests": len(done),
        "errors": result.errors,
        "hit_rate": round(sum(o.cached_tokens for o in done) / prompt, 4) if prompt else 0.0,
        "ttft_p50_ms": round(cuts[4], 1),
        "ttft_p90_ms": round(cuts[8], 1),
        "victim_share": round(on_victim / len(done), 4) if done else 0.0,
        "wrong_answers": result.wrong_answers,
        "gaps": dict(result.gaps),
    }


async def measure(args: argparse.Namespace, trace: Trace) -> list[dict[str, Any]]:
    requests = requests_from_trace(trace, count=args.requests, speed=args.speed)
    stack = LocalStack(StackConfig(mock_workers=args.mock_workers, speedup_ratio=args.speed))
    drill = lost_gap(args.drop)
    runs: list[dict[str, Any]] = []
    try:
        await stack.start()
        # without their replay endpoints, as :func:`Stack.reset` registers the fleet again before every run
        stack.fleet = stack.mocks = [dataclasses.replace(m, replay=None) for m in stack.mocks]
        for turn, seed in enumerate(args.seeds):
            rng = random.Random(seed)
            prompts = probe_prompts(requests, rng)
            victim = rng.choice(stack.fleet)
            order = args.weights[turn % len(args.weights) :] + args.weights[: turn % len(args.weights)]
            for weight in order:
                os.environ[ENV] = repr(weight)
                await stack.restart_router()
                result = await run(stack, requests, prompts, drill, victim, converge_timeout=SETTLE_S)
                if not result.fault_seen:
                    raise ReplayError(f"seed {seed} weight {weight}: the router never counted the gap lost: {result.gaps}")
                row = {"seed": seed, "weight": weight, "victim": victim.worker_id, **after_fault(result, victim)}
                runs.append(row)
                print(json.dumps(row), flush=True)
    finally:
        os.environ.pop(ENV, None)
        await stack.close()
    return runs


def summarise(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    base = {r["seed"]: r["hit_rate"] for r in runs if r["weight"] == 1.0}
    rows = {}
    for weight in args.weights:
        mine = [r for r in runs if r["weight"] == weight]
        rows[repr(weight)] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "victim_share", "wrong_answers")
        } | {"hit_rate_vs_weight_1": [round(r["hit_rate"] - base.get(r["seed"], 0.0), 4) for r in mine]}
    off = rows.get("1.0", {}).get("hit_rate")
    ratios = {f"hit_rate_weight_{w}": round(row["hit_rate"] / off, 4) for w, row in rows.items() if off}
    return {"weights": rows, "ratios": ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 0.5, 0.0])
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--speed", type=float, default=4.0)
    parser.add_argument("--drop", type=int, default=30, help="event batches the victim drops")
    parser.add_argument("--skip", type=int, default=0, help="start this many requests into the trace")
    parser.add_argument("--trace", type=Path, default=None, help="Mooncake JSONL (default: the packaged sample)")
    parser.add_argument("--mock-workers", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if 1.0 not in args.weights:
        parser.error("--weights must include 1 (the option off), the yardstick")
    trace = load_trace(args.trace) if args.trace else load_sample()
    trace = dataclasses.replace(trace, requests=trace.requests[args.skip :])
    started = time.monotonic()
    runs = asyncio.run(measure(args, trace))
    summary = summarise(args, runs)
    head = ("weight", "hit rate", "ttft p50", "ttft p90", "victim", "wrong")
    print("\n{:>7} {:>9} {:>9} {:>9} {:>7} {:>6}  hit - w1 by seed".format(*head))
    for weight, row in summary["weights"].items():
        print(
            f"{weight:>7} {row['hit_rate']:>9.4f} {row['ttft_p50_ms']:>9.1f} {row['ttft_p90_ms']:>9.1f} "
            f"{row['victim_share']:>7.3f} {row['wrong_answers']:>6.0f}  {row['hit_rate_vs_weight_1']}"
        )
    print(f"medians over seeds {args.seeds}; {time.monotonic() - started:.0f} s; ratios {summary['ratios']}")
    if args.json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"config": config, "runs": runs, **summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
