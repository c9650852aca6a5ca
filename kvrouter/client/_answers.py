"""The JSON shapes of the service's answers (``docs/http-api.md``), as ``TypedDict`` s.

Typed dicts rather than dataclasses: an answer is handed over as the service sent it, so a field a newer
service adds passes through untouched (the doc's "Differences" list grows), and nothing is copied or
checked on the way; the cost is that the shapes are a promise read from the service's code, not verified
at run time. ``total=False`` marks what an answer may leave out (``explain`` unless asked, a listener
that is still pending); a field the service always sends but may set to null is ``X | None``. Objects
whose keys are data (worker ids, ranks, partition names) are ``dict[str, ...]``: JSON keys are strings.
"""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = [
    "Accuracy",
    "BusyThresholds",
    "Candidate",
    "Decision",
    "DecisionDetail",
    "Decisions",
    "DumpPartition",
    "Events",
    "Explanation",
    "Fallback",
    "Health",
    "IndexFacts",
    "Listener",
    "Overlap",
    "PartitionLoads",
    "QueryAnswer",
    "Ready",
    "ReadyIndex",
    "ReadyWorker",
    "RunnerUp",
    "Selection",
    "Status",
    "Thresholds",
    "Unregistered",
    "Worker",
    "WorkerLoad",
]


class IndexFacts(TypedDict):
    """The ``index`` object of query and selection answers: refreshed every health tick, not per request."""

    epoch: int
    events_applied: int
    last_event_age_ms: float | None
    recovering: int


class Health(TypedDict):
    """``GET /health``: always 200 while the process serves (liveness)."""

    status: str
    stopping: bool


class Status(TypedDict):
    """``{"status": "ok"}``: a write that took effect."""

    status: str


class Unregistered(Status):
    """``POST /unregister``: how many (instance, rank) pairs went."""

    removed_ranks: int


class ReadyWorker(TypedDict):
    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    role: str
    """``prefill``, ``decode`` or ``both``."""


class ReadyIndex(TypedDict):
    """The index cap, its use and its evictions (``docs/insight.md``, "Bounded memory")."""

    blocks: int
    blocks_cap: int
    evicted: dict[str, int]


class _ReadyAlways(TypedDict):
    ready: bool
    schedulable_workers: int
    workers: list[ReadyWorker]
    reasons: list[str]
    """Why not ready (``engine starting``, ``no schedulable worker``, ``shard 0 recovering``...)."""
    shards: dict[str, str]
    index: ReadyIndex


class Ready(_ReadyAlways, total=False):
    """``GET /ready``, ready or not; the optional parts come with the features that add them."""

    replica_sync: dict[str, Any]
    fronts: dict[str, Any]
    nats_events: dict[str, Any]
    durable_events: dict[str, Any]


class _ListenerAlways(TypedDict):
    endpoint: str | None
    status: str
    """``active``, ``pending`` (not followed yet) or ``approximate`` (then nothing else is given)."""


class Listener(_ListenerAlways, total=False):
    """One dp rank's event stream in ``GET /workers``."""

    state: str
    stale: bool
    trust: str | None
    problems: dict[str, str]
    cached_blocks: int
    cached_by_tier: dict[str, int]
    last_id: int
    gaps_detected: int
    gaps_recovered: int
    gaps_lost: int
    restarts: int
    events: int
    last_event_at: float | None
    evicted: dict[str, int]
    note: str


class Accuracy(TypedDict, total=False):
    """A rank's index accuracy against what its engine reported (``docs/insight.md``)."""

    reports: int
    exact: int
    over: int
    under: int
    predicted_tokens: int
    actual_tokens: int
    rolling: float | None
    drift: bool


class Worker(TypedDict):
    """One registered instance in ``GET /workers``."""

    instance_id: int
    source: str
    status: str
    """``active``, ``degraded`` (some ranks skipped) or ``unhealthy`` (all skipped)."""
    model_name: str
    routing_group: str
    block_size: int
    format: str
    role: str
    """``prefill``, ``decode`` or ``both`` (``docs/http-api.md``, "Roles")."""
    topology_domain: str | None
    lora_adapters: list[str]
    """The LoRA adapters it serves (``docs/http-api.md``, "LoRA adapters")."""
    endpoints: dict[str, str | None]
    replay_endpoint: str | None
    http_endpoint: str | None
    address: str | None
    listeners: dict[str, Listener]
    skipped: dict[str, str]
    accuracy: dict[str, Accuracy]


class Overlap(TypedDict):
    """Matched tokens (blocks x block size) of one worker, per tier; ``dp`` per rank."""

    longest_matched: int
    gpu: int
    dp: dict[str, int]
    cpu: int
    disk: int


class QueryAnswer(TypedDict):
    """``POST /query`` and ``/query_by_hash``: only workers with a match are listed."""

    scores: dict[str, dict[str, int]]
    frequencies: list[int]
    instances: dict[str, Overlap]
    index: IndexFacts


class Candidate(TypedDict):
    """One worker's cost terms in a decision (``kvrouter/routing/cost.py``'s, in blocks)."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    overlap: dict[str, int]
    prompt_blocks: int
    raw_prefill_blocks: float
    overlap_credit_blocks: float
    predicted_credit_blocks: float
    """The part of ``overlap_credit_blocks`` the predicted tier gives (``overlap["predicted"]`` blocks in flight)."""
    adjusted_prefill_blocks: float
    prefill_cost: float
    decode_cost: int
    request_cost: float
    work_factor: float
    cost: float
    prob: float
    selected: bool
    busy: bool


class Explanation(TypedDict):
    """``explain``: the weights, every candidate's terms, and each candidate's trust state by ``"id:rank"``."""

    weights: dict[str, Any]
    workers: list[Candidate]
    trust: dict[str, str | None]


class Fallback(TypedDict):
    """One of the next-best eligible workers (``fallbacks: n``), cheapest first."""

    worker_id: int
    dp_rank: int
    endpoint: str | None
    address: str | None
    cost: float


class _SelectionAlways(TypedDict):
    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    endpoint: str | None
    address: str | None
    block_size: int
    overlap: Overlap
    effective_prefill_tokens: int
    potential_decode_blocks: int
    isl_tokens: int
    cost: float
    index: IndexFacts


class Selection(_SelectionAlways, total=False):
    """``POST /select`` and ``/select_and_reserve``: ``selection_id`` always on the latter, ``explain`` and
    ``fallbacks`` when asked."""

    selection_id: str
    explain: Explanation
    fallbacks: list[Fallback]


class WorkerLoad(TypedDict):
    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int
    recent_prefill_tokens: float
    schedulable: bool
    role: str


class PartitionLoads(TypedDict):
    """One partition of ``GET /loads``, with its router queue."""

    model_name: str
    routing_group: str
    loads: list[WorkerLoad]
    pending_count: int
    pending_isl_tokens: int


class DumpPartition(TypedDict):
    """One partition of ``GET /dump`` (``events`` is empty and ``complete`` false in event mode)."""

    block_size: int
    events: list[dict[str, Any]]
    complete: bool


class Thresholds(TypedDict):
    """A partition's busy thresholds (null: none)."""

    model_name: str
    routing_group: str
    active_decode_blocks_threshold: float | None
    active_prefill_tokens_threshold: int | None


class BusyThresholds(TypedDict):
    thresholds: list[Thresholds]


class _DecisionAlways(TypedDict):
    seq: int
    at: float
    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    overlap_blocks: int
    prompt_blocks: int
    isl_tokens: int
    cost: float
    reserved: bool
    selection_id: str | None
    decision_us: float


class Decision(_DecisionAlways, total=False):
    """One entry of the decisions ring; ``explain`` (the candidates) when the client asked, and on one
    decision every 100 ms; ``shadows`` with ``--shadow-policy``."""

    explain: list[Candidate]
    shadows: dict[str, dict[str, Any]]


class Decisions(TypedDict):
    """``GET /decisions?since=N``: ``last`` is the seq to ask from next time."""

    last: int
    decisions: list[Decision]


class RunnerUp(TypedDict):
    worker_id: int
    dp_rank: int
    overlap_blocks: int
    cost: float
    lost_by: float


class DecisionDetail(TypedDict):
    """``GET /decisions/{selection_id}``: a past decision with every candidate's terms."""

    selection_id: str | None
    seq: int
    at: float
    model_name: str
    routing_group: str
    block_size: int
    prompt_blocks: int
    isl_tokens: int
    reserved: bool
    worker_id: int
    dp_rank: int
    overlap_blocks: int
    best_overlap_blocks: int
    avoidable_prefill_tokens: int
    cost: float
    candidates: int
    runner_up: RunnerUp | None
    temperature: float
    workers: list[Candidate]


class Events(TypedDict):
    """``GET /events?since=N``: each event is ``{"seq", "at", "kind", ...}`` plus its kind's own fields,
    so entries are plain dicts."""

    last: int
    events: list[dict[str, Any]]
