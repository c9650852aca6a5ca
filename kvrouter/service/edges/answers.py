"""The JSON shapes of the service's answers, written once for every edge that answers them.

``/select``'s answer, its ``explain`` member and ``X-Gateway-Destination-Endpoint``; ``/query``'s scores;
``/workers``, ``/loads`` and ``/dump``. The HTTP routes, the hot lane and the ZMQ fast path all answer
through these, so each says the same thing in the same words (``test_api``, ``test_lane``,
``test_fastpath``). Pure functions of core values: nothing here changes state.

``/select``'s common answer (no ``explain``, no ``fallbacks``) is spliced from bytes cached in
:class:`SelectAnswers` (the answer head per partition, worker and endpoint; the index summary encoded once
per refresh), so the hot route builds no nested dicts; it is byte for byte what :func:`select_json` and
``orjson`` give (``test_api``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Final

import orjson

from ...events.codecs.dynamo import Encoder
from ...events.model import TIERS_IN_ORDER, WorkerKey
from ...routing.router import Selection
from ..core.counters import ServiceCounters
from ..core.decider import QueryAnswer, ranked_fallbacks
from ..core.decision import Decision, explain
from ..core.facts import IndexFacts
from ..core.partition import Instance, Partition, address
from ..core.queue import RouterQueue
from ..core.registry import Registry
from ..core.requests import SelectRequest, parse_body, parse_query, parse_select, session_id
from ..core.state import Core
from . import fastparse

__all__ = [
    "GATEWAY_HEADER",
    "HEADS_CACHED",
    "PREFILL_HEADER",
    "SelectAnswers",
    "dump_json",
    "loads_json",
    "query_body",
    "query_json",
    "select_json",
    "workers_json",
]

GATEWAY_HEADER: Final = "X-Gateway-Destination-Endpoint"
"""The chosen worker's ``ip:port`` (then the fallbacks'), for a gateway that forwards by header; a split
request's decode worker."""
PREFILL_HEADER: Final = "X-Kvrouter-Prefill-Endpoint"
"""A split request's prefill worker's ``ip:port``."""
HEADS_CACHED: Final = 4096
"""``/select`` answer heads kept (one per partition, worker and endpoint); cleared when full."""


def select_json(decision: Decision) -> dict[str, Any]:
    """``/select``'s answer (without ``index``). In a disaggregated partition: a split request's two choices,
    each in today's shape, or today's shape with ``"split": false`` and why (``docs/http-api.md``, "Roles")."""
    split = decision.split
    body = _chosen(decision, decision.selection, decision.endpoint, decision.address, decision.fallbacks)
    if split is None:
        return body
    if "explain" in body and split.decode_costs:  # the decode choice's every candidate (rule 2)
        body["explain"]["decode_costs"] = [
            {"worker_id": key[0], "dp_rank": key[1], "cost": cost} for key, cost in split.decode_costs
        ]
    if split.prefill is None:
        body["split"] = False
        body["local_prefill_reason"] = split.reason
        return body
    sid = body.pop("selection_id", None)
    prefill = split.prefill
    prefill_body = _chosen(
        decision,
        prefill,
        decision.prefill_endpoint,
        decision.prefill_address,
        ranked_fallbacks(prefill, decision.request.fallbacks),
    )
    answer: dict[str, Any] = {"split": True}
    if sid is not None:
        answer["selection_id"] = sid
    answer["prefill"] = prefill_body
    answer["decode"] = body
    return answer


def _chosen(
    decision: Decision,
    selection: Selection,
    endpoint: str | None,
    where: str | None,
    fallbacks: list[tuple[WorkerKey, float]],
) -> dict[str, Any]:
    """One choice in ``/select``'s shape: the worker, its overlap and cost, and what the request asked for."""
    partition = decision.partition
    request = decision.request
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
        "endpoint": endpoint,
        "address": where,
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
    if decision.selection_id is not None:
        body["selection_id"] = decision.selection_id
    if request.fallbacks:
        body["fallbacks"] = [
            {
                "worker_id": key[0],
                "dp_rank": key[1],
                "endpoint": (inst := partition.instances[key[0]]).http_endpoint,
                "address": address(inst.http_endpoint),
                "cost": cost,
            }
            for key, cost in fallbacks
        ]
    if request.explain or request.probe:
        body["explain"] = explain(decision, selection)
    return body


def gateway(decision: Decision) -> str | None:
    """``X-Gateway-Destination-Endpoint``: the winner's address, then the fallbacks'; None without one."""
    first = decision.address
    if first is None or not decision.fallbacks:
        return first
    instances = decision.partition.instances
    return ",".join([first, *(a for k, _ in decision.fallbacks if (a := address(instances[k[0]].http_endpoint)))])


class SelectAnswers:
    """``/select``'s body in and answer out, timed as the ``parse`` and ``serialise`` phases (and ``total``),
    for every edge that answers it over HTTP."""

    def __init__(self, facts: IndexFacts, counters: ServiceCounters) -> None:
        self._facts = facts
        self._phases = counters.phases
        self._index_json: tuple[object, bytes] = (None, b"")
        """(the summary dict it encodes, its JSON): re-encoded when the health loop swaps the dict."""
        self._heads: dict[tuple[str, str, int, WorkerKey, str | None], bytes] = {}

    def parse(self, raw: bytes, session: str | None, started: float) -> SelectRequest:
        """The validated ``/select`` body, its session id from the reference's header when the body has none;
        timed as the ``parse`` phase since ``started``.

        Raises:
            BadRequest: a body or field the service cannot take.
        """
        select = fastparse.fast_select(raw)  # token ids straight into uint32 (fastparse.py)
        if select is None:
            select = parse_select(parse_body(raw))  # every other shape, and every error
        if select.session_id is None and session:
            select = dataclasses.replace(select, session_id=session_id(session))  # the reference's header
        self._phases["parse"].observe(time.perf_counter() - started)
        return select

    def encode(self, decision: Decision, started: float) -> tuple[bytes, dict[str, str]]:
        """The answer's body and its headers (``X-Gateway-Destination-Endpoint``, and a split request's
        ``X-Kvrouter-Prefill-Endpoint``, when they have an address), timed as the ``serialise`` phase, and
        ``total`` since ``started`` (the request's first byte read)."""
        serialising = time.perf_counter()
        facts = self._facts
        request = decision.request
        if (
            request.explain
            or request.fallbacks
            or decision.selection.explanation is not None
            or decision.split is not None
        ):
            body = select_json(decision)
            body["index"] = facts.summary
            payload = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
        else:
            selection = decision.selection
            partition = decision.partition
            device = selection.overlap_blocks * partition.block_size
            if self._index_json[0] is not facts.summary:
                self._index_json = (facts.summary, orjson.dumps(facts.summary))
            sid = b"" if decision.selection_id is None else b',"selection_id":' + orjson.dumps(decision.selection_id)
            payload = b"".join(
                (
                    self._head(partition, selection.worker, decision.endpoint, decision.address),
                    b'%d,"gpu":%d,"dp":{"%d":%d},"cpu":%d,"disk":%d},"effective_prefill_tokens":%d,'
                    b'"potential_decode_blocks":%d,"isl_tokens":%d,"cost":'
                    % (
                        device,
                        device,
                        selection.worker[1],
                        device,
                        device,
                        device,
                        max(0, selection.isl_tokens - device),
                        selection.cost.decode_blocks,
                        selection.isl_tokens,
                    ),
                    orjson.dumps(selection.cost.total),
                    sid,
                    b',"index":',
                    self._index_json[1],
                    b"}",
                )
            )
        headers = {}
        if (destination := gateway(decision)) is not None:
            headers[GATEWAY_HEADER] = destination
        if decision.prefill_address is not None:
            headers[PREFILL_HEADER] = decision.prefill_address
        done = time.perf_counter()
        self._phases["serialise"].observe(done - serialising)
        self._phases["total"].observe(done - started)
        return payload, headers

    def _head(self, partition: Partition, worker: WorkerKey, endpoint: str | None, where: str | None) -> bytes:
        """The answer's opening members up to ``"overlap":{"longest_matched":``, built once per (partition,
        worker, endpoint): everything in it is fixed by that key, so the cache needs no invalidation (it is
        only bounded)."""
        key = (partition.model_name, partition.routing_group, partition.block_size, worker, endpoint)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= HEADS_CACHED:
                self._heads.clear()
            opening = {
                "model_name": partition.model_name,
                "routing_group": partition.routing_group,
                "worker_id": worker[0],
                "dp_rank": worker[1],
                "endpoint": endpoint,
                "address": where,
                "block_size": partition.block_size,
            }
            head = orjson.dumps(opening)[:-1] + b',"overlap":{"longest_matched":'
            self._heads[key] = head
        return head


def query_body(core: Core, raw: bytes, *, by_hash: bool) -> bytes:
    """The body of ``/query``'s (or ``/query_by_hash``'s) answer to the request body ``raw``, the index summary
    included: what the lane and aiohttp's route both send. Token ids go through ``fastparse``, as a
    selection's do. Raises the core's errors for the gate to map (400, 404, 503)."""
    core.lifecycle.require_index()  # before the parse: its compiled scan waits for the start's compile
    request = None if by_hash else fastparse.fast_query(raw)
    if request is None:
        request = parse_query(parse_body(raw), by_hash=by_hash)
    body = query_json(core.decider.query(request))
    body["index"] = core.facts.summary
    return orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)


def query_json(answer: QueryAnswer) -> dict[str, Any]:
    """The indexer's answer in matched tokens: ``scores`` (device, legacy) and ``instances``, in the
    partition's worker order. Only the workers that hold something are looked at: a prompt matches a few
    of a fleet's workers. Looking up every worker in every tier through the enum (and the reader's own
    iterations of the enum) cost 15-20 µs of a ``/query``'s 185 (16 workers, 1,024 tokens; the front's
    CPU, 2026-12-07)."""
    partition, tiers = answer.partition, answer.tiers
    block = partition.block_size
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict[str, Any]] = {}
    nothing: dict[WorkerKey, int] = {}
    on_device, on_host, on_disk, on_shared = (tiers.get(tier, nothing) for tier in TIERS_IN_ORDER)
    holding = on_device.keys() | on_host.keys() | on_disk.keys() | on_shared.keys()
    for key in partition.worker_keys() if holding else ():
        if key not in holding:
            continue
        device, host = on_device.get(key, 0), on_host.get(key, 0)
        disk, shared = on_disk.get(key, 0), on_shared.get(key, 0)
        deepest = max(device, host, disk, shared)
        if not deepest:
            continue
        wid, rank = str(key[0]), str(key[1])
        if device:
            scores.setdefault(wid, {})[rank] = device * block
        entry = instances.setdefault(wid, {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0})
        entry["dp"][rank] = device * block
        entry["gpu"] = max(entry["gpu"], device * block)
        entry["cpu"] = max(entry["cpu"], max(device, host) * block)
        entry["disk"] = max(entry["disk"], max(device, host, disk) * block)
        entry["longest_matched"] = max(entry["longest_matched"], deepest * block)
    return {"scores": scores, "frequencies": [], "instances": instances}


def workers_json(registry: Registry, model: str | None, group: str | None) -> list[dict[str, Any]]:
    """``GET /workers``: every registered instance of the partitions that match."""
    return [
        _worker_json(registry, partition, instance)
        for partition, instance in registry.instances()
        if model in (None, partition.model_name) and group in (None, partition.routing_group)
    ]


def _worker_json(registry: Registry, partition: Partition, instance: Instance) -> dict[str, Any]:
    listeners: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    trust, accuracy = registry.trust, registry.accuracy
    for rank, endpoint in sorted(instance.ranks.items()):
        key = (instance.instance_id, rank)
        stats = registry.streams.get(key)
        if key in partition.unhealthy:
            skipped[str(rank)] = partition.unhealthy[key]
        if partition.approx is not None:
            listeners[str(rank)] = {"endpoint": endpoint, "status": "approximate"}
            continue
        if stats is None or instance.status != "active":
            listeners[str(rank)] = {"endpoint": endpoint, "status": "pending"}
            continue
        listeners[str(rank)] = {
            "endpoint": endpoint,
            "status": "active" if stats.state in ("exact", "partial") else "pending",
            "trust": trust.state(key),
            "problems": trust.problems(key),
            "state": stats.state,
            "stale": stats.stale,
            "cached_blocks": stats.cached_blocks,
            "cached_by_tier": dict(stats.cached_by_tier),
            "last_id": stats.last_id,
            "gaps_detected": stats.gaps_detected,
            "gaps_recovered": stats.gaps_recovered,
            "gaps_lost": stats.gaps_lost,
            "restarts": stats.restarts,
            "events": stats.events,
            "last_event_at": stats.last_event_ns / 1e9 if stats.last_event_ns else None,
            "evicted": dict(stats.evicted),
        }
        if evicted := sum(stats.evicted.values()):
            listeners[str(rank)]["note"] = (
                f"{evicted} blocks evicted by --max-index-blocks: the index holds less than this worker's "
                "cache on purpose (every event is still accounted; the trust state is unchanged)"
            )
    status: str = instance.status
    if instance.status == "active" and skipped:
        status = "unhealthy" if len(skipped) == len(instance.ranks) else "degraded"
    answer = {
        "instance_id": instance.instance_id,
        "source": "zmq" if partition.approx is None else "approximate",
        "status": status,
        "model_name": partition.model_name,
        "routing_group": partition.routing_group,
        "block_size": partition.block_size,
        "format": instance.format,
        "role": instance.role,
        "topology_domain": instance.topology_domain,
        "lora_adapters": list(instance.lora_adapters),
        "endpoints": {str(rank): ep for rank, ep in sorted(instance.ranks.items())},
        "replay_endpoint": instance.replay_endpoint,
        "http_endpoint": instance.http_endpoint,
        "address": instance.address,
        "listeners": listeners,
        "skipped": skipped,
        "accuracy": {
            str(rank): view
            for rank in sorted(instance.ranks)
            if (view := accuracy.view((instance.instance_id, rank))) is not None
        },
    }
    if instance.failure is not None:
        answer["error"] = instance.failure
    return answer


def loads_json(registry: Registry, queue: RouterQueue) -> list[dict[str, Any]]:
    """``GET /loads``: per partition, each registered rank's booked load and the router queue."""
    out = []
    for partition in list(registry.partitions.values()):
        slots = partition.slots
        active = {iid for iid, instance in partition.instances.items() if instance.status == "active"}
        loads = [
            {
                "worker_id": key[0],
                "dp_rank": key[1],
                "potential_prefill_tokens": slots.active_prefill_tokens(key),
                "potential_decode_blocks": slots.active_blocks(key),
                "active_requests": slots.active_requests(key),
                "recent_prefill_tokens": round(slots.recent_prefill_tokens(key), 3),
                "schedulable": key[0] in active and key not in partition.unhealthy,
                "role": partition.instances[key[0]].role,
            }
            for key in partition.worker_keys()
        ]
        pending = queue.pending(partition.model_name, partition.routing_group)
        out.append(
            {
                "model_name": partition.model_name,
                "routing_group": partition.routing_group,
                "loads": loads,
                "pending_count": pending[0],
                "pending_isl_tokens": pending[1],
            }
        )
    return out


def dump_json(registry: Registry) -> dict[str, Any]:
    """``GET /dump``: per partition its block size and, in approximate mode, its blocks as events."""
    encoder = Encoder()
    out: dict[str, Any] = {}
    for partition in registry.partitions.values():
        events: list[Any] = []
        if partition.approx is not None:
            events = [
                {"worker_id": e.worker_id, "storage_tier": "device", "event": orjson.loads(encoder.encode_event(e))}
                for e in partition.approx.dump()
            ]
        out[partition.name] = {
            "block_size": partition.block_size,
            "events": events,
            "complete": partition.approx is not None,
        }
    return out
