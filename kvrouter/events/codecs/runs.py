"""The batch path's decoder: a drain of one stream's messages into an apply run, in one call, no objects.

Why: the Python decoders (``_engine.py``, ``kvrouter.py``) cost tens of µs a message (74-80 µs for a vLLM
message of 82 blocks, whose tokens it re-hashes), and the objects they build cost as much again in the
applier (``RawEvent``, ``Unit``, a run packed per message). :class:`RunDecoder` hands a whole drain of a
stream's payloads, joined, to one numba call: ``_runs_engine.py`` for vLLM (both encodings) and SGLang,
``_runs_kvrouter.py`` for kvrouter batches. It checks that the ids run on from the stream's cursor, parses the
msgpack (``_msgpack.py``), re-hashes each engine store's tokens into local hashes
(:func:`~kvrouter.hashing._xxh3.hash_blocks`), and writes every event into the run arrays of
``events/packed.py``, ready for the table kernels (``ShardWriter.apply_packed``).

It decodes only what it decodes exactly as the Python decoder would, and gives up on a message at the first
thing it does not (a LoRA name, extra keys, a cache salt, EAGLE pairs, a block size not the router's, a store
with blocks past its tokens, an empty store or removal, an unknown medium or tag, another worker or dp rank,
a map or an ext value or a non-ASCII string anywhere, a duplicate key, trailing bytes, an id out of order).
It never reports an error: a message it gives up on goes to the stream's per-message path, which applies it,
counts it or recovers, so the error messages and counters of bad input cannot differ. The messages before
it are kept. ``tests/plane/test_batch_path.py`` holds both paths equal on generated drains.

Rejected alternative: a complete decoder, errors included, in numba. It would hold a second copy of every
field check and message; the cost of giving up is one wasted parse of a message that is rare by nature.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Final

import numpy as np
import numpy.typing as npt

from ..model import TIER_NAMES
from ._engine import Dialect
from ._runs_common import C_EVENTS, C_LAST, C_MIXED, C_NEXT, C_SKIPPED, COUNT_WORDS, DONE, GAVE_UP, NEED_ROOM
from ._runs_engine import ENGINE_NAMES, FIELDS, decode_engine_runs
from ._runs_kvrouter import KVROUTER_NAMES, decode_kvrouter_runs

__all__ = ["C_EVENTS", "C_MIXED", "C_NEXT", "C_SKIPPED", "DONE", "GAVE_UP", "NEED_ROOM", "RunBuffers", "RunDecoder"]

INITIAL_EVENTS: Final = 1 << 12
INITIAL_BLOCKS: Final = 1 << 16
"""An applier's first run arrays: a drain of 256 vLLM messages of 80 blocks fits (1 MiB of hashes)."""
KVROUTER_LEAST: Final = 2
"""A drain of one kvrouter message is read one by one: its Python decode (msgpack and a ``frombuffer`` per
hash array) costs less than this path's fixed cost a drain, about 10 µs of argument checks and array
slicing (a one-message drain of 80 blocks: 46 µs this way, 36 the other; an engine message, whose Python
decode re-hashes its tokens, is cheaper here even alone: 48 µs against 58)."""


class RunNames:
    """The strings a kernel compares, as arrays it can take: every name, concatenated, with its bounds; each
    medium's tier rank; and an engine dialect's array layouts as field codes (-1: a position not read)."""

    def __init__(self, names: tuple[str, ...], dialect: Dialect | None = None) -> None:
        encoded = [name.encode() for name in names]
        self.names = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self.bounds = np.cumsum([0, *map(len, encoded)]).astype(np.int64)
        self.tiers = np.array([tier.rank for tier in TIER_NAMES.values()], dtype=np.int64)
        self.stored = _layout(dialect.stored_fields if dialect else ())
        self.removed = _layout(dialect.removed_fields if dialect else ())
        self.salted = bool(dialect and dialect.extra_keys_salted)


def _layout(fields: tuple[str, ...]) -> npt.NDArray[np.int64]:
    return np.array([FIELDS.index(f) if f in FIELDS else -1 for f in fields], dtype=np.int64)


_NAMES_BY_WIRE: dict[str, RunNames] = {}
"""Each wire's :class:`RunNames`, made once (by the dialect's name, or ``kvrouter``): every stream of that wire
reads the same arrays."""


def _names_of(dialect: Dialect | None) -> RunNames:
    wire = dialect.name if dialect else "kvrouter"
    names = _NAMES_BY_WIRE.get(wire)
    if names is None:
        names = _NAMES_BY_WIRE[wire] = RunNames(ENGINE_NAMES if dialect else KVROUTER_NAMES, dialect)
    return names


class RunBuffers:
    """The arrays an applier decodes its drains into: the drain's payloads joined, and the run. One set for
    every stream of the applier, which decodes and applies one drain at a time; kept and grown, never shrunk,
    so a drain allocates nothing once the applier is warm, and a fleet of thousands of workers costs one
    set, not one each."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)
        self.bounds = np.zeros(1, dtype=np.int64)
        self.seqs = np.empty(0, dtype=np.uint64)
        self.stamps = np.empty(0, dtype=np.float64)
        self.tokens = np.empty(0, dtype=np.uint32)
        self.fields = np.empty(len(FIELDS), dtype=np.int64)
        self.word = np.zeros(1, dtype=np.uint64)
        self.real = self.word.view(np.float64)
        self.counts = np.zeros(COUNT_WORDS, dtype=np.int64)
        self.grow(INITIAL_EVENTS, INITIAL_BLOCKS)

    def grow(self, events: int, blocks: int) -> None:
        self.kinds = np.empty(events, dtype=np.uint8)
        self.tiers = np.empty(events, dtype=np.uint8)
        self.parents = np.zeros(events, dtype=np.uint64)
        self.offsets = np.empty(events + 1, dtype=np.int64)
        self.engine = np.empty(blocks, dtype=np.uint64)
        self.local = np.empty(blocks, dtype=np.uint64)

    def load(self, payloads: list[bytes], seqs: list[int], *, tokens: bool) -> None:
        """A drain's payloads, in order, with their ZMQ sequence numbers; ``tokens``: its messages carry token
        ids to re-hash. The joined payloads are writable, as the receive's buffer is (``plane/receive.py``):
        numba compiles a kernel once per array type, and a read-only one would be compiled again, in each
        applier, on its first drain."""
        self.buf = np.frombuffer(bytearray(b"".join(payloads)), dtype=np.uint8)
        lengths = list(map(len, payloads))
        self.bounds = np.fromiter(accumulate(lengths, initial=0), dtype=np.int64, count=len(payloads) + 1)
        self.seqs = np.array(seqs, dtype=np.uint64)
        if self.stamps.size < len(payloads):
            self.stamps = np.empty(2 * len(payloads), dtype=np.float64)
        longest = max(lengths, default=0)
        if tokens and self.tokens.size < longest:  # a token takes a byte or more of its message
            self.tokens = np.empty(2 * longest, dtype=np.uint32)


class RunDecoder:
    """One stream's compiled decoding, into its applier's :class:`RunBuffers`.

    Args:
        dialect: the engine's (``vllm.Decoder.dialect``, ``sglang.Decoder.dialect``), or None for kvrouter
            batches.
        worker_id: the stream's worker (kvrouter batches name theirs; engine batches do not).
        rank: the stream's dp rank: a batch naming another is left to the stream.
        block_size: the router's; an engine store of another size is left to the stream.
        buffers: the applier's.
    """

    def __init__(
        self, dialect: Dialect | None, worker_id: int, rank: int, block_size: int, buffers: RunBuffers
    ) -> None:
        self._dialect = dialect
        self.least = 1 if dialect else KVROUTER_LEAST
        """The fewest messages a drain needs for this path to pay (``on_drain`` reads smaller ones one by one)."""
        self._names = _names_of(dialect)
        self.worker_id = np.uint64(worker_id)
        self.rank = rank
        self.block_size = block_size
        self.buffers = buffers

    def load(self, payloads: list[bytes], seqs: list[int]) -> None:
        """The drain's payloads, in order, with their ZMQ sequence numbers (an empty payload: a message this
        path must leave to the stream)."""
        self.buffers.load(payloads, seqs, tokens=self._dialect is not None)

    def decode(self, first: int, expected: int) -> int:
        """Decode from message ``first``, whose first id must be ``expected`` (the ZMQ sequence number for an
        engine, the event id for kvrouter batches), while the ids follow on, as far as the run arrays allow
        (:data:`DONE`, :data:`GAVE_UP` or :data:`NEED_ROOM`; ``buffers.counts`` says how far, :meth:`last`
        the last id taken). A message that alone does not fit grows the arrays, so a call always makes
        progress or gives up."""
        b = self.buffers
        while True:
            status = self._call(first, expected)
            if status != NEED_ROOM or b.counts[C_NEXT] > first:
                return status
            size = int(b.bounds[first + 1] - b.bounds[first])  # one hash or event takes a byte or more
            b.grow(max(2 * b.kinds.size, size), max(2 * b.engine.size, size))

    def last(self) -> int:
        """The id of the last message (engines) or event (kvrouter) the run holds."""
        b = self.buffers
        if self._dialect is None:
            return int(b.counts[C_LAST]) % (1 << 64)
        return int(b.seqs[b.counts[C_NEXT] - 1])

    def _call(self, first: int, expected: int) -> int:
        n, b = self._names, self.buffers
        if self._dialect is None:
            return decode_kvrouter_runs(
                b.buf,
                b.bounds,
                first,
                np.uint64(expected),
                n.names,
                n.bounds,
                n.tiers,
                self.worker_id,
                self.rank,
                b.kinds,
                b.tiers,
                b.parents,
                b.offsets,
                b.engine,
                b.local,
                b.stamps,
                b.fields,
                b.word,
                b.real,
                b.counts,
            )
        return decode_engine_runs(
            b.buf,
            b.bounds,
            first,
            b.seqs,
            np.uint64(expected),
            n.names,
            n.bounds,
            n.tiers,
            n.stored,
            n.removed,
            n.salted,
            self.block_size,
            self.rank,
            b.kinds,
            b.tiers,
            b.parents,
            b.offsets,
            b.engine,
            b.local,
            b.tokens,
            b.stamps,
            b.fields,
            b.word,
            b.real,
            b.counts,
        )
