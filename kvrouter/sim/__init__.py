"""Routing quality: a deterministic trace-driven simulator and the routing policies of the field."""

from __future__ import annotations

from .policy import Cluster, Policy, Request

__all__ = ["Cluster", "Policy", "Request"]
