"""Picking one worker from their costs: argmin with a fair tie-break, or softmax sampling.

Both as the reference's selector (``spec/dynamo-semantics.md`` §4.3). At temperature 0 the cheapest
worker wins and ties are broken uniformly at random (reservoir sampling: the k-th tied candidate
replaces the pick with probability 1/k), the fix for the deterministic tie-break that once unbalanced
dp ranks. Above 0, costs are min-max normalised before the softmax, so the temperature means the same
thing whatever the scale of the costs: ``p_i ∝ exp(-(c_i - c_min) / ((c_max - c_min) * T))``.

The random source is passed in, never global, so a seeded router makes the same choices in every run.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

__all__ = ["choose", "probabilities"]


def probabilities(costs: Sequence[float], temperature: float) -> list[float]:
    """Each candidate's chance of being picked.

    At temperature 0: ``1/k`` for each of the ``k`` cheapest (tied) candidates, 0 for the rest. Above 0:
    the softmax over min-max normalised costs; uniform when every cost is equal. A non-finite cost range
    divides the costs by their largest magnitude first, as the reference does.
    """
    if not costs:
        return []
    low, high = min(costs), max(costs)
    if high == low:
        return [1.0 / len(costs)] * len(costs)
    span = high - low
    if not math.isfinite(span):
        scale = max(abs(c) for c in costs)
        costs = [c / scale for c in costs]
        low, span = min(costs), max(costs) - min(costs)
    if span * temperature == 0.0:  # temperature 0, or so small the softmax is the argmin
        ties = [c == low for c in costs]
        return [1.0 / sum(ties) if tied else 0.0 for tied in ties]
    weights = [math.exp(-(c - low) / (span * temperature)) for c in costs]
    total = sum(weights)
    return [w / total for w in weights]


def choose(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """The index of the chosen candidate (``costs`` must not be empty).

    At temperature 0, one pass with reservoir sampling over the ties; above 0, one uniform draw ``u``
    and the first candidate whose cumulative probability reaches it.
    """
    if temperature == 0.0:
        best, ties = 0, 0
        for i, cost in enumerate(costs):
            if cost < costs[best]:
                best, ties = i, 1
            elif cost == costs[best]:
                ties += 1
                if rng.random() * ties < 1.0:
                    best = i
        return best
    u = rng.random()
    cumulative = 0.0
    probs = probabilities(costs, temperature)
    for i, p in enumerate(probs):
        cumulative += p
        if cumulative >= u:
            return i
    return len(probs) - 1  # rounding left the sum a hair below u
