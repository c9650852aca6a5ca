"""Worker roles in a disaggregated fleet: which hop of a request a worker may take.

In a disaggregated fleet, prefill workers compute a prompt's KV and hand it to decode workers, which
generate. A worker registers as ``prefill``, ``decode`` or ``both`` (an aggregated worker: today's, and
the default). The role is per instance: every dp rank of an engine runs the same program.

A partition is **disaggregated** when it has at least one ``prefill`` worker and at least one worker that
can decode (``decode`` or ``both``); a ``both`` worker is a candidate for either hop. A ``prefill`` worker
never takes a whole request, as it cannot generate: a partition with no decode-capable worker answers 503.
A disaggregated partition's requests are split over a prefill and a decode worker, or prefilled by the
decode worker itself when a split buys nothing (``disagg.py``).
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = ["DEFAULT_ROLE", "ROLES", "Role", "decodes", "prefills"]

Role = Literal["prefill", "decode", "both"]
ROLES: Final[tuple[Role, ...]] = ("prefill", "decode", "both")
DEFAULT_ROLE: Final[Role] = "both"


def decodes(role: Role) -> bool:
    """Whether a worker of ``role`` may generate: take the decode hop, or a whole request."""
    return role != "prefill"


def prefills(role: Role) -> bool:
    """Whether a worker of ``role`` may take the prefill hop of a split request."""
    return role != "decode"
