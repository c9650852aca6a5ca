"""The JSON shape of a decision: ``/select``'s answer, its ``explain`` record and a worker's ``address``.

Shared by the two fronts that answer a ``/select`` (``routes.py`` over HTTP, ``fastpath.py`` over
ZMQ) and by the decisions ring (``app.py``), so every one of them says the same thing in the same
words. Pure functions of a :class:`~kvrouter.service.app.SelectResult`: no service state is read here.
``routes.py`` splices the common answer from preassembled bytes instead; ``test_api`` holds the two
byte for byte equal.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

from .decisions import worker_terms

if TYPE_CHECKING:
    from .app import SelectResult
    from .validation import SelectRequest

__all__ = ["address", "explain", "select_json"]

ADDRESSES_CACHED: Final = 4096
"""Endpoints whose address is kept: more than a fleet registers in one partition."""


@functools.lru_cache(maxsize=ADDRESSES_CACHED)
def address(http_endpoint: str | None) -> str | None:
    """``ip:port`` of an ``http://ip:port/...`` endpoint: GIE's ``x-gateway-destination-endpoint`` form.

    Cached: every ``/select`` answer carries its worker's address, and ``urlsplit`` took 3.7 µs of each
    (about a twentieth of a front's own work per request); a fleet has few endpoints and each maps to one
    address for ever."""
    if not http_endpoint:
        return None
    parts = urlsplit(http_endpoint)
    if parts.hostname is None:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}"


def explain(result: SelectResult) -> dict[str, Any]:
    config = result.partition.router.config
    explanation = result.selection.explanation or ()
    prompt_blocks = result.selection.isl_tokens // result.partition.block_size
    return {
        "weights": {
            "overlap_credit": config.overlap_score_credit,
            "prefill_load_scale": config.prefill_load_scale,
            "decode_active_request_weight": config.decode_active_request_weight,
            "prefill_work_weight": config.prefill_work_weight,
            "temperature": config.router_temperature,
            "policy": config.router_selection_policy,
        },
        "workers": [worker_terms(w, prompt_blocks) for w in explanation],
        "trust": {f"{w.worker[0]}:{w.worker[1]}": result.partition.trust.get(w.worker) for w in explanation},
    }


def select_json(result: SelectResult, request: SelectRequest) -> dict[str, Any]:
    selection = result.selection
    partition = result.partition
    block = partition.block_size
    wid, rank = selection.worker
    device = selection.overlap_blocks * block
    host = disk = device
    if selection.explanation is not None:
        for w in selection.explanation:
            if w.selected:
                host, disk = (
                    max(w.overlap.host, w.overlap.device) * block,
                    max(w.overlap.disk, w.overlap.host) * block,
                )
    body: dict[str, Any] = {
        "model_name": partition.model_name,
        "routing_group": partition.routing_group,
        "worker_id": wid,
        "dp_rank": rank,
        "endpoint": result.endpoint,
        "address": result.address,
        "block_size": block,
        "overlap": {
            "longest_matched": max(device, host, disk),
            "gpu": device,
            "dp": {str(rank): device},
            "cpu": host,
            "disk": disk,
        },
        "effective_prefill_tokens": max(0, selection.isl_tokens - device),
        "potential_decode_blocks": selection.cost.decode_blocks,
        "isl_tokens": selection.isl_tokens,
        "cost": selection.cost.total,
    }
    if result.selection_id is not None:
        body["selection_id"] = result.selection_id
    if request.fallbacks:
        body["fallbacks"] = [
            {
                "worker_id": key[0],
                "dp_rank": key[1],
                "endpoint": (inst := partition.instances[key[0]]).http_endpoint,
                "address": address(inst.http_endpoint),
                "cost": cost,
            }
            for key, cost in result.fallbacks
        ]
    if request.explain or request.probe:
        body["explain"] = explain(result)
    return body
