"""Seeded synthetic workloads in Mooncake trace form: agent fan-out, RAG over popular documents, bursty chat.

The Mooncake traces show how real users share prefixes on average; they rarely show the shapes that
break a cache-aware router: many requests sharing a prefix nobody has computed yet, arriving together.
These generators make those shapes on purpose, with their parameters as options, so a policy can be
judged on them and on variants it was never tuned on (other seeds, sizes, rates).

**How a prompt becomes hash ids.** A prompt is a list of segments, each a piece of content with a key
(a system prompt, a document, one user's question) and a length in tokens. Cut into 512-token blocks,
a block is the pieces of segments it covers; its id is interned on ``(parent id, pieces)``. So two
prompts share a block id exactly when they share every token up to that block's end, which is what
Mooncake's chained ids mean (``trace.py``), and a block straddling a shared and a private segment is
private. The last, partial block gets an id too, as in the Mooncake files.

**One path.** A generator yields Mooncake records (``timestamp`` ms, lengths, ``hash_ids``); the
:class:`~kvrouter.sim.trace.Trace` is built from them by ``parse_trace``, the same parser a file goes
through, and ``--write-trace`` writes the same records. A generated trace replays like a file because
it is one. The rejected alternative, building ``Request`` objects directly, would give generated runs a
second, untested way into the simulator.

**Determinism.** Each generator draws from one ``random.Random(seed)`` in a fixed order; ids are
interned in order of first use. Same options, same trace, byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .trace import TRACE_BLOCK_SIZE, Trace, parse_trace

__all__ = [
    "WORKLOADS",
    "ChatOptions",
    "FanoutOptions",
    "RagOptions",
    "Workload",
    "generate",
    "parse_workload_options",
    "trace_name",
    "workload_records",
]

Segment = tuple[Hashable, int]
"""``(content key, tokens)``: one stretch of a prompt; equal keys mean equal tokens."""

Record = dict[str, Any]
"""One Mooncake trace line: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""


class _Blocks:
    """Interns block contents to chained ids, so shared prefixes share ids and nothing else does."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._ids: dict[tuple[int, tuple[tuple[Hashable, int, int], ...]], int] = {}

    def hash_ids(self, segments: Sequence[Segment]) -> list[int]:
        """The prompt's block ids, the partial last block included."""
        ids: list[int] = []
        parent = -1
        pieces: list[tuple[Hashable, int, int]] = []
        room = self._block_size
        for key, tokens in segments:
            offset = 0
            while offset < tokens:
                take = min(room, tokens - offset)
                pieces.append((key, offset, offset + take))
                offset += take
                room -= take
                if room == 0:
                    parent = self._intern(parent, pieces)
                    ids.append(parent)
                    pieces, room = [], self._block_size
        if pieces:
            ids.append(self._intern(parent, pieces))
        return ids

    def _intern(self, parent: int, pieces: list[tuple[Hashable, int, int]]) -> int:
        return self._ids.setdefault((parent, tuple(pieces)), len(self._ids))


def _check_range(options: object, low: str, high: str, *, minimum: float) -> None:
    _check_at_least(options, low, minimum)
    hi, lo = getattr(options, high), getattr(options, low)
    if not hi >= lo:  # `not >=` also refuses NaN
        raise ValueError(f"{high} ({hi!r}) must be >= {low} ({lo!r})")


def _check_at_least(options: object, name: str, minimum: float) -> None:
    value = getattr(options, name)
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name} must be a number >= {minimum:g}, got {value!r}")


@dataclass(frozen=True, slots=True)
class FanoutOptions:
    """Agent fan-out: groups of calls share a fresh context and arrive together (issue 34's trace)."""

    seed: int = 0
    requests: int = 1536
    group_min: int = 4
    group_max: int = 24
    prefix_min_tokens: int = 4096
    prefix_max_tokens: int = 12288
    """The group's shared context, new to every worker when the group arrives."""
    suffix_min_tokens: int = 64
    suffix_max_tokens: int = 1024
    """Each call's own instruction after the shared context."""
    window_ms: float = 300.0
    """A group's calls arrive uniformly within this window of its start."""
    gap_min_s: float = 1.5
    gap_max_s: float = 3.5
    """Between two groups' starts."""
    output_min_tokens: int = 64
    output_max_tokens: int = 512

    def __post_init__(self) -> None:
        _check_at_least(self, "requests", 1)
        _check_range(self, "group_min", "group_max", minimum=1)
        _check_range(self, "prefix_min_tokens", "prefix_max_tokens", minimum=0)
        _check_range(self, "suffix_min_tokens", "suffix_max_tokens", minimum=1)
        _check_at_least(self, "window_ms", 0)
        _check_range(self, "gap_min_s", "gap_max_s", minimum=0)
        _check_range(self, "output_min_tokens", "output_max_tokens", minimum=1)


def _fanout(options: FanoutOptions, blocks: _Blocks) -> Iterator[Record]:
    rng = random.Random(options.seed)
    made, group, start = 0, 0, 0.0
    while made < options.requests:
        prefix = rng.randint(options.prefix_min_tokens, options.prefix_max_tokens)
        size = min(rng.randint(options.group_min, options.group_max), options.requests - made)
        offsets = sorted(rng.uniform(0.0, options.window_ms) for _ in range(size))
        for member, offset_ms in enumerate(offsets):
            suffix = rng.randint(options.suffix_min_tokens, options.suffix_max_tokens)
            segments = [(("context", group), prefix), (("call", group, member), suffix)]
            output = rng.randint(options.output_min_tokens, options.output_max_tokens)
            yield _record(start * 1000.0 + offset_ms, segments, output, blocks)
        made += size
        group += 1
        start += rng.uniform(options.gap_min_s, options.gap_max_s)


@dataclass(frozen=True, slots=True)
class RagOptions:
    """RAG: a shared system prompt, then 1-3 documents drawn by Zipf popularity, then the question."""

    seed: int = 0
    requests: int = 2000
    rate_per_s: float = 16.0
    """Poisson arrivals at this mean rate (before ``--speedup``)."""
    documents: int = 400
    zipf_s: float = 1.1
    """Document of popularity rank k is drawn with weight 1 / k^s."""
    docs_min: int = 1
    docs_max: int = 3
    doc_min_tokens: int = 1024
    doc_max_tokens: int = 4096
    """Each document's length, fixed per document."""
    system_tokens: int = 1024
    question_min_tokens: int = 32
    question_max_tokens: int = 256
    output_min_tokens: int = 64
    output_max_tokens: int = 512

    def __post_init__(self) -> None:
        _check_at_least(self, "requests", 1)
        if not math.isfinite(self.rate_per_s) or self.rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be a positive number, got {self.rate_per_s!r}")
        _check_at_least(self, "documents", 1)
        _check_at_least(self, "zipf_s", 0)
        _check_range(self, "docs_min", "docs_max", minimum=1)
        if self.docs_max > self.documents:
            raise ValueError(f"docs_max ({self.docs_max}) must be <= documents ({self.documents})")
        _check_range(self, "doc_min_tokens", "doc_max_tokens", minimum=1)
        _check_at_least(self, "system_tokens", 0)
        _check_range(self, "question_min_tokens", "question_max_tokens", minimum=1)
        _check_range(self, "output_min_tokens", "output_max_tokens", minimum=1)


def _rag(options: RagOptions, blocks: _Blocks) -> Iterator[Record]:
    rng = random.Random(options.seed)
    lengths = [rng.randint(options.doc_min_tokens, options.doc_max_tokens) for _ in range(options.documents)]
    weights = [1.0 / (rank + 1) ** options.zipf_s for rank in range(options.documents)]
    ranks = range(options.documents)
    now = 0.0
    for number in range(options.requests):
        now += rng.expovariate(options.rate_per_s)
        count = rng.randint(options.docs_min, options.docs_max)
        chosen: list[int] = []
        while len(chosen) < count:  # without replacement, in retrieval order
            (doc,) = rng.choices(ranks, weights)
            if doc not in chosen:
                chosen.append(doc)
        segments: list[Segment] = [("system", options.system_tokens)]
        segments += [(("doc", doc), lengths[doc]) for doc in chosen]
        segments.append((("question", number), rng.randint(options.question_min_tokens, options.question_max_tokens)))
        yield _record(now * 1000.0, segments, rng.randint(options.output_min_tokens, options.output_max_tokens), blocks)


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """Bursty multi-turn chat: conversations start in waves; each turn follows the last answer by 1-5 s."""

    seed: int = 0
    conversations: int = 320
    system_prompts: int = 4
    """Distinct system prompts; a conversation uses one, so a wave shares them."""
    system_min_tokens: int = 1024
    system_max_tokens: int = 4096
    wave_min: int = 8
    wave_max: int = 32
    """Conversations per wave."""
    wave_window_s: float = 2.0
    """A wave's first turns arrive uniformly within this window."""
    wave_gap_min_s: float = 10.0
    wave_gap_max_s: float = 30.0
    turns_min: int = 2
    turns_max: int = 8
    user_min_tokens: int = 32
    user_max_tokens: int = 512
    output_min_tokens: int = 64
    output_max_tokens: int = 512
    answer_ms_per_token: float = 20.0
    """Nominal decode time the next turn waits for: the previous answer takes output tokens times this."""
    think_min_s: float = 1.0
    think_max_s: float = 5.0
    """The user's pause between reading an answer and sending the next turn."""

    def __post_init__(self) -> None:
        _check_at_least(self, "conversations", 1)
        _check_at_least(self, "system_prompts", 1)
        _check_range(self, "system_min_tokens", "system_max_tokens", minimum=0)
        _check_range(self, "wave_min", "wave_max", minimum=1)
        _check_at_least(self, "wave_window_s", 0)
        _check_range(self, "wave_gap_min_s", "wave_gap_max_s", minimum=0)
        _check_range(self, "turns_min", "turns_max", minimum=1)
        _check_range(self, "user_min_tokens", "user_max_tokens", minimum=1)
        _check_range(self, "output_min_tokens", "output_max_tokens", minimum=1)
        _check_at_least(self, "answer_ms_per_token", 0)
        _check_range(self, "think_min_s", "think_max_s", minimum=0)


def _chat(options: ChatOptions, blocks: _Blocks) -> Iterator[Record]:
    rng = random.Random(options.seed)
    systems = [rng.randint(options.system_min_tokens, options.system_max_tokens) for _ in range(options.system_prompts)]
    turns: list[tuple[float, int, list[Segment], int]] = []  # (arrival s, conversation, segments, output)
    conversation, wave_start = 0, 0.0
    while conversation < options.conversations:
        size = min(rng.randint(options.wave_min, options.wave_max), options.conversations - conversation)
        for _ in range(size):
            system = rng.randrange(options.system_prompts)
            history: list[Segment] = [(("system", system), systems[system])]
            arrival = wave_start + rng.uniform(0.0, options.wave_window_s)
            for turn in range(rng.randint(options.turns_min, options.turns_max)):
                user = rng.randint(options.user_min_tokens, options.user_max_tokens)
                history.append((("user", conversation, turn), user))
                output = rng.randint(options.output_min_tokens, options.output_max_tokens)
                turns.append((arrival, conversation, list(history), output))
                history.append((("answer", conversation, turn), output))
                think = rng.uniform(options.think_min_s, options.think_max_s)
                arrival += output * options.answer_ms_per_token / 1000.0 + think
            conversation += 1
        wave_start += rng.uniform(options.wave_gap_min_s, options.wave_gap_max_s)
    turns.sort(key=lambda turn: (turn[0], turn[1]))
    for arrival, _, segments, output in turns:
        yield _record(arrival * 1000.0, segments, output, blocks)


def _record(timestamp_ms: float, segments: Sequence[Segment], output_tokens: int, blocks: _Blocks) -> Record:
    return {
        "timestamp": round(timestamp_ms),
        "input_length": sum(tokens for _, tokens in segments),
        "output_length": output_tokens,
        "hash_ids": blocks.hash_ids(segments),
    }


@dataclass(frozen=True, slots=True)
class Workload:
    """A generator and the options it takes."""

    options: type[Any]
    """The options dataclass; its fields are the ``-o KEY=VALUE`` keys, its defaults the defaults."""
    records: Callable[[Any, _Blocks], Iterator[Record]]
    summary: str


WORKLOADS: Final[Mapping[str, Workload]] = {
    "fanout": Workload(FanoutOptions, _fanout, "agent fan-out: groups sharing a fresh prefix arrive together"),
    "rag": Workload(RagOptions, _rag, "RAG: Zipf-popular documents after a shared system prompt, Poisson arrivals"),
    "chat": Workload(ChatOptions, _chat, "bursty multi-turn chat: waves of conversations, 1-5 s between turns"),
}
"""Workload name → generator, as ``kvrouter simulate --workload`` takes it."""


def _workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from: {', '.join(WORKLOADS)}") from None


def parse_workload_options(name: str, pairs: Sequence[str]) -> Any:
    """The options of workload ``name`` from ``KEY=VALUE`` strings; unset keys keep their defaults.

    Raises:
        ValueError: an unknown workload, a pair without ``=``, an unknown key (the message lists the valid
            keys with their defaults), a value of the wrong type, or options the workload rejects.
    """
    workload = _workload(name)
    fields = {field.name: field for field in dataclasses.fields(workload.options)}
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"workload option {pair!r} is not KEY=VALUE")
        if key not in fields:
            valid = ", ".join(f"{field.name}={field.default}" for field in fields.values())
            raise ValueError(f"unknown option {key!r} for workload {name!r}; valid (with defaults): {valid}")
        kind: type[Any] = type(fields[key].default)
        try:
            values[key] = kind(text.strip())
        except ValueError:
            raise ValueError(f"workload option {key!r} takes {kind.__name__}, got {text.strip()!r}") from None
    return workload.options(**values)


def workload_records(name: str, options: Any, *, block_size: int = TRACE_BLOCK_SIZE) -> list[Record]:
    """The Mooncake records of workload ``name`` under ``options``, in arrival order."""
    workload = _workload(name)
    if not isinstance(options, workload.options):
        raise TypeError(f"workload {name!r} takes {workload.options.__name__}, got {type(options).__name__}")
    return list(workload.records(options, _Blocks(block_size)))


def trace_name(name: str, options: Any) -> str:
    """``fanout`` with default options, else ``fanout[seed=3,requests=500]``: the non-default options."""
    changed = [
        f"{field.name}={getattr(options, field.name)}"
        for field in dataclasses.fields(options)
        if getattr(options, field.name) != field.default
    ]
    return f"{name}[{','.join(changed)}]" if changed else name


def generate(
    name: str,
    options: Any = None,
    *,
    speedup: float = 1.0,
    limit: int | None = None,
    write_to: Path | None = None,
) -> Trace:
    """Workload ``name`` as a trace, through ``parse_trace`` like any file.

    Args:
        name: a key of ``WORKLOADS``.
        options: its options dataclass; None takes the defaults.
        speedup: arrival-time divisor, as for a file (``write_to`` gets the timestamps before it).
        limit: keep only the first ``limit`` requests.
        write_to: also write the whole trace there as Mooncake JSONL, replayable with ``--trace``.
    """
    if options is None:
        options = _workload(name).options()
    lines = [json.dumps(record) for record in workload_records(name, options)]
    if write_to is not None:
        write_to.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return parse_trace(lines, name=trace_name(name, options), speedup=speedup, limit=limit)
