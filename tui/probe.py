"""The pinned probe prompt: token ids read from pasted text or a file.

A probe asks the router where a prompt *would* go (``Feed.probe``), every refresh, without booking it;
the worker table then shows that prompt's overlap and cost per worker, moving as the cache changes. The
prompt is token ids, not text: the dashboard does not know the model's tokenizer, and guessing one would
show overlaps the router never computes. A file holds the ids as a JSON list or separated by spaces,
commas or newlines; what the operator pastes reads the same way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Probe", "parse_tokens", "read_probe"]

_SEPARATORS = re.compile(r"[\s,]+")


@dataclass(frozen=True, slots=True)
class Probe:
    """A pinned prompt and where it came from (shown in the header)."""

    tokens: tuple[int, ...]
    label: str
    """``file <path>`` or ``pasted``."""


def parse_tokens(text: str) -> tuple[int, ...]:
    """Token ids from ``[1, 2, 3]`` or ``1 2 3`` or ``1,2,3``.

    Raises:
        ValueError: naming the first entry that is not a non-negative integer, or when there is none.
    """
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            loaded = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"probe prompt: not a JSON list of token ids ({exc.msg} at {exc.pos})") from exc
        entries = [str(entry) for entry in loaded] if isinstance(loaded, list) else [stripped]
    else:
        entries = [entry for entry in _SEPARATORS.split(stripped) if entry]
    if not entries:
        raise ValueError("probe prompt: no token ids")
    tokens = []
    for position, entry in enumerate(entries):
        if not entry.isdigit():
            raise ValueError(f"probe prompt: entry {position} is {entry!r}, not a token id")
        tokens.append(int(entry))
    return tuple(tokens)


def read_probe(text: str) -> Probe:
    """What the operator typed: a path to a file of token ids, else the ids themselves.

    Raises:
        ValueError: when neither reads as token ids.
    """
    candidate = text.strip()
    path = Path(candidate).expanduser()
    if candidate and not candidate[0].isdigit() and not candidate.startswith("[") and path.is_file():
        try:
            return Probe(parse_tokens(path.read_text()), f"file {path.name}")
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
    return Probe(parse_tokens(candidate), "pasted")
