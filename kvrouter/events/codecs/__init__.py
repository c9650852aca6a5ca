"""One codec per wire format, all behind the same two names: ``Decoder.decode`` and ``Encoder.encode``.

| module      | wire format                                                                 |
|-------------|-----------------------------------------------------------------------------|
| ``kvrouter`` | kvrouter's own msgpack batches (local hashes precomputed; ``docs/wire-format.md``) |
| ``vllm``    | vLLM ``KVEventBatch``: positional arrays (<= 0.23) and ``"type"`` maps (>= 0.24) |
| ``sglang``  | SGLang's batches (one BlockStored per page, signed hashes, ``attn_dp_rank``)  |
| ``dynamo``  | the reference's JSON ``KvCacheEvent`` / ``RouterEvent``                       |

Each module's ``Decoder`` is built with what the wire does not say (worker id, block size) and turns
one payload into an :class:`~kvrouter.events.model.EventBatch`; its ``Encoder`` does the reverse.
Malformed input raises :class:`~kvrouter.errors.BadEvent` naming what was wrong and where; nothing
else escapes a decoder. ZMQ framing (topic, sequence number, replay envelopes) is shared by all, in
:mod:`kvrouter.events.codecs.frames`. The query protocol of kvrouter workers' local indexers (how a
router recovers missed events from them) is in :mod:`kvrouter.events.codecs.query`.
"""

from __future__ import annotations

from typing import Protocol

from ..model import EventBatch

__all__ = ["BatchDecoder", "BatchEncoder"]


class BatchDecoder(Protocol):
    def decode(self, payload: bytes, *, first_event_id: int = 0) -> EventBatch:
        """Decode one payload. Engines send no event ids, so their events are numbered from
        ``first_event_id`` on; formats that carry ids (kvrouter, dynamo) keep their own."""
        ...


class BatchEncoder(Protocol):
    def encode(self, batch: EventBatch) -> bytes: ...
