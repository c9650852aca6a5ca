"""The shared-memory index driven in-process: N ``ShardWriter``s and an ``IndexReader`` over one control
segment, with the engine's sticky round-robin assignment, but no processes or sockets. The engine's own
tests cover those; this is what lets the kernels meet thousands of hypothesis examples quickly."""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvrouter.errors import EVENT_ERROR_KINDS
from kvrouter.events.codecs.dynamo import event_from_dict
from kvrouter.events.model import KvEvent, StorageTier, WorkerKey
from kvrouter.index.layout import MIN_CAPACITY, Control, control_name
from kvrouter.index.reader import IndexReader
from kvrouter.index.writer import ShardWriter, raw_event

_owners = itertools.count((os.getpid() << 20) + 1)


class InProcessShards:
    def __init__(self, shards: int, *, capacity: int = MIN_CAPACITY, budget: int = 0) -> None:
        """Tables start at the smallest capacity, so the tests grow them often; ``budget`` is each shard's
        share of an index cap (0: none)."""
        self.owner = next(_owners)
        self.control = Control.create(control_name(self.owner), shards)
        self.writers = [
            ShardWriter(self.control, k, self.owner, capacity=capacity, budget=budget) for k in range(shards)
        ]
        self.assignment: dict[WorkerKey, int] = {}
        self.reader = IndexReader(self.control.name)

    def writer_of(self, worker: WorkerKey) -> ShardWriter:
        shard = self.assignment.setdefault(worker, len(self.assignment) % len(self.writers))
        return self.writers[shard]

    def apply_event(self, worker_id: int, event: KvEvent | Mapping[str, Any]) -> None:
        if isinstance(event, Mapping):
            event = event_from_dict(event, worker_id)
        kind = self.writer_of((worker_id, event.dp_rank)).apply(event)
        if kind is not None:
            raise EVENT_ERROR_KINDS[kind](kind)

    def apply_batch(self, worker: WorkerKey, events: Sequence[KvEvent]) -> list[str]:
        """One worker's events through ``ShardWriter.apply_batch`` in one call; the error kinds met, in order."""
        return self.writer_of(worker).apply_batch(worker, [raw_event(event) for event in events])

    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> dict[WorkerKey, int]:
        return self.reader.find_matches(local_hashes, early_exit)

    def find_matches_by_tier(self, local_hashes: Sequence[int]) -> dict[StorageTier, dict[WorkerKey, int]]:
        return self.reader.find_matches_by_tier(local_hashes)

    def remove_worker(self, worker_id: int) -> None:
        for writer in self.writers:
            writer.remove_worker(worker_id)

    def clear_all_blocks(self, worker_id: int) -> None:
        for writer in self.writers:
            writer.clear_all_blocks(worker_id)

    def close(self) -> None:
        self.reader.close()
        for writer in self.writers:
            writer.close(unlink=True)
        self.control.close()
        self.control.unlink()


def remove_left_shard(control: Control) -> None:
    """What a writer process that closed without unlinking leaves (shard 0's current segment), then the
    control segment, removed as the supervisor removes a dead applier's."""
    name = control.segment_name(0)
    if name:
        os.unlink(f"/dev/shm/{name}")
    control.close()
    control.unlink()
