"""What a routing policy sees and answers in the simulator: one interface for every policy.

A policy is a small class: ``choose`` picks a worker for a request from the cluster's state,
``booked_overlap`` says how much of the prompt the booking counts as cached, and two hooks let policies
that keep their own guesses (SGLang's approximate tree, round robin's cursor, Preble's load window) learn
what happened. The simulator owns the state a policy reads and books every decision itself (slot manager
add / prefill-completed / free), so all policies are judged on the same load accounting (only the
cached blocks booked may differ, by ``booked_overlap``); a policy never mutates ``Cluster``.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass
from typing import ClassVar

from ..events.model import WorkerKey
from ..index import RadixIndex
from ..routing import SlotManager

__all__ = ["Cluster", "Policy", "Request"]


@dataclass(frozen=True, slots=True)
class Request:
    """One trace request as the router sees it at arrival."""

    request_id: str
    arrival: float
    """Simulated seconds since the start of the run."""
    input_tokens: int
    output_tokens: int
    local_hashes: tuple[int, ...]
    """The request's full cacheable blocks (``input_tokens // block_size`` of the trace's hash ids)."""


@dataclass(slots=True)
class Cluster:
    """The state a policy may read (and must not change)."""

    workers: tuple[WorkerKey, ...]
    index: RadixIndex
    """Fed by the simulated engines' KV events (with the run's event lag)."""
    slots: SlotManager
    """Active requests per worker, driven by the simulated request lifecycle."""
    block_size: int
    capacity_blocks: int
    """KV blocks per worker."""
    now: float
    """Simulated seconds."""
    rng: random.Random
    """The run's seeded random source: the only one a policy may use."""


class Policy(abc.ABC):
    """A routing policy; one instance serves one simulation run."""

    name: ClassVar[str]
    """The name ``kvrouter simulate --policy`` takes."""

    @abc.abstractmethod
    def choose(self, request: Request, cluster: Cluster) -> WorkerKey:
        """The worker that gets ``request``."""

    def booked_overlap(self, request: Request, worker: WorkerKey, index_overlap: int) -> int:
        """The leading blocks the simulator books ``request`` with on ``worker`` as needing no prefill: the
        index's device overlap, unless the policy predicts more (kvrouter's predicted tier books the
        blocks its in-flight requests are computing there, as its router does when it books)."""
        return index_overlap

    def routed(self, request: Request, worker: WorkerKey, cluster: Cluster) -> None:  # noqa: B027 (optional hook)
        """Called after ``request`` was booked on ``worker`` (for policies that keep their own state)."""

    def finished(self, request: Request, worker: WorkerKey, cluster: Cluster) -> None:  # noqa: B027 (optional hook)
        """Called when ``request`` completed on ``worker``."""
