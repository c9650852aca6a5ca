"""SGLang's KV-event batches (``sglang/srt/disaggregation/kv_events.py``), as 0.5.23 publishes them.

A thin front over :mod:`._engine`: SGLang's publisher is close to a copy of vLLM's, and this module
only states where it differs (``spec/wire-formats.md`` §2.1): one ``BlockStored`` per page, chained to
the previous page; signed int64 hashes; ``attn_dp_rank`` in the batch's third slot, read like vLLM's
rank; mediums ``GPU``, ``CPU_PINNED``, ``DISK``, ``EXTERNAL``; ``cache_salt``, ``session_id`` and
``lora_name`` after ``medium``. A partial last page (``block_size`` below the page size) is dropped
like any block of another size. ``cache_salt`` is hashed into the page's blocks (Dynamo does not hash it:
``EngineDecoder._salt`` says why).
"""

from __future__ import annotations

from typing import Final

from ..model import StorageTier
from ._engine import Dialect, EngineDecoder, EngineEncoder

__all__ = ["Decoder", "Encoder"]

_STORED_FIELDS: Final = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "cache_salt",
    "session_id",
    "lora_name",
)
"""``BlockStored`` in 0.5.23's declaration order. Array events (<= 0.5.18) are read by these positions:
inferred from that order, as fields are only ever appended; no array-era capture was available."""

_DIALECT: Final = Dialect(
    name="sglang",
    stored_fields=_STORED_FIELDS,
    removed_fields=("block_hashes", "medium"),
    # omit_defaults: lora_id is required (always nil); cache_salt, session_id, lora_name default to None.
    stored_map_keys=_STORED_FIELDS[:6],
    removed_map_keys=("block_hashes", "medium"),
    fixed_values={},
    mediums={
        StorageTier.DEVICE: "GPU",
        StorageTier.HOST: "CPU_PINNED",
        StorageTier.DISK: "DISK",
        StorageTier.SHARED: "EXTERNAL",
    },
    signed_hashes=True,
    store_per_block=True,
    extra_keys_salted=False,
)


class Decoder(EngineDecoder):
    """Decodes SGLang batches for one worker: each page's BlockStored becomes one :class:`Stored`."""

    dialect = _DIALECT


class Encoder(EngineEncoder):
    """Encodes batches as SGLang publishes them: a store of n blocks becomes n chained BlockStored,
    so only stores of at most one block come back as they went."""

    dialect = _DIALECT
