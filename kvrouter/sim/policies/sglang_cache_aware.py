"""``sglang_cache_aware``: SGLang's cache-aware load balancer, its approximate tree fed by its own decisions.

sglang_router keeps one radix tree shared by all workers ("tenants"), records each routed prompt under the
worker it chose, and never sees the engines' KV events; so its tree holds what it *sent*, not what is
cached. Per request (``spec/routing-benchmark.md`` §4), with load = in-flight requests per worker:

1. imbalanced (``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``): the least
   loaded worker;
2. else, if the longest prefix any worker has in the tree covers more than ``cache_threshold`` of the
   prompt: that worker;
3. else the worker with the smallest tree, to spread new prefixes over idle capacity.

The chosen worker's prompt is inserted in ``routed``, stamped with the simulated time. Every
``eviction_interval_secs`` each worker's part of the tree is cut to ``max_tree_blocks`` by dropping its
least recently inserted blocks, leaves first.

Kept from SGLang: one tree with per-node tenant timestamps, insertion of every decision even when the
load rule chose. Changed: the tree is keyed by the trace's local block hashes, not characters (sizes and
the match ratio are in blocks), and ties among equally good workers are random (``Cluster.rng``) where
SGLang takes its hash map's order. Parameter defaults are sglang_router's; SMG's documented set is
``(0.3, 64, 1.5)``, and the benchmark runs both.

A worker's blocks are always a prefix-closed set (an insertion stamps the whole path, so a node is never
newer than its parent for the same tenant), which is why pruning oldest-first, deepest-first never strands
a descendant.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from ...errors import ConfigError
from ...events.model import WorkerKey
from ...routing import choose
from ..policy import Cluster, Policy, Request

__all__ = ["SglangCacheAwarePolicy"]

DEFAULT_CACHE_THRESHOLD: Final = 0.5
"""sglang_router's ``cache_threshold``: share of the prompt the best prefix must exceed to win."""
DEFAULT_BALANCE_ABS_THRESHOLD: Final = 32
"""sglang_router's ``balance_abs_threshold``, in in-flight requests."""
DEFAULT_BALANCE_REL_THRESHOLD: Final = 1.0001
"""sglang_router's ``balance_rel_threshold``."""
DEFAULT_EVICTION_INTERVAL_SECS: Final = 60.0
"""sglang_router's ``eviction_interval_secs``."""
DEFAULT_MAX_TREE_BLOCKS: Final = 2048
"""Blocks kept per worker at each pruning: one worker's KV capacity in the benchmark (sglang_router's
``max_tree_size`` is 2^24 characters, which has no block equivalent)."""


class _Node:
    """One block position in the tree: the path of local hashes from the root to here."""

    __slots__ = ("children", "depth", "local_hash", "parent", "tenants")

    def __init__(self, parent: _Node | None, local_hash: int) -> None:
        self.parent = parent
        self.local_hash = local_hash
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.children: dict[int, _Node] = {}
        self.tenants: dict[WorkerKey, float] = {}
        """Workers this block was routed to, with the simulated time of the latest such routing."""


class SglangCacheAwarePolicy(Policy):
    """Balance first, then the longest routed prefix, then the smallest tree.

    Args:
        cache_threshold: a prefix wins when ``matched / len(prompt blocks)`` exceeds this.
        balance_abs_threshold: in-flight spread (max - min) above which the load may override the cache.
        balance_rel_threshold: ... provided also ``max > balance_rel_threshold * min``.
        eviction_interval_secs: simulated seconds between prunings.
        max_tree_blocks: blocks each worker keeps at a pruning.

    Raises:
        ConfigError: a negative threshold, or an interval or tree size not > 0.
    """

    name = "sglang_cache_aware"

    def __init__(
        self,
        *,
        cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
        balance_abs_threshold: float = DEFAULT_BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
        eviction_interval_secs: float = DEFAULT_EVICTION_INTERVAL_SECS,
        max_tree_blocks: int = DEFAULT_MAX_TREE_BLOCKS,
    ) -> None:
        for field, value in (
            ("cache_threshold", cache_threshold),
            ("balance_abs_threshold", balance_abs_threshold),
            ("balance_rel_threshold", balance_rel_threshold),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"sglang_cache_aware {field} must be a finite number >= 0, got {value!r}")
        if not eviction_interval_secs > 0 or max_tree_blocks < 1:
            raise ConfigError(
                "sglang_cache_aware needs eviction_interval_secs > 0 and max_tree_blocks >= 1, "
                f"got {eviction_interval_secs!r}, {max_tree_blocks!r}"
            )
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_secs = eviction_interval_secs
        self.max_tree_blocks = max_tree_blocks
        self._root = _Node(None, 0)
        self._sizes: dict[WorkerKey, int] = {}
        """Blocks per worker in the tree."""
        self._next_prune = eviction_interval_secs

    def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
        if cluster.now >= self._next_prune:
            self.prune()
            self._next_prune = cluster.now + self.eviction_interval_secs
        workers = cluster.workers
        loads = [cluster.slots.active_requests(w) for w in workers]
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            return workers[choose(loads, 0.0, cluster.rng)]
        matched, holders = self.match(request.local_hashes)
        blocks = len(request.local_hashes)
        if blocks and matched / blocks > self.cache_threshold:
            held = [w for w in workers if w in holders]
            if held:
                return held[0] if len(held) == 1 else cluster.rng.choice(held)
        return workers[choose([self.tree_blocks(w) for w in workers], 0.0, cluster.rng)]

    def routed(self, request: Request, worker: WorkerKey, cluster: Cluster) -> None:
        self.insert(request.local_hashes, worker, cluster.now)

    def match(self, local_hashes: Sequence[int]) -> tuple[int, set[WorkerKey]]:
        """The longest prefix of ``local_hashes`` in the tree, in blocks, and the workers holding all of it."""
        node = self._root
        for local_hash in local_hashes:  # hot path: one dict probe per block
            child = node.children.get(local_hash)
            if child is None:
                break
            node = child
        return node.depth, set(node.tenants)

    def insert(self, local_hashes: Sequence[int], worker: WorkerKey, now: float) -> None:
        """Record ``local_hashes`` as routed to ``worker`` at ``now``."""
        node = self._root
        added = 0
        for local_hash in local_hashes:  # hot path: one dict probe per block
            child = node.children.get(local_hash)
            if child is None:
                child = node.children[local_hash] = _Node(node, local_hash)
            if worker not in child.tenants:
                added += 1
            child.tenants[worker] = now
            node = child
        if added:
            self._sizes[worker] = self._sizes.get(worker, 0) + added

    def tree_blocks(self, worker: WorkerKey) -> int:
        """Blocks routed to ``worker`` that are still in the tree."""
        return self._sizes.get(worker, 0)

    def prune(self) -> None:
        """Cut every worker's part of the tree to ``max_tree_blocks``, least recently routed blocks first."""
        over = {w for w, size in self._sizes.items() if size > self.max_tree_blocks}
        if not over:
            return
        held: dict[WorkerKey, list[_Node]] = {w: [] for w in over}
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            for worker in over.intersection(node.tenants):
                held[worker].append(node)
            stack.extend(node.children.values())
        for worker, nodes in held.items():
            self._evict(worker, nodes, self._sizes[worker] - self.max_tree_blocks)

    def _evict(self, worker: WorkerKey, nodes: list[_Node], count: int) -> None:
        """Take ``worker`` off its ``count`` least recently routed blocks, deepest first on equal times, so a
        block always goes before its ancestors; a block left with no worker leaves the tree."""
        nodes.sort(key=lambda node: (node.tenants[worker], -node.depth))
        for node in nodes[:count]:
            del node.tenants[worker]
            if not node.tenants and node.parent is not None:
                del node.parent.children[node.local_hash]
        self._sizes[worker] -= count
