"""A growing conversation tokenized turn after turn: kvrouter's prefix reuse against a full encode per turn.

    python tools/bench_tokenize.py [--turns 50] [--tokens 100000] [--repeats 5] [--json FILE]

A chat router renders and tokenizes every request, and a conversation resends its whole history each turn
(issue 36, item 3). The workload: one conversation of ``--turns`` turns (a user message and an answer each)
growing to about ``--tokens`` tokens, its text words of the packaged demo model's vocabulary, rendered with
its ChatML template and tokenized with its tokenizer (``kvrouter/chat/demo_model``). Each turn is timed both
ways, interleaved, as a router meets it (render, then tokens):

- **kvrouter**: ``ChatModel.prompt_ids``, which reuses the conversation's earlier turns
  (``kvrouter/chat/prefixes.py``);
- **full**: the same rendering, then one ``tokenizers`` encode of the whole prompt, as a router without the
  cache does (Dynamo's frontend tokenizes each request whole).

Both answers are compared token for token at every turn. The figures: per turn, the median over
``--repeats`` conversations of each way's milliseconds; p50 and p99 over turns; and ``ratios.incremental``,
full ÷ kvrouter, the median over turns 41-50 (the goal: at least 10), with the render alone and the encode
alone beside it. ``--json FILE`` writes them. Say what else ran on the machine: the numbers are single-core.

**The routing path** (report-only, ``--route-seconds``, 0 skips it): requests per second of kvrouter's whole
``/v1/chat/completions`` path over HTTP (parse, check, render, tokenize with the conversation cache, route,
book, forward, relay, free), beside ``python -m dynamo.select_service`` (ai-dynamo-runtime, its 4 threads)
answering ``/select`` for the same prompts as token ids: what a reference deployment's router does once
something else has tokenized. The bodies: every turn of one conversation of the run's shape (a chat body
for kvrouter, its rendered token ids for the reference), cycled by ``wrk`` at ``--route-connections``.
Neither side is sent KV events, so both decide on an empty index; kvrouter's engines are one stub that
answers every request at once (``bench_service.py``'s ``_floor``), so the engine's time is not in it.
kvrouter runs ``--route-fronts`` fronts (one per core by default, as an operator would run it, and as the
reference's threads use every core) and one shard (``tools/bench_service.py``'s ``_serve``, with the demo
model's files at a 1M-token context, so that the last turns fit). The two alternate for ``--route-rounds`` rounds of
``--route-seconds``; the figure is the median over rounds of kvrouter ÷ reference, ``ratios.chat_route``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

from bench_service import (  # this file's folder: the first of sys.path when run as a script
    LUA,
    START_TIMEOUT,
    Publishers,
    Server,
    register,
    run_wrk,
    start_kvrouter,
    start_reference,
    stop,
    tail,
    wait_http,
)

from kvrouter.chat import DEMO_MODEL, ChatModel, checked_messages
from kvrouter.demo.workload import vocabulary

HEADLINE: Final = (41, 50)
"""The turns the headline ratio is the median over (1-based, inclusive)."""
ROUTE_WORKERS: Final = 8
ROUTE_CONTEXT: Final = 1 << 20
"""The bench's copy of the demo model's context: 100k-token turns must fit (the shipped one says 32k)."""
SYSTEM: Final = "You answer questions about routing."


def conversation(model: ChatModel, turns: int, tokens: int, seed: int) -> list[tuple[str, str]]:
    """``turns`` (question, answer) pairs of about ``tokens / (2 * turns)`` tokens each (words per token
    measured on a sample first)."""
    rng = random.Random(seed)
    words = vocabulary()
    sample = rng.choices(words, k=1000)
    per_word = len(model.encode(" ".join(sample))) / len(sample)
    per = max(1, round(tokens / (2 * turns) / per_word))
    return [(" ".join(rng.choices(words, k=per)), " ".join(rng.choices(words, k=per))) for _ in range(turns)]


def run(turns: int, tokens: int, seed: int) -> list[dict[str, float]]:
    """One conversation, turn after turn, both ways; per turn the milliseconds and the prompt's tokens."""
    model = ChatModel.from_directory("demo", DEMO_MODEL)  # a cold cache, as a fresh conversation meets it
    messages = checked_messages([{"role": "system", "content": SYSTEM}])
    out: list[dict[str, float]] = []
    for question, answer in conversation(model, turns, tokens, seed):
        messages.append({"role": "user", "content": question})
        started = time.perf_counter()
        ours = model.prompt_ids(messages)
        incremental = time.perf_counter() - started
        started = time.perf_counter()
        text = model.render(messages)
        rendered = time.perf_counter() - started
        started = time.perf_counter()
        whole = model.encode(text)
        encoded = time.perf_counter() - started
        if ours.tolist() != whole:
            raise SystemExit(f"bench_tokenize: turn {len(out) + 1}: the reused tokens differ from a full encode")
        out.append(
            {
                "kvrouter_ms": incremental * 1e3,
                "full_ms": (rendered + encoded) * 1e3,
                "render_ms": rendered * 1e3,
                "encode_ms": encoded * 1e3,
                "prompt_tokens": float(len(whole)),
            }
        )
        messages.append({"role": "assistant", "content": answer})
    return out


def route_rates(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The report-only second line (module docstring): chat requests/s through kvrouter, /select through the
    reference, the same prompts, alternated rounds."""
    model_dir = folder / "model"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL / name, model_dir / name)
    (model_dir / "config.json").write_text(json.dumps({"max_position_embeddings": ROUTE_CONTEXT}))
    model = ChatModel.from_directory("demo", DEMO_MODEL)
    chats, selects = [], []
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for question, answer in conversation(model, args.turns, args.tokens, seed=0):
        messages.append({"role": "user", "content": question})
        ids = model.encode(model.render(checked_messages(messages)))
        chats.append(json.dumps({"model": "demo", "messages": messages, "max_tokens": 1}))
        selects.append(json.dumps({"model_name": "demo", "token_ids": ids}))
        messages.append({"role": "assistant", "content": answer})
    scripts = {}
    for side, path, bodies in (("kvrouter", "/v1/chat/completions", chats), ("reference", "/select", selects)):
        (folder / f"{side}.jsonl").write_text("\n".join(bodies) + "\n")
        scripts[side] = folder / f"{side}.lua"
        scripts[side].write_text(LUA % {"bodies": folder / f"{side}.jsonl", "path": path})
    publishers = Publishers(ROUTE_WORKERS)
    started: list[Server] = []
    try:
        engine = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("bench_service.py")), "_floor", "--port", "0"],
            stdout=subprocess.PIPE,
        )
        assert engine.stdout is not None
        port = engine.stdout.readline().decode().strip()  # bound by the stub itself: no other process takes it
        stub = Server("engine", f"http://127.0.0.1:{port}", engine, Path(os.devnull))
        started.append(stub)
        wait_http(stub, "/health", START_TIMEOUT)
        kvrouter = start_kvrouter(folder, args.route_fronts, model_paths=[f"demo={model_dir}"])
        started.append(kvrouter)
        reference = start_reference(folder)
        started.append(reference)
        register(kvrouter, publishers.endpoints, "demo", stub.url)
        register(reference, publishers.endpoints, "demo")
        publishers.wait_subscribed(2, START_TIMEOUT)
        sides = {"kvrouter": kvrouter, "reference": reference}
        for side, server in sides.items():  # warm: kernels, the conversation cache, connections
            run_wrk(server, scripts[side], args.route_connections, 2.0)
        points: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        for round_ in range(args.route_rounds):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            for side in order:
                points[side].append(run_wrk(sides[side], scripts[side], args.route_connections, args.route_seconds))
    finally:
        for server in reversed(started):
            code = stop(server)
            if server.name == "kvrouter" and code != 0:
                print(f"bench_tokenize: kvrouter exited {code}: {tail(server.log)}", file=sys.stderr)
        if started and started[0].process.stdout is not None:
            started[0].process.stdout.close()
        publishers.close()
    errors = {side: sum(p["errors"] for p in rounds) for side, rounds in points.items()}
    if any(errors.values()):
        raise SystemExit(f"bench_tokenize: route: requests failed {errors}")
    ratio = statistics.median(k["rps"] / r["rps"] for k, r in zip(points["kvrouter"], points["reference"], strict=True))
    return {
        "connections": args.route_connections,
        "fronts": args.route_fronts,
        "rounds": args.route_rounds,
        "seconds": args.route_seconds,
        "kvrouter_chat_rps": round(statistics.median(p["rps"] for p in points["kvrouter"]), 1),
        "reference_select_rps": round(statistics.median(p["rps"] for p in points["reference"]), 1),
        "kvrouter_server_cpu_us": round(statistics.median(p["server_cpu_us"] for p in points["kvrouter"])),
        "reference_server_cpu_us": round(statistics.median(p["server_cpu_us"] for p in points["reference"])),
        "ratio": round(ratio, 3),
        "points": points,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=100_000, help="the conversation's size at its last turn")
    parser.add_argument("--repeats", type=int, default=5, help="conversations (each its own seed)")
    parser.add_argument("--route-seconds", type=float, default=5.0, help="per routing-path point; 0: skip it")
    parser.add_argument("--route-rounds", type=int, default=3)
    parser.add_argument("--route-connections", type=int, default=8)
    parser.add_argument("--route-fronts", type=int, default=os.cpu_count() or 1, help="kvrouter's front processes")
    parser.add_argument("--json", type=Path, metavar="FILE")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    runs = [run(args.turns, args.tokens, seed) for seed in range(args.repeats)]
    turns = [{key: statistics.median(r[i][key] for r in runs) for key in runs[0][i]} for i in range(args.turns)]
    first, last = HEADLINE if args.turns >= HEADLINE[1] else (max(1, args.turns - 9), args.turns)
    window = turns[first - 1 : last]
    ratio = statistics.median(t["full_ms"] / t["kvrouter_ms"] for t in window)
    encode_ratio = statistics.median(t["encode_ms"] / max(t["kvrouter_ms"] - t["render_ms"], 1e-6) for t in window)
    summary: dict[str, Any] = {}
    print("turn  tokens  kvrouter ms  full ms  (render ms  encode ms)")
    for i, t in enumerate(turns, 1):
        if i in (1, 10, 20, 30, 40, 45, 50) or i == args.turns:
            print(f"{i:4d} {t['prompt_tokens']:7.0f} {t['kvrouter_ms']:12.2f} {t['full_ms']:8.2f}"
                  f"  ({t['render_ms']:.2f}  {t['encode_ms']:.2f})")  # fmt: skip
    for way in ("kvrouter", "full"):
        values = [t[f"{way}_ms"] for t in turns]
        summary[way] = {"p50_ms": round(percentile(values, 50), 3), "p99_ms": round(percentile(values, 99), 3)}
        print(f"{way:>8}: per turn p50 {summary[way]['p50_ms']:.2f} ms, p99 {summary[way]['p99_ms']:.2f} ms")
    print(f"incremental: full / kvrouter, median over turns {first}-{last}: {ratio:.1f}x "
          f"(the encode alone against kvrouter's time past the render: {encode_ratio:.1f}x)")  # fmt: skip
    route = None
    if args.route_seconds > 0:
        with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as folder:
            route = route_rates(args, Path(folder))
        print(f"routing path (report only): kvrouter /v1/chat/completions {route['kvrouter_chat_rps']:.0f} req/s "
              f"({route['kvrouter_server_cpu_us']} µs CPU each), the reference's select_service /select "
              f"{route['reference_select_rps']:.0f} req/s ({route['reference_server_cpu_us']} µs), same prompts "
              f"as token ids: {route['ratio']:.2f}x at {args.route_connections} connections, "
              f"{args.route_fronts} kvrouter fronts")  # fmt: skip
    print(f"load average {[round(x, 2) for x in load_before]} before, {[round(x, 2) for x in os.getloadavg()]} "
          f"after; python {sys.version.split()[0]}; {args.repeats} conversations of {args.turns} turns")  # fmt: skip
    if args.json is not None:
        document: dict[str, Any] = {
            "turns": turns,
            "summary": summary,
            "headline_turns": [first, last],
            "ratios": {"incremental": round(ratio, 3), "incremental_encode": round(encode_ratio, 3)},
        }
        if route is not None:
            document["route"] = route
            document["ratios"]["chat_route"] = route["ratio"]
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
