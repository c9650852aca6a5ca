"""``Predictions``: each bet of the predicted tier is settled once, by how its reservation ended, and counted
per worker; the counts travel between fronts with the other counters."""

from __future__ import annotations

import numpy as np

from kvrouter.events.model import EngineHash, LocalHash, Removed, Stored, StoredBlock
from kvrouter.index import RadixIndex
from kvrouter.service.core.counters import PREDICTION_FIELDS, ServiceCounters
from kvrouter.service.core.predictions import Predictions

W1, W2 = (1, 0), (2, 0)
PROMPT = np.arange(1, 9, dtype=np.uint64)


def _store(index: RadixIndex, worker: int, local: list[int]) -> None:
    blocks = tuple(StoredBlock(EngineHash(500 + h), LocalHash(h)) for h in local)
    index.apply_event(worker, Stored(worker, None, blocks))


def _counts(counters: ServiceCounters) -> dict[tuple[int, int], dict[str, int]]:
    return {k: dict(zip(PREDICTION_FIELDS, v, strict=True)) for k, v in counters.predictions.items()}


def test_each_bet_is_settled_by_how_its_reservation_ended():
    counters, index = ServiceCounters(), RadixIndex()
    predictions = Predictions(counters, index)
    for n in range(5):
        predictions.made(f"r{n}", W1, PROMPT, 8)
    predictions.made("elsewhere", W2, PROMPT, 8)
    assert len(predictions) == 6

    _store(index, 1, list(range(1, 9)))  # W1's events brought the whole prompt
    predictions.freed("r0")
    _store(index, 2, list(range(1, 4)))  # W2's only three blocks of it
    predictions.freed("elsewhere")
    index.apply_event(1, Removed(1, (EngineHash(508),)))  # then W1 evicted the last block
    predictions.freed("r1")
    predictions.expired("r2")
    predictions.dropped(["r3", "r4", "never-made"])  # W1 restarted with them booked
    predictions.freed("r0")  # settled once: a second end is no-op
    predictions.expired("never-made")

    assert len(predictions) == 0
    assert _counts(counters) == {
        W1: {"made": 5, "confirmed": 1, "contradicted": 3, "expired": 1},
        W2: {"made": 1, "confirmed": 0, "contradicted": 1, "expired": 0},
    }


def test_the_counts_travel_between_fronts_and_add_up():
    mine, theirs = ServiceCounters(), ServiceCounters()
    Predictions(mine, RadixIndex()).made("a", W1, PROMPT, 8)
    other = Predictions(theirs, RadixIndex())
    other.made("b", W1, PROMPT, 8)
    other.expired("b")
    mine.add(ServiceCounters.from_wire(theirs.to_wire()))
    assert _counts(mine) == {W1: {"made": 2, "confirmed": 0, "contradicted": 0, "expired": 1}}


def test_a_bet_ended_while_the_index_is_down_stays_unsettled_and_the_free_goes_on():
    from kvrouter.engine import Engine

    counters = ServiceCounters()
    engine = Engine(shards=1)
    engine.start()
    try:
        predictions = Predictions(counters, engine)
        predictions.made("r", W1, PROMPT, 8)
    finally:
        engine.close()
    predictions.freed("r")  # the engine stopped: no answer to settle by, and no exception for the caller
    assert len(predictions) == 0
    assert _counts(counters) == {W1: {"made": 1, "confirmed": 0, "contradicted": 0, "expired": 0}}
