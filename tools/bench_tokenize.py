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

Not measured here (left for later): the requests per second of the whole ``/v1/chat/completions`` routing
path beside the reference's ``select_service``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Final

from kvrouter.chat import DEMO_MODEL, ChatModel, checked_messages
from kvrouter.demo.workload import vocabulary

HEADLINE: Final = (41, 50)
"""The turns the headline ratio is the median over (1-based, inclusive)."""


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
    messages = checked_messages([{"role": "system", "content": "You answer questions about routing."}])
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
        if ours != whole:
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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=100_000, help="the conversation's size at its last turn")
    parser.add_argument("--repeats", type=int, default=5, help="conversations (each its own seed)")
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
    print(f"load average {[round(x, 2) for x in load_before]} before, {[round(x, 2) for x in os.getloadavg()]} "
          f"after; python {sys.version.split()[0]}; {args.repeats} conversations of {args.turns} turns")  # fmt: skip
    if args.json is not None:
        document = {
            "turns": turns,
            "summary": summary,
            "headline_turns": [first, last],
            "ratios": {"incremental": round(ratio, 3), "incremental_encode": round(encode_ratio, 3)},
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
