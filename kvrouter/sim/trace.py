"""Mooncake-format traces as simulator requests: one JSON object per line, validated line by line.

A trace line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}``
(kvcache-ai/Mooncake ``FAST25-release/README.md``; ``spec/routing-benchmark.md`` §1). One hash id names one
512-token block and ids are chained, so the request's cacheable prefix is its first ``input_length // 512``
ids; the last id usually names a partial block, which no engine caches and the router never sees.

A bad line does not end the load: it is logged once with its line number, kept in ``Trace.skipped`` as
``(line_number, reason)`` and left out, so a hand-edited or truncated trace still replays and the caller
can decide whether the losses matter. The alternative, failing on the first bad line, would make a
10,000-line replay hostage to one stray comma and would hide how many other lines are bad.

The packaged sample (``kvrouter/sim/data/``, its README gives source, licence and sha256) is the first
2,000 requests of the conversation trace, so ``kvrouter simulate`` runs without a checkout of ``shared/``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Final

from .policy import Request

__all__ = [
    "SAMPLE_NAME",
    "SAMPLE_REQUESTS",
    "TRACE_BLOCK_SIZE",
    "Trace",
    "load_sample",
    "load_trace",
    "parse_trace",
]

log = logging.getLogger(__name__)

TRACE_BLOCK_SIZE: Final = 512
"""Tokens per ``hash_id`` in the Mooncake traces (their README: "The block size is 512 tokens")."""

SAMPLE_NAME: Final = "mooncake_conversation_2000.jsonl"
"""The packaged sample, a file of ``kvrouter/sim/data/``."""

SAMPLE_REQUESTS: Final = 2000
"""Requests in the packaged sample (pinned by tests/sim/test_trace.py::test_sample_loads_every_request)."""

_FIELDS: Final = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, slots=True)
class Trace:
    """The requests a trace file yields, and the lines it had to skip."""

    name: str
    """The file's name, for reports (``mooncake_fast25_conversation_trace.jsonl``)."""
    requests: tuple[Request, ...]
    """In file order, which is arrival order in the Mooncake traces."""
    skipped: tuple[tuple[int, str], ...]
    """``(line_number, reason)`` per bad line, line numbers counted from 1."""

    def __len__(self) -> int:
        return len(self.requests)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _problem(record: Any, block_size: int) -> str | None:
    """Why ``record`` is not a trace request, or None when it is one."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    missing = [name for name in _FIELDS if name not in record]
    if missing:
        return f"missing field {', '.join(repr(m) for m in missing)}"
    timestamp = record["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or not math.isfinite(timestamp):
        return f"'timestamp' must be a number of milliseconds, got {timestamp!r}"
    if timestamp < 0:
        return f"'timestamp' must be >= 0, got {timestamp!r}"
    for name in ("input_length", "output_length"):
        value = record[name]
        if not _is_int(value):
            return f"{name!r} must be an integer number of tokens, got {value!r}"
        if value < 0:
            return f"{name!r} must be >= 0, got {value!r}"
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list):
        return f"'hash_ids' must be a list of integers, got {type(hash_ids).__name__}"
    for position, value in enumerate(hash_ids):
        if not _is_int(value) or value < 0:
            return f"'hash_ids[{position}]' must be an integer >= 0, got {value!r}"
    full_blocks = record["input_length"] // block_size
    if len(hash_ids) < full_blocks:
        return (
            f"'input_length' {record['input_length']} spans {full_blocks} full blocks of {block_size} tokens "
            f"but 'hash_ids' has {len(hash_ids)}"
        )
    return None


def parse_trace(
    lines: Iterable[str],
    *,
    name: str,
    speedup: float = 1.0,
    limit: int | None = None,
    block_size: int = TRACE_BLOCK_SIZE,
) -> Trace:
    """Requests from Mooncake JSONL text; the shared body of ``load_trace`` and ``load_sample``.

    Args:
        lines: the trace's lines, with or without their newlines.
        name: what log messages and ``Trace.name`` call the source.
        speedup: arrival times are ``timestamp / 1000 / speedup`` seconds (spec §3: ``timestamp / speedup``).
        limit: keep only the first ``limit`` good requests (``--quick`` runs); None keeps all.
        block_size: tokens per hash id.

    Returns:
        The trace; request ids are ``r<line_number>``, so a request can be found in the file.

    Raises:
        ValueError: ``speedup`` not a positive finite number, ``limit`` negative, ``block_size`` < 1.
    """
    if not math.isfinite(speedup) or speedup <= 0:
        raise ValueError(f"trace speedup must be a positive number, got {speedup!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"trace limit must be >= 0, got {limit!r}")
    if block_size < 1:
        raise ValueError(f"trace block size must be >= 1, got {block_size!r}")
    requests: list[Request] = []
    skipped: list[tuple[int, str]] = []
    for line_number, line in enumerate(lines, start=1):
        if limit is not None and len(requests) >= limit:
            break
        text = line.strip()
        if not text:
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            reason: str | None = f"not JSON: {exc.msg} at column {exc.colno}"
        else:
            reason = _problem(record, block_size)
        if reason is not None:
            log.warning("bad trace line skipped trace=%s line=%d reason=%s", name, line_number, reason)
            skipped.append((line_number, reason))
            continue
        input_tokens: int = record["input_length"]
        requests.append(
            Request(
                request_id=f"r{line_number}",
                arrival=record["timestamp"] / 1000.0 / speedup,
                input_tokens=input_tokens,
                output_tokens=record["output_length"],
                local_hashes=tuple(record["hash_ids"][: input_tokens // block_size]),
            )
        )
    return Trace(name=name, requests=tuple(requests), skipped=tuple(skipped))


def load_trace(
    path: str | Path,
    *,
    speedup: float = 1.0,
    limit: int | None = None,
    block_size: int = TRACE_BLOCK_SIZE,
) -> Trace:
    """Read a Mooncake-format JSONL file; bad lines are logged, listed in ``Trace.skipped`` and left out.

    Args:
        path: the ``.jsonl`` file.
        speedup: arrival-time divisor (spec §3).
        limit: keep only the first ``limit`` good requests.
        block_size: tokens per hash id (512 for the Mooncake traces).

    Raises:
        OSError: the file cannot be read.
        ValueError: as ``parse_trace``.
    """
    path = Path(path)
    with path.open(encoding="utf-8") as fh:
        return parse_trace(fh, name=path.name, speedup=speedup, limit=limit, block_size=block_size)


def load_sample(*, speedup: float = 1.0, limit: int | None = None) -> Trace:
    """The packaged sample: the first 2,000 requests of Mooncake's FAST'25 conversation trace.

    Read through ``importlib.resources``, so it works from a wheel, an editable install or a zip.
    """
    resource = resources.files("kvrouter.sim").joinpath("data").joinpath(SAMPLE_NAME)
    with resource.open(encoding="utf-8") as fh:
        return parse_trace(fh, name=SAMPLE_NAME, speedup=speedup, limit=limit)
