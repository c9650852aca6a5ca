"""The pooled-LRU ceiling: the hit rate W workers could reach if their caches were one LRU cache.

``spec/routing-benchmark.md`` §6.3 measures a routing policy against a timing-free reference: replay
the trace's requests in arrival order through a single LRU cache of ``W x 2048`` blocks. A request
reuses the longest prefix of its full blocks found in the cache (chained ids: a block is only usable
behind its whole prefix, as an engine admits it, §2.1), then every one of its full blocks is touched or
inserted in prompt order, evicting the least recently used. The hit rate is reused tokens over input
tokens (``512 x`` reused blocks over ``input_length``), the engine's own definition (§5), so a policy's
measured hit divides by the ceiling directly.

No router can beat it on these traces in practice: it is one cache with the fleet's capacity, no
replication of shared blocks and no load to balance. Its cost is that it ignores time: blocks pinned by
running requests, eviction order inside a worker, concurrency. The spec rejects the alternative, the
mocker's single worker with pooled capacity, because that worker is overloaded and pins active blocks,
which lowers the figure (§6.3). With ``capacity_blocks=None`` the same replay gives the infinite-cache
rate of §1 (37.3% conversation, 65.0% synthetic). ``tests/sim/test_ceiling.py`` pins all six figures.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Final

from .policy import Request
from .trace import TRACE_BLOCK_SIZE

__all__ = ["BLOCKS_PER_WORKER", "lru_hit_rate", "pooled_lru_ceiling"]

BLOCKS_PER_WORKER: Final = 2048
"""KV blocks per simulated worker (spec §2.1, the anchors' ``num_gpu_blocks``); the ceilings of §6.3 use it."""


def lru_hit_rate(
    requests: Iterable[Request], *, capacity_blocks: int | None, block_size: int = TRACE_BLOCK_SIZE
) -> float:
    """Reused input tokens over input tokens for one LRU cache of ``capacity_blocks`` full blocks.

    Args:
        requests: in arrival order; only ``local_hashes`` (the full blocks) and ``input_tokens`` are read.
        capacity_blocks: the cache's size; None for an infinite cache.
        block_size: tokens per block.

    Returns:
        A fraction in [0, 1]; 0.0 for requests with no input tokens.

    Raises:
        ValueError: ``capacity_blocks`` < 1.
    """
    if capacity_blocks is not None and capacity_blocks < 1:
        raise ValueError(f"LRU capacity must be >= 1 block, got {capacity_blocks!r}")
    cache: OrderedDict[int, None] = OrderedDict()
    reused_blocks = 0
    input_tokens = 0
    for request in requests:  # hot path: one dict probe per block
        blocks = request.local_hashes
        input_tokens += request.input_tokens
        for block in blocks:
            if block not in cache:
                break
            reused_blocks += 1
        for block in blocks:
            if block in cache:
                cache.move_to_end(block)
            else:
                cache[block] = None
                if capacity_blocks is not None and len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    if input_tokens == 0:
        return 0.0
    return reused_blocks * block_size / input_tokens


def pooled_lru_ceiling(
    requests: Iterable[Request],
    *,
    workers: int,
    blocks_per_worker: int = BLOCKS_PER_WORKER,
    block_size: int = TRACE_BLOCK_SIZE,
) -> float:
    """The §6.3 ceiling for ``workers`` workers: one LRU cache of ``workers x blocks_per_worker`` blocks.

    Raises:
        ValueError: ``workers`` or ``blocks_per_worker`` < 1.
    """
    if workers < 1 or blocks_per_worker < 1:
        raise ValueError(f"pooled LRU needs workers >= 1 and blocks >= 1, got {workers!r} x {blocks_per_worker!r}")
    return lru_hit_rate(requests, capacity_blocks=workers * blocks_per_worker, block_size=block_size)
