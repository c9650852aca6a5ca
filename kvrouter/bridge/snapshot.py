"""The durable-mode index snapshot: every rank's blocks and last event id, and the stream sequence covered.

The reference uploads its whole index as one ``Vec<RouterEvent>`` JSON document, one event per block
(``spec/dynamo-semantics.md`` §6.4): about 70 bytes a block, and a JSON parse of every one on load.
kvrouter's object is one msgpack map holding, per (worker, dp_rank), the rank's dump as kvrouter-format
batches (``docs/wire-format.md``), whose hashes are packed little-endian u64 arrays, after the dump's
one-event-per-block stores are merged back into chains (:func:`compact`): a chain of blocks is one
event, so a block costs 16 bytes (its engine and local hash) plus its share of one event's header, and a
load is one ``numpy.frombuffer`` per chain. The batches are kept as bytes on load (checked with the
kvrouter decoder's array path, no object per block): the relay answers an applier's join with them as
they are (``worker/local_indexer.py``, :meth:`~kvrouter.worker.local_indexer.LocalIndexer.load_batches`),
so a warm restart parses no block in Python. Each rank also carries its last event id, so the stream
replayed after the snapshot continues every rank's ids exactly, and the map carries the stream sequence
the snapshot covers, where that replay starts.

Layout (version 1)::

    {"v": 1, "kind": "kvrouter-radix-state", "stream_seq": int,
     "ranks": [[worker_id, dp_rank, last_event_id | nil, [batch bin, ...]], ...]}

Rejected: the reference's JSON (4-5x larger, and slower to load than the replay it replaces for small
streams); pickling the radix index (ties the object to one Python build and one class layout).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import msgpack

from ..errors import BadMessage, EventError
from ..events.codecs.kvrouter import Decoder
from ..events.model import EngineHash, KvEvent, StorageTier, Stored
from ..worker.publisher import MAX_EVENT_BLOCKS

__all__ = [
    "SNAPSHOT_KIND",
    "SNAPSHOT_VERSION",
    "RankState",
    "Snapshot",
    "compact",
    "decode_snapshot",
    "encode_snapshot",
]

SNAPSHOT_VERSION: Final = 1
SNAPSHOT_KIND: Final = "kvrouter-radix-state"
"""Marks the object as kvrouter's, so a reference router's JSON snapshot in the same bucket is refused by name."""


@dataclass(frozen=True, slots=True)
class RankState:
    """One (worker, dp_rank) in a snapshot: the batches of events that rebuild it from empty, its last real id."""

    worker_id: int
    dp_rank: int
    last_event_id: int | None
    batches: tuple[bytes, ...]
    """kvrouter-format batch payloads of this rank's events, in order."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A decoded snapshot."""

    stream_seq: int
    """The last stream sequence the ranks reflect: the replay resumes at the next one."""
    ranks: tuple[RankState, ...]


def compact(events: Sequence[KvEvent]) -> list[KvEvent]:
    """A dump's events with chains merged: a store whose parent is the last block of the store just
    written joins it, visiting each block's children depth first so a chain's stores are adjacent.

    Applying the result to an empty index gives what applying ``events`` gives: a merged store is the
    same blocks under the same parents, in an order where every parent still precedes its children.
    Events other than stores (the dump's trailing ``Removed`` of gap blocks) keep their order, after them.
    A merged store stops at ``MAX_EVENT_BLOCKS`` blocks (the next part continues the chain), as
    ``KvPublisher`` splits its stores, so every event fits a 1 MiB batch.
    """
    children: dict[tuple[StorageTier, EngineHash | None], list[Stored]] = {}
    stores: list[Stored] = []
    rest: list[KvEvent] = []
    for event in events:
        if isinstance(event, Stored):
            children.setdefault((event.tier, event.parent), []).append(event)
            stores.append(event)
        else:
            rest.append(event)
    merged: list[KvEvent] = []
    seen: set[int] = set()
    for root in stores:  # a dump lists parents first, so the first unseen store starts a new tree
        if id(root) in seen:
            continue
        stack = [root]
        run: Stored | None = None
        while stack:  # hot path: one step per store of the dump
            event = stack.pop()
            if id(event) in seen:
                continue
            seen.add(id(event))
            if (
                run is not None
                and run.tier == event.tier
                and run.blocks[-1].engine_hash == event.parent
                and len(run.blocks) + len(event.blocks) <= MAX_EVENT_BLOCKS
            ):
                run = replace(run, blocks=run.blocks + event.blocks)
            else:
                if run is not None:
                    merged.append(run)
                run = event
            for block in event.blocks[:-1]:  # gap blocks may have children of their own: after the chain
                stack.extend(reversed(children.get((event.tier, block.engine_hash), ())))
            stack.extend(reversed(children.get((event.tier, event.blocks[-1].engine_hash), ())))
        if run is not None:
            merged.append(run)
    return [replace(event, event_id=i) for i, event in enumerate([*merged, *rest])]


def encode_snapshot(stream_seq: int, ranks: Iterable[RankState]) -> bytes:
    """The object's bytes: every rank's batches (of compacted dumps, from ``LocalIndexer.batches``)."""
    body: list[list[Any]] = [[r.worker_id, r.dp_rank, r.last_event_id, list(r.batches)] for r in ranks]
    packed: bytes = msgpack.packb(
        {"v": SNAPSHOT_VERSION, "kind": SNAPSHOT_KIND, "stream_seq": stream_seq, "ranks": body}, use_bin_type=True
    )
    return packed


def decode_snapshot(data: bytes) -> Snapshot:
    """Decode a snapshot object.

    The batches are checked (every event decodes, each batch is the rank's) but kept as bytes.

    Raises:
        BadMessage: not msgpack, not kvrouter's kind or version, or a field or batch that does not decode;
            the message names the field.
    """
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise BadMessage(f"snapshot: not msgpack ({len(data)} bytes): {exc}") from exc
    if not isinstance(body, dict):
        raise BadMessage(f"snapshot: expected a map, got {type(body).__name__}")
    if body.get("kind") != SNAPSHOT_KIND or body.get("v") != SNAPSHOT_VERSION:
        raise BadMessage(
            f"snapshot: kind {body.get('kind')!r} version {body.get('v')!r}, expected {SNAPSHOT_KIND!r} "
            f"version {SNAPSHOT_VERSION}"
        )
    stream_seq = body.get("stream_seq")
    if type(stream_seq) is not int or stream_seq < 0:
        raise BadMessage(f"snapshot: stream_seq must be an integer >= 0, got {stream_seq!r}")
    ranks = body.get("ranks")
    if not isinstance(ranks, list):
        raise BadMessage(f"snapshot: ranks must be a list, got {type(ranks).__name__}")
    decoder = Decoder()
    states: list[RankState] = []
    for i, item in enumerate(ranks):
        where = f"snapshot: ranks[{i}]"
        if not isinstance(item, list) or len(item) != 4:
            raise BadMessage(f"{where}: expected [worker_id, dp_rank, last_event_id, batches]")
        worker_id, dp_rank, last, batches = item
        if type(worker_id) is not int or type(dp_rank) is not int or not (last is None or type(last) is int):
            raise BadMessage(f"{where}: worker_id, dp_rank and last_event_id must be integers")
        if not isinstance(batches, list):
            raise BadMessage(f"{where}: batches must be a list")
        for j, payload in enumerate(batches):
            if not isinstance(payload, bytes):
                raise BadMessage(f"{where}.batches[{j}]: expected bytes")
            try:
                batch = decoder.decode_raw(payload)
            except EventError as exc:
                raise BadMessage(f"{where}.batches[{j}]: {exc}") from exc
            if (batch.worker_id, batch.dp_rank) != (worker_id, dp_rank):
                raise BadMessage(f"{where}.batches[{j}]: a batch of worker {batch.worker_id} dp {batch.dp_rank}")
        states.append(RankState(worker_id, dp_rank, last, tuple(batches)))
    return Snapshot(stream_seq, tuple(states))
