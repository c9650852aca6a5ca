"""The batch path's decoder of engine batches (vLLM in both encodings, SGLang): ``runs.py`` says why and
what it leaves to the Python decoder (``_engine.py``), whose reading it copies field for field."""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from ..._jit import kernel
from ...hashing._xxh3 import hash_blocks
from ...hashing.blocks import XXH3_SEED
from ..model import TIER_NAMES
from ..packed import CLEARED, REMOVED, STORED, STORED_UNDER
from ._engine import I32_MAX, MAIN_ATTENTION_KINDS
from ._fields import U32_MAX
from ._msgpack import (
    NIL,
    Bytes,
    header,
    name_index,
    nil_or_nils,
    read_hashes,
    read_int,
    read_number,
    read_tokens,
    skip,
)
from ._runs_common import DONE, GAVE_UP, NEED_ROOM, finish

__all__ = ["ENGINE_NAMES", "FIELDS", "decode_engine_runs"]

F_TYPE, F_HASHES, F_PARENT, F_TOKENS, F_SIZE, F_LORA_NAME, F_EXTRA_KEYS, F_MEDIUM = 0, 1, 2, 3, 4, 5, 6, 7
F_GROUP, F_KIND, F_SALT = 8, 9, 10
FIELDS: Final = (
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_name",
    "extra_keys",
    "medium",
    "group_idx",
    "kv_cache_spec_kind",
    "cache_salt",
)
"""The fields this pass reads, by their ``F_*`` code; any other key is skipped, as the Python decoder
ignores it."""
TAGS: Final = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
T_STORED, T_REMOVED, T_CLEARED = len(FIELDS), len(FIELDS) + 1, len(FIELDS) + 2
MAIN_KINDS_AT: Final = len(FIELDS) + len(TAGS)
TIERS_AT: Final = MAIN_KINDS_AT + len(MAIN_ATTENTION_KINDS)
ENGINE_NAMES: Final = (*FIELDS, *TAGS, *sorted(MAIN_ATTENTION_KINDS), *TIER_NAMES)
_SEED: Final = np.uint64(XXH3_SEED)
"""The hashing seed of a block with neither LoRA name nor salt: all this pass hashes."""


@kernel
def _field(
    msg: Bytes,
    pos: int,
    code: int,
    tokens: npt.NDArray[np.uint32],
    engine: npt.NDArray[np.uint64],
    at: int,
    ntokens: int,
    nhashes: int,
) -> tuple[int, int, int]:
    """Read the value at ``pos`` of the field ``code`` (``F_*``; -1: one not read): the token ids into
    ``tokens``, the hashes into ``engine[at:]``, anything else skipped. Returns the position after it (-1:
    not a value this pass takes; -2: no room in ``engine``) and the token and hash counts so far."""
    if code == F_TOKENS:
        pos, ntokens = read_tokens(msg, pos, tokens)
    elif code == F_HASHES:
        pos, nhashes = read_hashes(msg, pos, engine, at)
    else:
        pos = skip(msg, pos)
    return pos, ntokens, nhashes


@kernel
def decode_engine_runs(
    buf: Bytes,
    bounds: npt.NDArray[np.int64],
    first: int,
    seqs: npt.NDArray[np.uint64],
    expected: np.uint64,
    names: Bytes,
    name_bounds: npt.NDArray[np.int64],
    tier_ranks: npt.NDArray[np.int64],
    stored_layout: npt.NDArray[np.int64],
    removed_layout: npt.NDArray[np.int64],
    salted: bool,
    block_size: int,
    rank: int,
    kinds: npt.NDArray[np.uint8],
    tiers: npt.NDArray[np.uint8],
    parents: npt.NDArray[np.uint64],
    offsets: npt.NDArray[np.int64],
    engine: npt.NDArray[np.uint64],
    local: npt.NDArray[np.uint64],
    tokens: npt.NDArray[np.uint32],
    stamps: npt.NDArray[np.float64],
    fields: npt.NDArray[np.int64],
    word: npt.NDArray[np.uint64],
    real: npt.NDArray[np.float64],
    counts: npt.NDArray[np.int64],
) -> int:
    """Decode messages ``first``, ``first + 1``, ... (``buf[bounds[m]:bounds[m + 1]]``, engine batches
    ``[ts, events, dp_rank]`` of one worker's dp rank ``rank``, whose ZMQ sequence numbers ``seqs[m]`` must
    run on from ``expected``) into the run arrays, from their start.

    ``stamps[m]`` gets message ``m``'s timestamp. ``tokens`` must hold the tokens of any one event (as
    many words as the longest message has bytes will do); ``fields`` is scratch of ``len(FIELDS)`` words.
    ``counts`` (``C_*``) tells how far it got. Returns :data:`DONE`, :data:`GAVE_UP` or :data:`NEED_ROOM`;
    on either of the last two, the run holds exactly the messages before ``counts[C_NEXT]``.
    """
    n_events = 0
    n_blocks = 0
    n_local = 0
    n_skipped = 0
    offsets[0] = 0
    status = DONE
    m = first
    while m < bounds.size - 1:
        msg = buf[bounds[m] : bounds[m + 1]]
        events, blocks, nlocal, skipped = n_events, n_blocks, n_local, n_skipped
        status = GAVE_UP  # until the message is through
        if seqs[m] != expected + np.uint64(m - first):  # out of order: the stream's own logic reads it
            break
        kind, count, head = header(msg, 0)
        if kind != 1 or count < 2 or count > 3:
            break
        pos, stamp = read_number(msg, head, word, real)
        if pos < 0:
            break
        kind, n, head = header(msg, pos)
        if kind != 1:
            break
        pos += head
        ok = True
        for _ in range(n):  # hot path: one engine event
            kind, nfields, head = header(msg, pos)
            fields[:] = -1
            tag = -1
            ntokens = 0
            nhashes = 0
            if kind == 2:
                pos += head
                for _ in range(nfields):
                    code = name_index(msg, pos, names, name_bounds, 0, len(FIELDS))
                    if code == -2:
                        ok = False
                        break
                    pos = skip(msg, pos)
                    if pos < 0:
                        ok = False
                        break
                    if code >= 0:
                        if fields[code] >= 0:
                            ok = False  # a duplicate key: the Python decoder keeps the last
                            break
                        fields[code] = pos
                    pos, ntokens, nhashes = _field(msg, pos, code, tokens, engine, n_blocks, ntokens, nhashes)
                    if pos < 0:
                        status = NEED_ROOM if pos == -2 else GAVE_UP
                        ok = False
                        break
                if not ok or fields[F_TYPE] < 0:
                    ok = False
                    break
                tag = name_index(msg, fields[F_TYPE], names, name_bounds, T_STORED, T_CLEARED + 1)
            elif kind == 1 and nfields > 0:
                pos += head
                tag = name_index(msg, pos, names, name_bounds, T_STORED, T_CLEARED + 1)
                pos = skip(msg, pos)
                layout = stored_layout if tag == T_STORED else removed_layout
                for k in range(nfields - 1):
                    if pos < 0:
                        break
                    code = layout[k] if tag != T_CLEARED and k < layout.size else -1
                    if code >= 0:
                        fields[code] = pos
                    pos, ntokens, nhashes = _field(msg, pos, code, tokens, engine, n_blocks, ntokens, nhashes)
                if pos < 0:
                    status = NEED_ROOM if pos == -2 else GAVE_UP
                    ok = False
                    break
            if tag < 0:
                ok = False
                break
            if n_events >= kinds.size:
                status = NEED_ROOM
                ok = False
                break
            if tag == T_CLEARED:
                kinds[n_events] = CLEARED
                tiers[n_events] = 0
                n_events += 1
                offsets[n_events] = n_blocks
                continue
            # The main attention group (``_engine._main_attention``): a kind, when named, decides alone.
            at = fields[F_GROUP]
            group = 0
            if at >= 0 and msg[at] != NIL:
                after, value, negative = read_int(msg, at)
                if after < 0 or negative or value > np.uint64(U32_MAX):
                    ok = False
                    break
                group = int(value)
            at = fields[F_KIND]
            main = group == 0
            if at >= 0 and msg[at] != NIL:
                which = name_index(msg, at, names, name_bounds, MAIN_KINDS_AT, TIERS_AT)
                if which == -2:
                    ok = False
                    break
                main = which >= 0
            at = fields[F_MEDIUM]
            tier = 0
            if at >= 0 and msg[at] != NIL:
                which = name_index(msg, at, names, name_bounds, TIERS_AT, name_bounds.size - 1)
                if which < 0:
                    ok = False
                    break
                tier = tier_ranks[which - TIERS_AT]
            if fields[F_HASHES] < 0 or nhashes == 0:  # read in place above, into engine[n_blocks:]
                ok = False
                break
            if tag == T_REMOVED:
                if main:
                    kinds[n_events] = REMOVED
                    tiers[n_events] = tier
                    n_blocks += nhashes
                    n_events += 1
                    offsets[n_events] = n_blocks
                else:
                    n_skipped += 1
                continue
            # A store: only one hashed with the plain seed, whose every block has its tokens.
            if fields[F_TOKENS] < 0 or fields[F_SIZE] < 0:
                ok = False
                break
            if fields[F_LORA_NAME] >= 0 and msg[fields[F_LORA_NAME]] != NIL:
                ok = False
                break
            if not nil_or_nils(msg, fields[F_EXTRA_KEYS]):
                ok = False
                break
            at = fields[F_SALT]
            if not salted and at >= 0 and msg[at] != NIL and msg[at] != 0xA0:  # nil or "": no salt
                ok = False
                break
            after, size, negative = read_int(msg, fields[F_SIZE])
            if after < 0 or negative or int(size) != block_size:
                ok = False
                break
            parent = np.uint64(0)
            under = False
            at = fields[F_PARENT]
            if at >= 0 and msg[at] != NIL:
                after, parent, _ = read_int(msg, at)
                if after < 0:
                    ok = False
                    break
                under = True
            if ntokens // block_size < nhashes:  # the tokens were read in place above
                ok = False
                break
            if not main:
                n_skipped += 1
                continue
            if n_local + nhashes > local.size:
                status = NEED_ROOM
                ok = False
                break
            hash_blocks(tokens, block_size, block_size, _SEED, local[n_local : n_local + nhashes])
            kinds[n_events] = STORED_UNDER if under else STORED
            tiers[n_events] = tier
            parents[n_events] = parent
            n_local += nhashes
            n_blocks += nhashes
            n_events += 1
            offsets[n_events] = n_blocks
        if ok and count == 3 and pos >= 0:
            if msg[pos] == NIL:
                pos += 1
            else:
                pos, value, negative = read_int(msg, pos)
                if pos < 0 or negative or value > np.uint64(I32_MAX) or int(value) != rank:
                    ok = False
        elif ok and rank != 0:
            ok = False
        if not ok or pos != msg.size:
            n_events, n_blocks, n_local, n_skipped = events, blocks, nlocal, skipped
            break
        stamps[m] = stamp
        status = DONE
        m += 1
    finish(counts, m, n_events, n_blocks, n_local, n_skipped, kinds, tiers)
    return status
