"""Small hand-built clusters for policy tests: three workers, a ``RadixIndex`` fed with Stored events, a
``SlotManager`` with booked requests, a seeded RNG."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from kvrouter.events.model import EngineHash, LocalHash, Stored, StoredBlock, WorkerKey
from kvrouter.hashing import sequence_hashes
from kvrouter.index import RadixIndex
from kvrouter.routing import SlotManager
from kvrouter.sim.policy import Cluster, Request

B = 4
"""Tokens per block in every test cluster."""
W0, W1, W2 = (0, 0), (1, 0), (2, 0)
WORKERS = (W0, W1, W2)

_engine_hashes = itertools.count(1000)
_request_ids = itertools.count()


def make_cluster(
    *, workers: tuple[WorkerKey, ...] = WORKERS, now: float = 0.0, seed: int = 0, capacity_blocks: int = 64
) -> Cluster:
    return Cluster(
        workers=workers,
        index=RadixIndex(),
        slots=SlotManager(block_size=B, clock=lambda: 0.0),
        block_size=B,
        capacity_blocks=capacity_blocks,
        now=now,
        rng=random.Random(seed),
    )


def cache(cluster: Cluster, worker: WorkerKey, local_hashes: Sequence[int]) -> None:
    """The worker's engine stores ``local_hashes`` from the root (as one Stored event)."""
    blocks = tuple(StoredBlock(EngineHash(next(_engine_hashes)), LocalHash(h)) for h in local_hashes)
    cluster.index.apply_event(worker[0], Stored(worker[0], None, blocks, dp_rank=worker[1]))


def book(
    cluster: Cluster,
    worker: WorkerKey,
    local_hashes: Sequence[int] = (),
    *,
    prefill_tokens: int | None = None,
    prefilled: bool = False,
) -> str:
    """Book an active request on ``worker`` as the simulator would; returns its id.

    Args:
        local_hashes: its blocks (they count as the worker's active blocks).
        prefill_tokens: its prompt length; ``len(local_hashes) * B`` by default.
        prefilled: its first token is out, so only its blocks count, not its prompt.
    """
    request_id = f"booked-{next(_request_ids)}"
    isl = len(local_hashes) * B if prefill_tokens is None else prefill_tokens
    cluster.slots.add_request(request_id, worker, sequence_hashes(list(local_hashes)), isl, 0)
    if prefilled:
        cluster.slots.mark_prefill_completed(request_id)
    return request_id


def book_many(cluster: Cluster, worker: WorkerKey, count: int) -> None:
    """``count`` in-flight requests with no blocks and no prefill left: load in requests only."""
    for _ in range(count):
        book(cluster, worker, prefilled=True)


def request(
    local_hashes: Sequence[int], *, input_tokens: int | None = None, output_tokens: int = 8, arrival: float = 0.0
) -> Request:
    """A request over ``local_hashes``, its prompt exactly those blocks unless ``input_tokens`` says more."""
    return Request(
        request_id=f"req-{next(_request_ids)}",
        arrival=arrival,
        input_tokens=len(local_hashes) * B if input_tokens is None else input_tokens,
        output_tokens=output_tokens,
        local_hashes=tuple(local_hashes),
    )
