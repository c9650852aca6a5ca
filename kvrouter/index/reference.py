"""``RadixIndex``: the small, obviously correct index that every faster one is checked against.

It implements the index contract of ``DESIGN.md`` block by block: a trie of local hashes shared by
all workers, where each node records which (worker, dp_rank, tier) hold it and how many of that
worker's engine hashes name it. Nothing is compressed and nothing is inferred: a worker holds exactly
the blocks its engine stored and has not released, so interior evictions, re-stores and engine
hashes that move between paths all come out as the engine sees them. That is where it parts from
the reference's compressed tree (the three cases of ``DESIGN.md``), on purpose; everywhere else it
answers as ``dynamo._core.RadixTree`` does (``spec/dynamo-semantics.md`` §2).

Speed is not a goal: a query walks the trie once and intersects small sets per block. The shared
memory engine (``index/`` tables and kernels) is what serves traffic; this is its oracle and the
simulator's in-process index.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..errors import BadEvent, BlockNotFound, InvalidBlockSequence, ParentNotFound
from ..events.codecs.dynamo import event_from_dict
from ..events.model import (
    U64_MAX,
    Cleared,
    EngineHash,
    KvEvent,
    LocalHash,
    Removed,
    StorageTier,
    Stored,
    StoredBlock,
    WorkerKey,
)

__all__ = ["RadixIndex"]

log = logging.getLogger(__name__)

Holder = tuple[WorkerKey, StorageTier]
"""Who holds a node: one worker in one tier."""


class _Node:
    """One block position: the path of local hashes from the root to here."""

    __slots__ = ("children", "depth", "local_hash", "parent", "refs")

    def __init__(self, parent: _Node | None, local_hash: LocalHash) -> None:
        self.parent = parent
        self.local_hash = local_hash
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.children: dict[LocalHash, _Node] = {}
        self.refs: dict[Holder, int] = {}
        """How many of the holder's engine hashes name this node (usually 1)."""


class RadixIndex:
    """Which worker holds which blocks, per the index contract; answers overlap queries.

    Events are applied in the order given; an event that breaks the contract raises its
    :class:`~kvrouter.errors.EventError` and leaves the index as the contract says (stores: untouched;
    removes: every known hash removed, the first unknown one reported).
    """

    def __init__(self) -> None:
        self._root = _Node(None, LocalHash(0))
        self._lookup: dict[Holder, dict[EngineHash, _Node]] = {}
        self._workers: set[WorkerKey] = set()

    # -- events -------------------------------------------------------------------------------

    def apply_event(self, worker_id: int, event: KvEvent | Mapping[str, Any]) -> None:
        """Apply one event of ``worker_id``: a kvrouter event, or the reference's ``KvCacheEvent`` dict.

        Raises:
            BadEvent: the dict is not a valid event, or the event belongs to another worker.
            ParentNotFound: a store under a parent this (worker, dp_rank, tier) does not hold.
            InvalidBlockSequence: a store that names its parent among its own blocks, or repeats a hash.
            BlockNotFound: a remove naming a hash this worker does not hold (the others are removed).
        """
        if isinstance(event, Mapping):
            event = event_from_dict(event, worker_id)
        elif event.worker_id != worker_id:
            raise BadEvent(f"event {event.event_id} of worker {event.worker_id} applied as worker {worker_id}")
        key = (worker_id, event.dp_rank)
        self._workers.add(key)
        match event:
            case Stored():
                self._store(key, event)
            case Removed():
                self._remove(key, event)
            case Cleared():
                self._release_all(key, event.tier)

    def _store(self, key: WorkerKey, event: Stored) -> None:
        hashes = [block.engine_hash for block in event.blocks]
        if event.parent is not None and event.parent in hashes:
            raise InvalidBlockSequence(
                f"stored event {event.event_id} from worker {key[0]} dp {key[1]}: "
                f"parent {event.parent:#x} is one of the event's own blocks"
            )
        if len(set(hashes)) != len(hashes):
            raise InvalidBlockSequence(
                f"stored event {event.event_id} from worker {key[0]} dp {key[1]}: an engine hash repeats"
            )
        holder = (key, event.tier)
        lookup = self._lookup.setdefault(holder, {})
        if event.parent is None:
            node = self._root
        else:
            found = lookup.get(event.parent)
            if found is None:
                raise ParentNotFound(
                    f"stored event {event.event_id} from worker {key[0]} dp {key[1]}: "
                    f"parent {event.parent:#x} is not in this worker's {event.tier.value} index"
                )
            node = found
        for block in event.blocks:
            child = node.children.get(block.local_hash)
            if child is None:
                child = node.children[block.local_hash] = _Node(node, block.local_hash)
            previous = lookup.get(block.engine_hash)
            if previous is not child:
                lookup[block.engine_hash] = child
                child.refs[holder] = child.refs.get(holder, 0) + 1
                if previous is not None:  # the engine re-used the hash at another path: it moved
                    self._unref(previous, holder)
            node = child

    def _remove(self, key: WorkerKey, event: Removed) -> None:
        holder = (key, event.tier)
        lookup = self._lookup.get(holder, {})
        first_missing: EngineHash | None = None
        for engine_hash in event.engine_hashes:
            node = lookup.pop(engine_hash, None)
            if node is None:
                first_missing = engine_hash if first_missing is None else first_missing
                continue
            self._unref(node, holder)
        if first_missing is not None:
            raise BlockNotFound(
                f"removed event {event.event_id} from worker {key[0]} dp {key[1]}: "
                f"block {first_missing:#x} is not in this worker's {event.tier.value} index"
            )

    def _release_all(self, key: WorkerKey, tier: StorageTier) -> None:
        holder = (key, tier)
        for node in self._lookup.pop(holder, {}).values():
            self._unref(node, holder)

    def _unref(self, node: _Node, holder: Holder) -> None:
        count = node.refs[holder] - 1
        if count:
            node.refs[holder] = count
            return
        del node.refs[holder]
        # Drop nodes nobody holds and nothing hangs from, so the trie stays the size of what is cached.
        while node.parent is not None and not node.refs and not node.children:
            del node.parent.children[node.local_hash]
            node = node.parent

    def remove_worker(self, worker_id: int) -> None:
        """Forget every dp rank of ``worker_id``: its blocks and the worker itself."""
        self.clear_all_blocks(worker_id)
        self._workers = {key for key in self._workers if key[0] != worker_id}

    def clear_all_blocks(self, worker_id: int) -> None:
        """Release every block of every dp rank and tier of ``worker_id``; the worker stays known."""
        for key, tier in [holder for holder in self._lookup if holder[0][0] == worker_id]:
            self._release_all(key, tier)

    # -- queries ------------------------------------------------------------------------------

    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> dict[WorkerKey, int]:
        """Per worker, the number of leading query blocks it holds on device, contiguously from the root.

        Workers with no match are omitted. ``early_exit`` is accepted for the reference's signature and
        never changes the answer (the walk already ends when no worker is left).
        """
        return self._walk(local_hashes, StorageTier.DEVICE.rank)

    def find_matches_by_tier(self, local_hashes: Sequence[int]) -> dict[StorageTier, dict[WorkerKey, int]]:
        """Per tier, per worker: the leading query blocks held in that tier or a faster one.

        So for every worker ``device <= host <= disk <= shared``, as the reference's HTTP ``gpu``,
        ``cpu`` and ``disk`` fields are.
        """
        return {tier: self._walk(local_hashes, tier.rank) for tier in StorageTier}

    def _walk(self, local_hashes: Sequence[int], max_rank: int) -> dict[WorkerKey, int]:
        scores: dict[WorkerKey, int] = {}
        alive: set[WorkerKey] | None = None
        node = self._root
        for depth, local_hash in enumerate(local_hashes, start=1):  # hot path: one dict probe per block
            child = node.children.get(LocalHash(local_hash))
            if child is None:
                break
            holding = {key for key, tier in child.refs if tier.rank <= max_rank}
            alive = holding if alive is None else alive & holding
            if not alive:
                break
            for key in alive:
                scores[key] = depth
            node = child
        return scores

    def block_counts(self, tier: StorageTier | None = None) -> dict[WorkerKey, int]:
        """Blocks each known worker holds, in ``tier`` or in any tier; workers holding none count 0."""
        nodes: dict[WorkerKey, set[int]] = {key: set() for key in self._workers}
        for (key, held_tier), lookup in self._lookup.items():
            if tier is None or held_tier is tier:
                nodes.setdefault(key, set()).update(map(id, lookup.values()))
        return {key: len(ids) for key, ids in nodes.items()}

    def holdings(self) -> dict[tuple[WorkerKey, StorageTier], dict[EngineHash, tuple[LocalHash, ...]]]:
        """Everything held, per (worker, tier): each engine hash and the path of local hashes it names.

        The index's whole observable state, for comparing indexes (a dump round trip, the shared-memory
        engine) and for debugging; holders with no blocks are left out.
        """
        return {
            holder: {engine_hash: _path(node) for engine_hash, node in lookup.items()}
            for holder, lookup in self._lookup.items()
            if lookup
        }

    def workers(self) -> set[WorkerKey]:
        """Every (worker, dp_rank) seen and not removed, holding blocks or not."""
        return set(self._workers)

    # -- dump ---------------------------------------------------------------------------------

    def dump(self) -> list[KvEvent]:
        """Events that rebuild this index when applied, in order, to an empty one.

        A worker may hold a block without its parent (an interior eviction leaves deeper blocks), but a
        store needs a parent the worker holds. Such gaps are stored under synthetic engine hashes (the
        largest u64 values the worker does not use) and removed again at the end of its events, so the
        rebuilt index holds exactly what this one does, under the same engine hashes.
        """
        events: list[KvEvent] = []
        for holder in sorted(self._lookup, key=lambda h: (h[0], h[1].rank)):
            events.extend(self._dump_holder(holder, first_event_id=len(events)))
        return events

    def _dump_holder(self, holder: Holder, first_event_id: int) -> Iterator[KvEvent]:
        (worker_id, dp_rank), tier = holder
        lookup = self._lookup[holder]
        names: dict[_Node, list[EngineHash]] = {}
        for engine_hash, node in lookup.items():
            names.setdefault(node, []).append(engine_hash)
        handle: dict[_Node, EngineHash] = {}
        gaps: list[EngineHash] = []
        spare = _spare_hashes(lookup)
        event_id = first_event_id
        for node in sorted(names, key=lambda n: n.depth):
            chain: list[_Node] = []
            above = node.parent
            while above is not None and above is not self._root and above not in handle:
                chain.append(above)
                above = above.parent
            parent = None if above is None or above is self._root else handle[above]
            blocks = []
            for gap in reversed(chain):
                handle[gap] = next(spare)
                gaps.append(handle[gap])
                blocks.append(StoredBlock(handle[gap], gap.local_hash))
            first, *others = names[node]
            handle[node] = first
            blocks.append(StoredBlock(first, node.local_hash))
            yield Stored(worker_id, parent, tuple(blocks), dp_rank=dp_rank, event_id=event_id, tier=tier)
            event_id += 1
            under = None if node.parent is None or node.parent is self._root else handle[node.parent]
            for other in others:
                block = (StoredBlock(other, node.local_hash),)
                yield Stored(worker_id, under, block, dp_rank=dp_rank, event_id=event_id, tier=tier)
                event_id += 1
        if gaps:
            yield Removed(worker_id, tuple(gaps), dp_rank=dp_rank, event_id=event_id, tier=tier)


def _path(node: _Node) -> tuple[LocalHash, ...]:
    path: list[LocalHash] = []
    while node.parent is not None:
        path.append(node.local_hash)
        node = node.parent
    return tuple(reversed(path))


def _spare_hashes(used: Iterable[EngineHash]) -> Iterator[EngineHash]:
    """Engine hashes a worker does not use, from the top of the u64 range down."""
    taken = set(used)
    candidate = U64_MAX
    while True:
        if candidate not in taken:
            yield EngineHash(candidate)
        candidate -= 1
