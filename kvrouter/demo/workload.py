"""The demo's synthetic workload: multi-turn chat with a few shared system prompts, deterministic from a seed.

Popular system prompts come more often (weight 1/(rank+1)), and each session's prompts grow by the previous
turn, so the overlap a router can find comes both from shared prefixes and from a session's own history.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Final

__all__ = ["SYSTEM_PROMPTS", "Session", "Workload"]

VOCAB: Final = 32_000
SYSTEM_PROMPTS: Final = 6


@dataclass(slots=True)
class Session:
    """One synthetic conversation: a shared system prompt, then its own turns."""

    system: int
    turns_left: int
    history: list[int] = field(default_factory=list)
    busy: bool = False


class Workload:
    """Synthetic multi-turn chat, deterministic from a seed (see the module docstring).

    ``system_prompts`` are 20-60 blocks each; a session picks one with weight 1/(rank+1), then each turn
    adds 16-200 user tokens and the previous answer (synthetic ids: the mock returns none). A share
    ``documents`` of sessions first paste a fresh document of 3,000-5,000 tokens (the disaggregated demo's:
    its long fresh prompts are the ones worth splitting).
    """

    def __init__(self, seed: int, block_size: int, *, documents: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.documents = documents
        self.system_prompts = [
            [self.rng.randrange(1, VOCAB) for _ in range(block_size * self.rng.randint(20, 60))]
            for _ in range(SYSTEM_PROMPTS)
        ]
        self.weights = [1.0 / (rank + 1) for rank in range(SYSTEM_PROMPTS)]

    def session(self) -> Session:
        system = self.rng.choices(range(SYSTEM_PROMPTS), self.weights)[0]
        session = Session(system, self.rng.randint(2, 6))
        if self.documents and self.rng.random() < self.documents:
            session.history = [self.rng.randrange(1, VOCAB) for _ in range(self.rng.randint(3000, 5000))]
        return session

    def turn(self, session: Session) -> tuple[list[int], int]:
        """(the prompt of the session's next turn, its max_tokens); the session's history grows by it."""
        session.history.extend(self.rng.randrange(1, VOCAB) for _ in range(self.rng.randint(16, 200)))
        prompt = self.system_prompts[session.system] + session.history
        max_tokens = self.rng.randint(32, 192)
        session.history.extend(self.rng.randrange(1, VOCAB) for _ in range(max_tokens))
        session.turns_left -= 1
        return prompt, max_tokens
