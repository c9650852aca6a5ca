"""vLLM's ``KVEventBatch`` (``vllm/distributed/kv_events.py``): tag-first arrays up to 0.23, ``"type"`` maps since 0.24.

A thin front over :mod:`._engine`, which holds everything vLLM shares with SGLang; this module only
states vLLM's layout (``spec/wire-formats.md`` §1.2, §1.3). The decoder reads both encodings of every
version from 0.9.0 on (``[ts, events]`` batches included), so a router need not know which vLLM it
subscribes to. The encoder writes the msgpack tree 0.33.0 (map) and 0.23.0 (array) publish, key order
included, so the mock engine's batches are real ones; only header widths can differ (msgspec gives a
BlockStored map a map16 header sized for all its 16 possible keys, msgpack-python the smallest).
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
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
"""``BlockStored`` in declaration order: 0.23.0's array positions after the tag (later fields of the
map era, ``locality`` to ``lookahead_token_ids``, never reached an array)."""

_DIALECT: Final = Dialect(
    name="vllm",
    stored_fields=_STORED_FIELDS,
    removed_fields=("block_hashes", "medium", "group_idx"),
    # 0.33.0: required fields (even nil), then group_idx, which block_pool always sets.
    stored_map_keys=(*_STORED_FIELDS[:7], "group_idx"),
    removed_map_keys=("block_hashes", "medium", "group_idx"),
    fixed_values={"group_idx": 0},
    mediums={StorageTier.DEVICE: "GPU", StorageTier.HOST: "CPU", StorageTier.DISK: "STORAGE"},
    signed_hashes=False,
    store_per_block=False,
    extra_keys_salted=True,
)


class Decoder(EngineDecoder):
    """Decodes vLLM batches for one worker; see :class:`~kvrouter.events.codecs._engine.EngineDecoder`."""

    dialect = _DIALECT


class Encoder(EngineEncoder):
    """Encodes batches as vLLM 0.33.0 (``"map"``) or 0.23.0 (``"array"``) publishes them."""

    dialect = _DIALECT
