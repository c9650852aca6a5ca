"""``WorkerSpec``: what the event plane needs to know of a worker to follow its KV events.

The supervisor owns the registry (worker id → spec) and hands each applier the specs of the
(worker, dp_rank) pairs it owns, also when it restarts one; the spec travels as a msgpack map, so an
applier never imports anything of the supervisor's. A spec names one worker with all its dp ranks; each
rank is its own stream (its own publisher, sequence and replay socket), placed in a shard on its own.

Endpoints follow the engines' dp-rank port rule (``spec/wire-formats.md`` §1.7): rank r of
``tcp://host:5557`` publishes on port 5557 + r, and its replay socket is offset the same way, unless the
spec lists one endpoint per rank. A bind-style host (``*``, ``0.0.0.0``, ``::``) means "this machine" to a
subscriber, which connects to 127.0.0.1 as Dynamo's listener does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgpack

from ..errors import ConfigError

__all__ = ["FORMATS", "WorkerSpec", "offset_endpoint", "parse_workers"]

Format = Literal["vllm", "sglang", "kvrouter"]
FORMATS: Final[tuple[Format, ...]] = ("vllm", "sglang", "kvrouter")
DEFAULT_BLOCK_SIZE: Final = 16
"""The reference's ``kv_block_size`` default for a worker given without one (``spec/interfaces.md`` §5)."""

_TCP: Final = re.compile(r"^tcp://(?P<host>\[[^\]]+\]|[^:/]+):(?P<port>\d+)$")
_BIND_HOSTS: Final = frozenset({"*", "0.0.0.0", "[::]", "::"})


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint dp rank ``rank`` uses, by the engines' rule: tcp port + rank, ``inproc://x_dp{r}``.

    Raises:
        ConfigError: an endpoint the rule cannot offset (``ipc://`` beyond rank 0, a port past 65535).
    """
    match = _TCP.match(endpoint)
    if match is not None:
        host, port = match["host"], int(match["port"])
        if host in _BIND_HOSTS:
            host = "127.0.0.1"
        if port == 0 and rank:
            raise ConfigError(f"endpoint {endpoint}: port 0 cannot be offset for dp rank {rank}; list one per rank")
        if port + rank > 65535:
            raise ConfigError(f"endpoint {endpoint}: dp rank {rank} would use port {port + rank} > 65535")
        return f"tcp://{host}:{port + rank}"
    if endpoint.startswith("inproc://"):
        return endpoint if rank == 0 else f"{endpoint}_dp{rank}"
    if endpoint.startswith("ipc://") and rank == 0:
        return endpoint
    raise ConfigError(f"endpoint {endpoint!r}: expected tcp://host:port, inproc:// or ipc:// (rank 0 only)")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker as an operator registers it. Validated on construction.

    Raises:
        ConfigError: an unknown format, no dp rank, a block size below 1, a kvrouter-format worker with a
            replay endpoint (it recovers through its local indexer), or endpoints the rank rule cannot offset.
    """

    worker_id: int
    endpoint: str
    """The engine's bound PUB socket (rank 0, or every rank by the offset rule)."""
    format: Format = "vllm"
    replay_endpoint: str | None = None
    """vLLM / SGLang replay ROUTER (rank 0, offset like ``endpoint``); None: gaps cannot be repaired."""
    query_endpoint: str | None = None
    """kvrouter-format workers: the local indexer's query ROUTER (``docs/wire-format.md``)."""
    topic: bytes = b""
    dp_ranks: tuple[int, ...] = (0,)
    block_size: int = DEFAULT_BLOCK_SIZE
    rank_endpoints: Mapping[int, str] = field(default_factory=dict)
    """Explicit per-rank event endpoints, overriding the offset rule for the ranks listed."""
    rank_query_endpoints: Mapping[int, str] = field(default_factory=dict)
    """Explicit per-rank query endpoints (kvrouter format), overriding the offset rule for the ranks
    listed: a durable-mode relay's own ROUTER per rank (``bridge/events.py``)."""

    def __post_init__(self) -> None:
        where = f"worker {self.worker_id}"
        if not 0 <= self.worker_id < 1 << 64:
            raise ConfigError(f"{where}: worker id must be a u64")
        if self.format not in FORMATS:
            raise ConfigError(f"{where}: unknown format {self.format!r}; expected one of {', '.join(FORMATS)}")
        if not self.dp_ranks or len(set(self.dp_ranks)) != len(self.dp_ranks) or min(self.dp_ranks) < 0:
            raise ConfigError(f"{where}: dp ranks must be distinct and non-negative, got {list(self.dp_ranks)}")
        if self.block_size < 1:
            raise ConfigError(f"{where}: block size must be at least 1, got {self.block_size}")
        if self.format == "kvrouter" and self.replay_endpoint is not None:
            raise ConfigError(f"{where}: a kvrouter-format worker recovers through query_endpoint, not a replay socket")
        for rank in self.dp_ranks:  # fail now, not in an applier
            self.event_endpoint(rank)
            self.recovery_endpoint(rank)

    def event_endpoint(self, rank: int) -> str:
        return self.rank_endpoints.get(rank) or offset_endpoint(self.endpoint, rank)

    def recovery_endpoint(self, rank: int) -> str | None:
        """Where rank ``rank`` answers for its history: the replay socket, or the local indexer's."""
        if self.format == "kvrouter" and rank in self.rank_query_endpoints:
            return self.rank_query_endpoints[rank]
        base = self.query_endpoint if self.format == "kvrouter" else self.replay_endpoint
        return None if base is None else offset_endpoint(base, rank)

    def to_wire(self) -> bytes:
        body: dict[str, Any] = {
            "worker_id": self.worker_id,
            "endpoint": self.endpoint,
            "format": self.format,
            "replay_endpoint": self.replay_endpoint,
            "query_endpoint": self.query_endpoint,
            "topic": self.topic,
            "dp_ranks": list(self.dp_ranks),
            "block_size": self.block_size,
            "rank_endpoints": dict(self.rank_endpoints),
            "rank_query_endpoints": dict(self.rank_query_endpoints),
        }
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return packed

    @classmethod
    def from_wire(cls, payload: bytes) -> WorkerSpec:
        """Raises: ConfigError, for a payload that is not a spec."""
        try:
            body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            return cls(
                worker_id=body["worker_id"],
                endpoint=body["endpoint"],
                format=body["format"],
                replay_endpoint=body["replay_endpoint"],
                query_endpoint=body["query_endpoint"],
                topic=body["topic"],
                dp_ranks=tuple(body["dp_ranks"]),
                block_size=body["block_size"],
                rank_endpoints=body["rank_endpoints"],
                rank_query_endpoints=body.get("rank_query_endpoints", {}),
            )
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            raise ConfigError(f"not a worker spec: {exc!r}") from exc


_WORKER_ITEM: Final = re.compile(r"^(?P<id>\d+)(?::(?P<dp>\d+))?=(?P<endpoint>\S+)$")


def parse_workers(text: str, *, block_size: int = DEFAULT_BLOCK_SIZE) -> list[WorkerSpec]:
    """Workers in the reference indexer's syntax: ``id[:dp_size]=tcp://host:port``, comma-separated.

    Raises:
        ConfigError: an item that does not parse, or a worker id given twice.
    """
    specs: list[WorkerSpec] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _WORKER_ITEM.match(item)
        if match is None:
            raise ConfigError(f"worker {item!r}: expected id[:dp_size]=tcp://host:port")
        dp_size = int(match["dp"] or 1)
        specs.append(
            WorkerSpec(int(match["id"]), match["endpoint"], dp_ranks=tuple(range(dp_size)), block_size=block_size)
        )
    ids = [spec.worker_id for spec in specs]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"workers: an id is given twice in {text!r}")
    return specs
