"""The demo's synthetic workload: multi-turn chat, as OpenAI messages, with a few shared system prompts.

Deterministic from a seed. Popular system prompts come more often (weight 1/(rank+1)), and each session's
messages grow by the previous turn, so the overlap a router can find comes both from shared prefixes and
from a session's own history. The text is words of the demo model's vocabulary (``kvrouter/chat``), so
every prompt renders and tokenizes as the router and the mock engines both do it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Final

from ..chat import DEMO_MODEL

__all__ = ["SYSTEM_PROMPTS", "Session", "Workload", "vocabulary"]

SYSTEM_PROMPTS: Final = 6
WORD_PREFIX: Final = "Ġ"
"""How the demo's byte-level BPE marks a token that starts a word."""


def vocabulary() -> list[str]:
    """The whole words of the demo model's vocabulary, sorted: text made of them tokenizes compactly."""
    vocab = json.loads((DEMO_MODEL / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(
        token[1:] for token in vocab if token.startswith(WORD_PREFIX) and token[1:].isalpha() and len(token) > 3
    )


@dataclass(slots=True)
class Session:
    """One synthetic conversation: a shared system prompt, then its own turns."""

    system: int
    turns_left: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    document: str = ""
    """A long fresh text the first user turn pastes (the disaggregated demo's), or nothing."""
    busy: bool = False

    def answered(self, content: str) -> None:
        """The engine's answer to the last turn joins the history, as a chat client keeps it."""
        self.messages.append({"role": "assistant", "content": content})


class Workload:
    """Synthetic multi-turn chat, deterministic from a seed (see the module docstring).

    ``system_prompts`` are 200-640 words each; a session picks one with weight 1/(rank+1), then each turn
    adds a user message of 10-130 words, and the client adds the engine's answer. A share ``documents`` of
    sessions open by pasting a fresh document of 2,000-3,300 words (the disaggregated demo's: its long fresh
    prompts are the ones worth splitting).
    """

    def __init__(self, seed: int, *, documents: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.documents = documents
        self.words = vocabulary()
        self.system_prompts = [self._text(self.rng.randint(200, 640)) for _ in range(SYSTEM_PROMPTS)]
        self.weights = [1.0 / (rank + 1) for rank in range(SYSTEM_PROMPTS)]

    def _text(self, words: int) -> str:
        return " ".join(self.rng.choice(self.words) for _ in range(words))

    def session(self) -> Session:
        system = self.rng.choices(range(SYSTEM_PROMPTS), self.weights)[0]
        session = Session(system, self.rng.randint(2, 6))
        session.messages.append({"role": "system", "content": self.system_prompts[system]})
        if self.documents and self.rng.random() < self.documents:
            session.document = self._text(self.rng.randint(2000, 3300))
        return session

    def turn(self, session: Session) -> tuple[list[dict[str, Any]], int]:
        """(the messages of the session's next turn, its max_tokens); the session's history grows by the turn."""
        text = self._text(self.rng.randint(10, 130))
        if session.document:
            text, session.document = f"{session.document}\n\n{text}", ""
        session.messages.append({"role": "user", "content": text})
        session.turns_left -= 1
        return list(session.messages), self.rng.randint(32, 192)
