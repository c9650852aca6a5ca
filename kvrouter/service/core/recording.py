"""``ServiceRecording``: what ``kvrouter up --record FILE`` writes from the front (``kvrouter/recording/``).

The front records the registry changes and every call that changes a router's state or draws from its
RNG: each ``Router.select`` (reserved, plain or probe; the ones refused as overloaded too), each prefill
completion and free (also the health loop's expiries), busy-threshold changes and the health loop's
sweeps. Each record holds the inputs the router was given (local hashes, ISL, candidates in order,
capacities, the untrusted workers) and what it decided, with the overlaps the index answered for every
candidate, so a replay can tell an index that differs from a router that decides differently. The appliers
record the events (``plane/tap.py``); the one writer is ``recording/writer.py``.

Determinism: while recording, every partition's router is seeded with the header's ``seed`` and reads a
:class:`~kvrouter.recording.HeldClock` held at each record's ``t``, so a replay that gives the router the
same inputs in the same order gets the same draws and the same times. The routers' state that changes
without a record here is out of the replay: a replica sync's peers (``--router-replica-sync``) and the other
fronts of ``--fronts N`` (both refused with ``--record``, ``service/config.py``).
"""

from __future__ import annotations

import logging
import platform
import secrets
import tempfile
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

import numpy as np
import numpy.typing as npt

from ...events.model import WorkerKey
from ...recording import VERSION, HeldClock, Recorder
from ...routing.roles import DEFAULT_ROLE
from ...routing.router import Selection
from .config import ServiceConfig
from .partition import Partition
from .requests import Registration, Unregistration

__all__ = ["ServiceRecording", "kvrouter_version"]

log = logging.getLogger(__name__)


def kvrouter_version() -> str:
    try:
        return metadata.version("kvrouter")
    except metadata.PackageNotFoundError:
        return "unknown"


def tap_endpoint(path: str) -> str:
    """The appliers' taps' address: an ``ipc://`` socket in the temporary directory, named after this process."""
    name = f"kvrouter-record-{Path(path).name[:32]}-{secrets.token_hex(4)}.sock"
    return f"ipc://{Path(tempfile.gettempdir()) / name}"


class ServiceRecording:
    """The front's half of a recording: the held clock, the seed, and one method per recorded operation."""

    def __init__(self, config: ServiceConfig, endpoint: str) -> None:
        assert config.record is not None
        self.clock = HeldClock()
        self.seed = secrets.randbelow(1 << 32) if config.router_seed is None else config.router_seed
        header = {
            "kind": "header",
            "version": VERSION,
            "kvrouter": kvrouter_version(),
            "created": time.time(),
            "created_t": time.monotonic_ns(),
            "host": platform.node(),
            "seed": self.seed,
            "router": asdict(config.router),
            "block_size": config.block_size,
            "model_name": config.model_name,
            "routing_group": config.routing_group,
            "shards": config.shards,
            "expiry_secs": config.active_request_expiry_secs,
            "workers": [
                {"w": spec.worker_id, "fmt": spec.format, "bs": spec.block_size, "ranks": list(spec.dp_ranks)}
                for spec in config.workers
            ],
        }
        self.recorder = Recorder(config.record, header, endpoint)

    def open(self) -> None:
        self.recorder.open()

    def close(self, evicted: int) -> None:
        """The end record, with the entries the index cap evicted during the run (``--max-index-blocks``): what
        the ``evict`` records should add up to, and what tells a recording made before them apart."""
        self.recorder.close(evicted=evicted)

    def registered(self, t: int, reg: Registration) -> None:
        record = {
            "k": "reg",
            "t": t,
            "m": reg.model_name,
            "g": reg.routing_group,
            "w": reg.instance_id,
            "r": reg.dp_rank,
            "bs": reg.block_size,
            "fmt": reg.format,
        }
        if reg.role != DEFAULT_ROLE:  # absent: both, as every recording made before roles
            record["role"] = reg.role
        if reg.topology_domain is not None:
            record["dom"] = reg.topology_domain
        if reg.lora_adapters:
            record["lora"] = list(reg.lora_adapters)
        self.recorder.add(record)

    def unregistered(self, t: int, request: Unregistration) -> None:
        self.recorder.add(
            {
                "k": "unreg",
                "t": t,
                "m": request.model_name,
                "g": request.routing_group,
                "w": request.instance_id,
                "r": request.dp_rank,
            }
        )

    def decided(
        self,
        t: int,
        partition: Partition,
        local: npt.NDArray[np.uint64],
        isl: int,
        lora_name: str | None,
        candidates: tuple[WorkerKey, ...] | list[WorkerKey],
        request_id: str | None,
        probe: bool,
        selection: Selection | None,
        error: str | None = None,
        *,
        unanswered: frozenset[int],
    ) -> None:
        """One ``Router.select`` call: its inputs and its outcome (``selection``, or ``error``'s kind), and the
        shards its index walk could not read (their workers' overlaps were 0 for it)."""
        capacities = partition.capacities
        record = None if selection is None else selection.record
        self.recorder.add(
            {
                "k": "dec",
                "t": t,
                "t1": time.monotonic_ns(),
                "m": partition.model_name,
                "g": partition.routing_group,
                "id": request_id,
                "probe": probe,
                "h": np.ascontiguousarray(local, dtype="<u8").tobytes(),
                "isl": isl,
                "lora": lora_name,
                "cand": [list(key) for key in candidates],
                "cap": None if capacities is None else [[w, r, c] for (w, r), c in capacities.items()],
                "untr": [list(key) for key in sorted(partition.router.untrusted)],
                "w": None if selection is None else list(selection.worker),
                "o": None if selection is None else selection.overlap_blocks,
                "ov": None if record is None else record.overlaps.tolist(),
                "err": error,
                "down": sorted(unanswered),
            }
        )

    def booked(self, kind: str, t: int, selection_id: str) -> None:
        """``pc`` (prefill complete) or ``free`` of a reservation."""
        self.recorder.add({"k": kind, "t": t, "id": selection_id})

    def thresholds(self, t: int, partition: Partition) -> None:
        config = partition.router.config
        self.recorder.add(
            {
                "k": "busy",
                "t": t,
                "m": partition.model_name,
                "g": partition.routing_group,
                "decode": config.active_decode_blocks_threshold,
                "prefill": config.active_prefill_tokens_threshold,
            }
        )

    def swept(self, t: int, partition: Partition) -> None:
        self.recorder.add({"k": "sweep", "t": t, "m": partition.model_name, "g": partition.routing_group})
