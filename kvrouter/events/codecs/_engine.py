"""What the vLLM and SGLang codecs share: one event parser for both encodings, one re-hash, one writer.

SGLang's publisher began as a copy of vLLM's, so the two wires differ only in facts a table holds:
the positional layout of array-encoded events, the keys a map-encoded event always carries, how
hashes are written (u64 or signed i64), the medium names, and whether a store is one event per block.
Each engine's module states those facts in a :class:`Dialect` and subclasses :class:`EngineDecoder`
and :class:`EngineEncoder`; everything else lives here, once, so a decoding fix reaches both engines.
The cost is one indirection: an array-encoded event is first turned into the name -> value mapping a
map-encoded one already is, instead of a positional reader per version.

Decoding follows Dynamo's ZMQ listener (``lib/kv-router/src/zmq_wire.rs``; ``spec/wire-formats.md``
§3): unknown keys and extra trailing elements are ignored, hashes are cast to u64, events of a
non-main attention group are skipped, and each store's ``token_ids`` are re-hashed into local hashes,
because engine hashes cannot be recomputed (§1.8). Unlike Dynamo, which logs and drops a batch it
cannot read, every malformed input raises :class:`~kvrouter.errors.BadEvent` naming its path.
"""

from __future__ import annotations

import string
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal

import msgpack
import numpy as np
import numpy.typing as npt

from ...errors import BadEvent, EncodeError, InvalidHashInput
from ...hashing import block_hashes_array
from ..model import (
    U64_MAX,
    EngineHash,
    EventBatch,
    KvEvent,
    Removed,
    StorageTier,
    Stored,
    StoredBlock,
)
from ._fields import (
    U32_MAX,
    describe,
    expect_float,
    expect_hash,
    expect_int,
    expect_list,
    expect_opt_str,
    expect_str,
    expect_tier,
    expect_tokens,
    field,
)
from ._prescan import EXT_HASHES, EXT_TOKENS, NEED_ROOM, lift_arrays
from .kvrouter import _CLEARED, _NO_HASHES, _REMOVED, _STORED, RawBatch, RawEvent, _to_model

__all__ = ["Dialect", "EngineDecoder", "EngineEncoder"]

BLOCK_STORED: Final = "BlockStored"
BLOCK_REMOVED: Final = "BlockRemoved"
ALL_BLOCKS_CLEARED: Final = "AllBlocksCleared"

I32_MAX: Final = (1 << 31) - 1
"""Dynamo reads the batch's dp rank as ``Option<i32>``."""

MAIN_ATTENTION_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
"""``kv_cache_spec_kind`` values of the main attention group, whose blocks a router indexes (Dynamo's
``KvCacheSpecKind::is_main_attention``). When an event names its kind, the kind alone decides, as in
Dynamo; otherwise only ``group_idx`` None or 0 is kept. MLA models (DeepSeek) publish ``mla_attention``."""

_NO_TOKENS: Final = np.empty(0, dtype=np.uint32)
_HEX_DIGITS: Final = frozenset(string.hexdigits)
_MM_ID_LEN: Final = 64
"""vLLM's multimodal identifiers in ``extra_keys`` are 64-hex-digit digests; Dynamo keeps the first 16."""


@dataclass(frozen=True, slots=True)
class Dialect:
    """The facts in which one engine's wire differs from the others'."""

    name: str
    """Prefix of every error message: ``"vllm"`` gives ``vllm batch: $[1][0]...``."""
    stored_fields: tuple[str, ...]
    """BlockStored fields after the tag, in declaration order: the positions of the array encoding."""
    removed_fields: tuple[str, ...]
    """BlockRemoved fields after the tag, likewise."""
    stored_map_keys: tuple[str, ...]
    """The keys, in order, the engine writes in a map-encoded BlockStored (defaulted ones are omitted)."""
    removed_map_keys: tuple[str, ...]
    """Likewise for BlockRemoved."""
    fixed_values: Mapping[str, object]
    """Values the encoder writes that the model does not hold (vLLM's ``group_idx`` 0)."""
    mediums: Mapping[StorageTier, str]
    """The encoder's tier -> ``medium``; a tier missing here cannot be sent in this dialect."""
    signed_hashes: bool
    """The encoder writes hashes as signed i64 (SGLang) rather than u64."""
    store_per_block: bool
    """The encoder writes one BlockStored per block, each the parent of the next (SGLang's pages)."""
    extra_keys_salted: bool
    """The engine says a request's LoRA adapter and cache salt in its blocks' ``extra_keys`` (vLLM, whose
    block hashes take both as extra keys: the name on every block, the salt on the first, with ``lora_id``
    beside); otherwise ``lora_id`` stays nil and the salt has a field of its own on every page (SGLang)."""


class EngineDecoder:
    """Turns one engine batch ``[ts, events, dp_rank]`` into a :class:`RawBatch` or an :class:`EventBatch`.

    Engines send neither a worker id nor event ids: the decoder is built with the worker id, and
    numbers the events it returns ``first_event_id``, ``first_event_id + 1``, ... in batch order, so
    the next batch starts at ``first_event_id + len(batch.events)``. Skipped events (another
    attention group) take no number. Every event gets the batch's dp rank (nil or absent: 0).

    :meth:`decode_raw` is the one parser; :meth:`decode` converts its arrays into model objects, so
    the two cannot disagree on anything but representation.
    """

    dialect: ClassVar[Dialect]

    def __init__(self, worker_id: int, block_size: int) -> None:
        """
        Args:
            worker_id: the worker the payloads come from.
            block_size: the router's ``kv_block_size``; blocks of any other size are not indexed.

        Raises:
            InvalidHashInput: ``block_size`` below 1.
        """
        if block_size < 1:
            raise InvalidHashInput(f"{self.dialect.name} decoder: block_size must be >= 1, got {block_size}")
        self.worker_id = worker_id
        self.block_size = block_size
        self._foreign = 0
        """The block size of the last store of another size in the batch being decoded (0: none)."""
        self._salts: dict[int, str] = {}
        """Engine hash -> the cache salt of its chain, for every salted block this stream stored and did not
        remove: a store under one is salted too (see :meth:`_salt`). Empty while no request is salted."""
        d = self.dialect
        self._lift_args = (
            np.frombuffer(b"token_ids", dtype=np.uint8),
            np.frombuffer(b"block_hashes", dtype=np.uint8),
            np.frombuffer(BLOCK_STORED.encode(), dtype=np.uint8),
            np.frombuffer(BLOCK_REMOVED.encode(), dtype=np.uint8),
            1 + d.stored_fields.index("block_hashes"),
            1 + d.stored_fields.index("token_ids"),
            1 + d.removed_fields.index("block_hashes"),
        )
        self._scratch = np.empty(_SCRATCH_BYTES, dtype=np.uint8)
        """Where :func:`lift_arrays` rewrites a payload; grown, never shrunk. Per decoder, so one
        decoder must not be used from two threads at once."""

    @property
    def salted(self) -> bool:
        """Some block this stream stored under a cache salt is still held: a store under it is salted too, which
        only this decoder knows (``events/codecs/runs.py`` leaves such a stream to it)."""
        return bool(self._salts)

    def decode(self, payload: bytes, *, first_event_id: int = 0) -> EventBatch:
        """Decode one payload into model events, numbering them from ``first_event_id``.

        Raises:
            BadEvent: not msgpack, not a batch, or a malformed event; the message names the path,
                e.g. ``vllm batch: $[1][0].block_hashes[2]: expected an integer or bytes hash, got str``.
        """
        raw = self.decode_raw(payload, first_event_id=first_event_id)
        events = tuple(_to_model(event, raw.worker_id, raw.dp_rank) for event in raw.events)
        return EventBatch(events, timestamp=raw.timestamp, dp_rank=raw.dp_rank)

    def decode_raw(self, payload: bytes, *, first_event_id: int = 0) -> RawBatch:
        """Decode one payload into array events (no object per block), numbering them from ``first_event_id``.

        A store's ``engine`` and ``local`` hold one u64 per indexed block and its ``tokens`` those
        blocks' tokens (u32, ``block_size`` a block); removals hold their engine hashes; a cleared
        event is on the device tier, as :class:`Cleared` is. The batch counts the events it skipped
        (another attention group) and the blocks it did not index.

        Raises:
            BadEvent: as :meth:`decode`.
        """
        root = f"{self.dialect.name} batch: $"
        batch = expect_list(self._unpack(payload), root)
        if len(batch) < 2:
            raise BadEvent(f"{root}: expected [ts, events, dp_rank], got an array of {len(batch)} items")
        timestamp = expect_float(batch[0], f"{root}[0]")
        raw_events = expect_list(batch[1], f"{root}[1]")
        rank = batch[2] if len(batch) > 2 else None
        dp_rank = 0 if rank is None else expect_int(rank, f"{root}[2]", hi=I32_MAX)
        events: list[RawEvent] = []
        dropped = 0
        self._foreign = 0
        for i, raw in enumerate(raw_events):  # hot path: one pass per engine event
            event, lost = self._event(raw, f"{root}[1][{i}]", first_event_id + len(events))
            dropped += lost
            if event is not None:
                events.append(event)
        skipped = len(raw_events) - len(events)
        return RawBatch(self.worker_id, dp_rank, timestamp, tuple(events), skipped, dropped, self._foreign)

    def _unpack(self, payload: bytes) -> object:
        """The msgpack tree, each event's integer ``token_ids`` / ``block_hashes`` already a u32 / u64
        array when :mod:`._prescan` could lift it, else as msgpack reads it."""
        buf = np.frombuffer(payload, dtype=np.uint8)
        if self._scratch.size < buf.size + _SCRATCH_BYTES:
            self._scratch = np.empty(2 * buf.size + _SCRATCH_BYTES, dtype=np.uint8)
        size = lift_arrays(buf, self._scratch, *self._lift_args)
        if size == NEED_ROOM:  # lifted words take at most 8 bytes per msgpack byte
            self._scratch = np.empty(8 * buf.size + _SCRATCH_BYTES, dtype=np.uint8)
            size = lift_arrays(buf, self._scratch, *self._lift_args)
        if size >= 0:
            try:
                return msgpack.unpackb(self._scratch[:size], raw=False, strict_map_key=False, ext_hook=_lifted)
            except Exception:  # read the original payload below, so its own error is the one raised
                pass
        try:
            return msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises ValueError, TypeError and its own types for bad bytes
            raise BadEvent(f"{self.dialect.name} batch: not msgpack: {exc}") from exc

    def _event(self, raw: object, where: str, event_id: int) -> tuple[RawEvent | None, int]:
        """The event (None: another attention group) and how many of its blocks were not indexed."""
        tag, fields = self._fields(raw, where)
        if tag == BLOCK_STORED:
            return self._stored(fields, where, event_id)
        if tag == BLOCK_REMOVED:
            hashes = _hashes(field(fields, "block_hashes", where), f"{where}.block_hashes")
            tier = expect_tier(fields.get("medium"), f"{where}.medium")
            if not _main_attention(fields, where):
                return None, 0
            if self._salts:
                for gone in hashes.tolist():
                    self._salts.pop(gone, None)
            return RawEvent(_REMOVED, event_id, tier, None, hashes, _NO_HASHES, None), 0
        if tag == ALL_BLOCKS_CLEARED:
            self._salts.clear()
            return RawEvent(_CLEARED, event_id, StorageTier.DEVICE, None, _NO_HASHES, _NO_HASHES, None), 0
        raise BadEvent(
            f"{where}: unknown event type {tag!r}; expected "
            f"{BLOCK_STORED!r}, {BLOCK_REMOVED!r} or {ALL_BLOCKS_CLEARED!r}"
        )

    def _fields(self, raw: object, where: str) -> tuple[str, Mapping[Any, Any]]:
        """The event's tag and its fields by name, from a ``"type"`` map or a tag-first array.

        Array positions beyond the dialect's layout are ignored; positions an older engine did not
        send are simply absent, so a missing required field reads the same in both encodings.
        """
        if isinstance(raw, dict):
            return expect_str(field(raw, "type", where), f"{where}.type"), raw
        if isinstance(raw, list | tuple):
            if not raw:
                raise BadEvent(f"{where}: empty event array; expected the event type first")
            tag = expect_str(raw[0], f"{where}[0]")
            layout = {BLOCK_STORED: self.dialect.stored_fields, BLOCK_REMOVED: self.dialect.removed_fields}
            return tag, dict(zip(layout.get(tag, ()), raw[1:], strict=False))
        raise BadEvent(f"{where}: expected an event map or array, got {describe(raw)}")

    def _stored(self, fields: Mapping[Any, Any], where: str, event_id: int) -> tuple[RawEvent | None, int]:
        hashes = _hashes(field(fields, "block_hashes", where), f"{where}.block_hashes")
        parent_raw = fields.get("parent_block_hash")
        parent = None if parent_raw is None else expect_hash(parent_raw, f"{where}.parent_block_hash")
        tokens, eagle = _token_ids(field(fields, "token_ids", where), f"{where}.token_ids")
        size = expect_int(field(fields, "block_size", where), f"{where}.block_size")
        lora_name = expect_opt_str(fields.get("lora_name"), f"{where}.lora_name")
        extra_keys = fields.get("extra_keys")
        mm_infos = _mm_infos(extra_keys, f"{where}.extra_keys")
        salt = self._salt(fields, parent, extra_keys, lora_name, where)
        tier = expect_tier(fields.get("medium"), f"{where}.medium")
        if not _main_attention(fields, where):
            return None, 0
        if size != self.block_size:
            # Blocks of another size ("Block not published" in Dynamo) go, and with them every later one
            # of the event: here that is all of them, since one event has one block_size.
            self._foreign = size  # named to the operator (the service's trust.py)
            return RawEvent(_STORED, event_id, tier, parent, _NO_HASHES, _NO_HASHES, _NO_TOKENS), len(hashes)
        try:
            local = block_hashes_array(
                tokens, size, lora_name=lora_name, cache_namespace=salt, mm_infos=mm_infos, eagle=eagle
            )
        except InvalidHashInput as exc:  # tokens are checked already; kept so nothing else escapes
            raise BadEvent(f"{where}.token_ids: {exc}") from exc
        # Blocks past the last full block of tokens are dropped, as Dynamo does ("token_ids too short");
        # tokens beyond the last hash are ignored.
        count = min(len(hashes), len(local))
        if salt:
            self._salts.update(dict.fromkeys(hashes[:count].tolist(), salt))
        event = RawEvent(_STORED, event_id, tier, parent, hashes[:count], local[:count], tokens[: count * size])
        return event, len(hashes) - count

    def _salt(
        self, fields: Mapping[Any, Any], parent: int | None, extra_keys: object, lora_name: str | None, where: str
    ) -> str | None:
        """The cache salt a store's blocks were computed with: the router hashes them with it
        (``cache_namespace``), as it hashes a request that names it, so a salted request matches its own
        blocks and no other request does.

        Engines differ in where they say it. SGLang names it on every page (``cache_salt``). vLLM mixes it
        into the extra keys of a request's first block only (``generate_block_hash_extra_keys``: LoRA name,
        multimodal keys, the salt, prompt-embed digests), and a later block is salted through its parent's
        hash: so a root store's salt is the last string of its first block's extra keys that is neither the
        LoRA name nor a multimodal identifier, and a store under a salted block inherits its salt
        (``_salts``). The cost: one dict per stream, holding only salted blocks. What it cannot tell: a
        64-hex-digit salt under vLLM's pre-0.19 multimodal keys, which looks like one (read as multimodal,
        as before). Dynamo hashes neither, so a salted request there never matches its own blocks and an
        unsalted one matches blocks the engine will not give it.
        """
        if not self.dialect.extra_keys_salted:
            return expect_opt_str(fields.get("cache_salt"), f"{where}.cache_salt") or None
        if parent is None:
            if isinstance(extra_keys, list | tuple) and extra_keys and isinstance(extra_keys[0], list | tuple):
                first = list(extra_keys[0])
                keys = first[1:] if lora_name and first[:1] == [lora_name] else first
                texts = [k for k in keys if isinstance(k, str) and k and _mm_hash(k) is None]
                return texts[-1] if texts else None
            return None
        return self._salts.get(parent) if self._salts else None


_SCRATCH_BYTES: Final = 1 << 16
"""A decoder's first rewrite buffer, and the slack it keeps above a payload's size."""


def _lifted(code: int, data: bytes) -> object:
    """``ext_hook`` for payloads rewritten by :func:`lift_arrays` (which holds no ext of its own)."""
    if code == EXT_TOKENS:
        return np.frombuffer(data, dtype="<u4")
    if code == EXT_HASHES:
        return np.frombuffer(data, dtype="<u8")
    return msgpack.ExtType(code, data)


def _hashes(value: object, where: str) -> npt.NDArray[np.uint64]:
    if isinstance(value, np.ndarray):  # lifted: every element an integer, cast to u64 (expect_hash's cast)
        return value
    items = expect_list(value, where)
    return np.array([expect_hash(h, f"{where}[{j}]") for j, h in enumerate(items)], dtype=np.uint64)


def _main_attention(fields: Mapping[Any, Any], where: str) -> bool:
    """Whether the event belongs to the main attention group (see :data:`MAIN_ATTENTION_KINDS`)."""
    group_raw = fields.get("group_idx")
    group = None if group_raw is None else expect_int(group_raw, f"{where}.group_idx", hi=U32_MAX)
    kind = expect_opt_str(fields.get("kv_cache_spec_kind"), f"{where}.kv_cache_spec_kind")
    if kind is not None:
        return kind in MAIN_ATTENTION_KINDS
    return group in (None, 0)


def _token_ids(value: object, where: str) -> tuple[npt.NDArray[np.uint32], bool]:
    """Plain token ids, or SGLang's EAGLE bigram keys ``[[t0, t1], [t1, t2], ...]``.

    Bigram pairs become the first token of each pair plus the last pair's second, hashed with
    ``eagle=True`` (windows of ``block_size + 1`` tokens). Inferred, not captured: this is how
    Dynamo's decoder reads them (``KvTokenIds::Bigram`` in ``zmq_wire.rs``); the fixtures carry no
    EAGLE batch. An array whose first element is an array is read as pairs.

    Returns:
        The tokens and whether they came from bigram pairs.
    """
    if isinstance(value, np.ndarray):  # lifted: integers in u32, what expect_tokens accepts
        return value, False
    items = expect_list(value, where)
    if not items or not isinstance(items[0], list | tuple):
        return np.frombuffer(expect_tokens(items, where), dtype=np.uint32), False
    firsts: list[int] = []
    last = 0
    for j, raw in enumerate(items):
        pair = expect_list(raw, f"{where}[{j}]")
        if len(pair) != 2:
            raise BadEvent(f"{where}[{j}]: expected an EAGLE [token, next token] pair, got {len(pair)} items")
        firsts.append(expect_int(pair[0], f"{where}[{j}][0]", hi=U32_MAX))
        last = expect_int(pair[1], f"{where}[{j}][1]", hi=U32_MAX)
    return np.array([*firsts, last], dtype=np.uint32), True


def _mm_infos(value: object, where: str) -> list[dict[str, Any] | None] | None:
    """vLLM's per-block ``extra_keys`` as the hasher's per-block multimodal infos.

    ``extra_keys`` mixes multimodal identifiers with LoRA names, cache salts and prompt-embed
    digests; as in Dynamo (``extra_keys_to_block_mm_infos``), only 64-hex-digit strings, alone or as
    ``[identifier, offset]``, are multimodal, and each contributes ``int(first 16 hex digits, 16)``.

    Returns:
        One entry per block (None: no multimodal content), or None when no block has any.
    """
    if value is None:
        return None
    infos: list[dict[str, Any] | None] = []
    for j, keys in enumerate(expect_list(value, where)):
        mm = [] if keys is None else [h for h in map(_mm_hash, expect_list(keys, f"{where}[{j}]")) if h is not None]
        infos.append({"mm_objects": [{"mm_hash": h, "offsets": []} for h in mm]} if mm else None)
    return infos if any(infos) else None


def _mm_hash(key: object) -> int | None:
    if isinstance(key, list | tuple) and len(key) == 2:
        key = key[0]  # (identifier, block-relative offset), vLLM 0.19+
    if isinstance(key, str) and len(key) == _MM_ID_LEN and _HEX_DIGITS.issuperset(key):
        return int(key[:16], 16)
    return None


class EngineEncoder:
    """Writes batches as the engine's own publisher does, for the mock engine and for tests.

    The wire has no worker id, event ids or local hashes: a decoder takes the worker id as given,
    renumbers events and re-hashes the tokens (with the store's LoRA name and cache salt, written where the
    engine writes them), so every block must carry its ``token_ids``. The model holds no multimodal keys,
    so a multimodal block's local hash does not survive the trip; any other does, exactly.
    """

    dialect: ClassVar[Dialect]

    def __init__(self, encoding: Literal["map", "array"] = "map") -> None:
        """
        Args:
            encoding: ``"map"``, events as ``"type"``-tagged maps (vLLM >= 0.24, SGLang >= 0.5.20), or
                ``"array"``, tag-first positional arrays (vLLM <= 0.23, SGLang <= 0.5.18).

        Raises:
            EncodeError: any other ``encoding``.
        """
        if encoding not in ("map", "array"):
            raise EncodeError(f"{self.dialect.name} encoder: unknown encoding {encoding!r}; use 'map' or 'array'")
        self.encoding = encoding

    def encode(self, batch: EventBatch) -> bytes:
        """Encode one batch; ``timestamp`` None is stamped with the current time, as publishers do.

        Raises:
            EncodeError: events of several workers or of another dp rank than the batch's, a block
                without token ids, blocks of unequal sizes in one store, or a tier the engine has no
                medium for.
        """
        name = self.dialect.name
        if len({e.worker_id for e in batch.events}) > 1:
            raise EncodeError(f"{name} encode: an engine batch holds one worker's events")
        wire: list[object] = []
        for i, event in enumerate(batch.events):
            where = f"{name} encode: event {i}"
            if event.dp_rank != batch.dp_rank:
                raise EncodeError(f"{where}: dp rank {event.dp_rank} differs from the batch's {batch.dp_rank}")
            wire.extend(self._events(event, where))
        timestamp = time.time() if batch.timestamp is None else batch.timestamp
        packed: bytes = msgpack.packb([timestamp, wire, batch.dp_rank], use_bin_type=True)
        return packed

    def _events(self, event: KvEvent, where: str) -> list[object]:
        d = self.dialect
        if isinstance(event, Stored):
            medium = self._medium(event.tier, where)
            if d.store_per_block and len(event.blocks) > 1:
                parents = [event.parent, *(b.engine_hash for b in event.blocks[:-1])]
                pages = [(parent, (block,)) for parent, block in zip(parents, event.blocks, strict=True)]
                return [self._stored(parent, blocks, medium, event, where) for parent, blocks in pages]
            return [self._stored(event.parent, event.blocks, medium, event, where)]
        if isinstance(event, Removed):
            values = {
                "block_hashes": [self._hash(h) for h in event.engine_hashes],
                "medium": self._medium(event.tier, where),
            }
            return [self._write(BLOCK_REMOVED, values, d.removed_fields, d.removed_map_keys)]
        return [self._write(ALL_BLOCKS_CLEARED, {}, (), ())]

    def _stored(
        self, parent: EngineHash | None, blocks: Sequence[StoredBlock], medium: str, event: Stored, where: str
    ) -> object:
        tokens: list[int] = []
        sizes = set()
        for j, block in enumerate(blocks):
            if block.token_ids is None:
                raise EncodeError(f"{where}: block {j} has no token_ids; engine events carry tokens")
            tokens.extend(block.token_ids)
            sizes.add(len(block.token_ids))
        if len(sizes) > 1:
            raise EncodeError(f"{where}: blocks of one store have unequal token counts {sorted(sizes)}")
        values: dict[str, object] = {
            "block_hashes": [self._hash(b.engine_hash) for b in blocks],
            "parent_block_hash": None if parent is None else self._hash(parent),
            "token_ids": tokens,
            "block_size": sizes.pop() if sizes else 0,
            "medium": medium,
            "lora_name": event.lora_name,
            "cache_salt": event.cache_salt,
        }
        if self.dialect.extra_keys_salted and (event.lora_name is not None or event.cache_salt is not None):
            lora = [] if event.lora_name is None else [event.lora_name]
            keys: list[list[str] | None] = [lora or None for _ in blocks]
            if event.cache_salt is not None and parent is None:  # a request's first block, as vLLM salts it
                keys[0] = [*lora, event.cache_salt]
            values["extra_keys"] = keys if any(keys) else None
            if event.lora_name is not None:
                values["lora_id"] = event.lora_id
        return self._write(BLOCK_STORED, values, self.dialect.stored_fields, self.dialect.stored_map_keys)

    def _write(self, tag: str, values: Mapping[str, object], fields: Sequence[str], map_keys: Sequence[str]) -> object:
        """One event in the chosen encoding, its fields in declaration order; fields with no value are written
        as nil in an array, and in a map only among ``map_keys`` (what the engine always writes; others it
        omits while they are nil)."""
        merged = {**self.dialect.fixed_values, **values}
        if self.encoding == "array":
            return [tag, *(merged.get(name) for name in fields)]
        return {
            "type": tag,
            **{key: merged.get(key) for key in fields if key in map_keys or merged.get(key) is not None},
        }

    def _medium(self, tier: StorageTier, where: str) -> str:
        medium = self.dialect.mediums.get(tier)
        if medium is None:
            known = ", ".join(t.value for t in self.dialect.mediums)
            raise EncodeError(f"{where}: tier {tier.value!r} has no {self.dialect.name} medium; expected {known}")
        return medium

    def _hash(self, value: int) -> int:
        if self.dialect.signed_hashes and value > U64_MAX >> 1:
            return value - (1 << 64)
        return value
