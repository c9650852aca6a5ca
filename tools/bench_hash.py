"""Time kvrouter's block hashing against Dynamo's in one process and print reference/kvrouter ratios.

    python tools/bench_hash.py [--repeat N] [--json FILE]

Rows: 1k, 4k and 32k-token prompts at block sizes 16 and 64, tokens given to kvrouter as a Python list
(the common case) and as a ``uint32`` ndarray. The reference, ``dynamo._core.compute_block_hash_for_seq``
(``ai-dynamo-runtime``, the ``anchors`` extra), always gets the list: its fastest input (given the
ndarray itself it is about 3x slower), so the ndarray rows show what a tokenizer's array saves against
the reference at its best. ``sequence_hashes`` has no reference binding; it is shown beside a pure-Python
``xxhash`` loop, labelled as such.

Each pair is timed in alternating batches so both sides share the machine's noise; a figure is the
median over ``--repeat`` batches of µs per prompt. A ratio above 1 means kvrouter is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from time import perf_counter_ns
from typing import Any, Final

import numpy as np
import xxhash

from kvrouter.hashing.blocks import XXH3_SEED, block_hashes
from kvrouter.hashing.chain import sequence_hashes

PROMPTS: Final = {"1k": 1024, "4k": 4096, "32k": 32768}
BLOCK_SIZES: Final = (16, 64)
CHAIN_BLOCKS: Final = (64, 512)
VOCAB: Final = 152064
"""Token ids are drawn below Qwen2's vocabulary size, as in the reference vectors (spec §1.4)."""
BATCH_NS: Final = 3_000_000
"""Target length of one timed batch: long enough to dwarf the timer, short enough to interleave often."""

Call = Callable[[], object]


def _reference() -> Callable[[list[int], int], list[int]]:
    """The reference hash function, imported only when the benchmark runs."""
    try:
        from dynamo._core import compute_block_hash_for_seq
    except ImportError as exc:
        raise SystemExit(
            "bench_hash: the reference `dynamo._core` is missing; install the anchors extra: "
            "pip install -e '.[anchors]' (ai-dynamo-runtime)"
        ) from exc
    return compute_block_hash_for_seq


def _python_chain(local: list[int]) -> list[int]:
    """The sequence-hash formula (spec §1.3) as a plain ``xxhash`` loop: the baseline for the chain."""
    out: list[int] = []
    for h in local:
        if out:
            h = xxhash.xxh3_64_intdigest(out[-1].to_bytes(8, "little") + h.to_bytes(8, "little"), XXH3_SEED)
        out.append(h)
    return out


def _once_ns(fn: Call) -> int:
    start = perf_counter_ns()
    fn()
    return perf_counter_ns() - start


def time_pair(ours: Call, theirs: Call, repeat: int) -> tuple[float, float]:
    """Median µs per call of each, from ``repeat`` batches apiece, alternating which side goes first."""
    for fn in (ours, theirs):  # warm-up: JIT compile, caches, allocator
        for _ in range(3):
            fn()
    number = max(1, BATCH_NS // max(_once_ns(ours), _once_ns(theirs), 1))
    samples: tuple[list[float], list[float]] = ([], [])
    for r in range(repeat):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for side in order:
            fn = (ours, theirs)[side]
            start = perf_counter_ns()
            for _ in range(number):
                fn()
            samples[side].append((perf_counter_ns() - start) / number / 1000)
    return statistics.median(samples[0]), statistics.median(samples[1])


def run(repeat: int) -> dict[str, Any]:
    """Every row: ``{key: {kvrouter_us, reference_us, reference}}`` plus the ``ratios``."""
    reference = _reference()
    rng = random.Random(0)
    rows: dict[str, dict[str, Any]] = {}
    for label, size in PROMPTS.items():
        tokens = [rng.randrange(VOCAB) for _ in range(size)]
        array = np.array(tokens, dtype=np.uint32)
        for block_size in BLOCK_SIZES:
            expected = reference(tokens, block_size)
            for kind, given in (("list", tokens), ("ndarray", array)):
                if block_hashes(given, block_size) != expected:
                    raise SystemExit(f"bench_hash: {kind} {label} B={block_size} differs from the reference")
                ours, theirs = time_pair(
                    partial(block_hashes, given, block_size), partial(reference, tokens, block_size), repeat
                )
                rows[f"{kind}_{label}_b{block_size}"] = {
                    "kvrouter_us": ours,
                    "reference_us": theirs,
                    "reference": "dynamo compute_block_hash_for_seq (list)",
                }
    for blocks in CHAIN_BLOCKS:
        local = [rng.getrandbits(64) for _ in range(blocks)]
        if sequence_hashes(local) != _python_chain(local):
            raise SystemExit(f"bench_hash: sequence_hashes over {blocks} blocks differs from the formula")
        ours, theirs = time_pair(partial(sequence_hashes, local), partial(_python_chain, local), repeat)
        rows[f"chain_{blocks}"] = {
            "kvrouter_us": ours,
            "reference_us": theirs,
            "reference": "python xxhash loop (no reference binding)",
        }
    ratios = {key: row["reference_us"] / row["kvrouter_us"] for key, row in rows.items()}
    return {"rows": rows, "ratios": ratios}


def _machine() -> dict[str, Any]:
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "cpu_count": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=15, help="timed batches per side and row (median)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    args = parser.parse_args(argv)
    before = _machine()
    result = run(args.repeat)
    after = _machine()
    print(f"{'case':<18} {'kvrouter µs':>12} {'reference µs':>13} {'ratio':>7}  reference")
    for key, row in result["rows"].items():
        ratio = result["ratios"][key]
        print(f"{key:<18} {row['kvrouter_us']:>12.2f} {row['reference_us']:>13.2f} {ratio:>7.2f}  {row['reference']}")
    print(
        f"machine: {after['cpu_count']} CPUs; load average (1/5/15 min) {before['loadavg']} before, "
        f"{after['loadavg']} after; python {sys.version.split()[0]}; median of {args.repeat} batches"
    )
    if args.json:
        figures = {"repeat": args.repeat, "machine": {"before": before, "after": after}, **result}
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
