"""``Host``: what the edges need of the process they serve in, beyond the core.

An edge is written against the core (``service/core/``) and this protocol, never against the process
layer's objects: where a registry write goes (front 0 does it; another front of ``--fronts N`` forwards
it), what ``/ready`` says (the process knows the replica sync, the relays, the fronts), where a decision
kept by another front is found, and which counters ``/metrics`` sums. The process layer's ``Service``
implements it.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..core.counters import ServiceCounters

__all__ = ["Host"]


class Host(Protocol):
    @property
    def front(self) -> int | None:
        """This front's number with ``--fronts N`` (every answer says it), else None."""
        ...

    async def control(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """A registry write (``register``, ``unregister``, ``busy``), done where the registry is written;
        its answer's body.

        Raises:
            ServiceError: the refusal.
        """
        ...

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """``GET /ready``'s verdict and body."""
        ...

    async def find_decision(self, selection_id: str) -> dict[str, Any] | None:
        """``GET /decisions/{id}``: the decision as it was made, from any front that keeps it."""
        ...

    def fleet_counters(self) -> ServiceCounters:
        """The counters ``/metrics`` shows: this front's, or every front's summed."""
        ...
