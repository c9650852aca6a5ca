"""Request bodies into typed requests, refusing what does not fit with a :class:`BadRequest` (400).

Every field a client sends is checked here, before it reaches the router, the slot manager or the
engine: a wrong type, a token id outside u32, a hash outside i64/u64, an unknown format. So the code
past this module can trust its inputs, and nothing a client sends turns into a 500 or a half-booked
reservation. Token ids are checked as one numpy array (about 10 µs for 1,024 ids, against 60 µs for a
per-item ``isinstance`` loop); the array goes on to the hasher without another copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, cast

import numpy as np
import numpy.typing as npt
import orjson

from ...errors import BadRequest, ConfigError, NotFound
from ...plane.registry import FORMATS, Format, offset_endpoint
from ...routing.roles import DEFAULT_ROLE, ROLES, Role

__all__ = [
    "MAX_ID",
    "QueryRequest",
    "Registration",
    "SelectRequest",
    "Thresholds",
    "Unregistration",
    "adapter_names",
    "cached_tokens",
    "parse_body",
    "parse_query",
    "parse_registration",
    "parse_select",
    "parse_thresholds",
    "parse_unregistration",
    "reservation_id",
    "selection_id",
    "session_id",
]

U32_MAX: Final = (1 << 32) - 1
U64_MASK: Final = (1 << 64) - 1
I64_MIN: Final = -(1 << 63)
MAX_NAME: Final = 256
Transport = Literal["zmq", "nats"]
TRANSPORTS: Final[tuple[Transport, ...]] = ("zmq", "nats")
"""How a registered worker's KV events arrive: its own ZMQ PUB, or NATS core's ``kv-events`` subject."""
MAX_FALLBACKS: Final = 64
MAX_ADAPTERS: Final = 1024
"""LoRA adapters one worker may register: vLLM serves a handful per GPU; this only bounds a body's cost."""
MAX_ID: Final = 256
"""The longest ``selection_id`` or ``session_id``, in characters: checked here only, for every edge (the
body's field, the reservation routes' path, the ZMQ fast path's field, the session header)."""


@dataclass(frozen=True, slots=True)
class Registration:
    """``POST /register``: the reference indexer's fields plus kvrouter's optional ones."""

    instance_id: int
    endpoint: str | None
    """The rank's KV-event PUB endpoint; optional only in approximate mode."""
    model_name: str = "default"
    block_size: int = 16
    dp_rank: int = 0
    routing_group: str = "default"
    replay_endpoint: str | None = None
    format: Format = "vllm"
    topic: str = ""
    query_endpoint: str | None = None
    http_endpoint: str | None = None
    total_kv_blocks: int | None = None
    transport: Transport = "zmq"
    """``nats``: the worker publishes the reference's ``RouterEvent`` JSON on NATS's ``kv-events`` subject
    (``bridge/events.py``); ``endpoint`` is then not needed and the worker is followed as kvrouter-format."""
    role: Role = DEFAULT_ROLE
    """The hops of a request the worker takes (``routing/roles.py``); per instance."""
    topology_domain: str | None = None
    """Where the worker sits for KV transfers (a rack, a node); None: the one default domain. Per instance."""
    lora_adapters: tuple[str, ...] = ()
    """The LoRA adapters it serves beside its base model (vLLM's ``--lora-modules`` names), sorted: a request
    whose ``model`` names one is routed in this partition, among the workers serving it, on blocks hashed
    with its name (``Registry.served_as``). Per instance."""


@dataclass(frozen=True, slots=True)
class Unregistration:
    instance_id: int
    model_name: str
    routing_group: str | None = None
    """None: every group of the model."""
    dp_rank: int | None = None
    """None: every rank."""


@dataclass(frozen=True, slots=True)
class QueryRequest:
    model_name: str
    routing_group: str
    token_ids: npt.NDArray[np.uint32] | None
    block_hashes: list[int] | None
    """Local block hashes as u64 (i64 input reinterpreted)."""
    lora_name: str | None = None
    cache_salt: str | None = None


@dataclass(slots=True)
class SelectRequest:
    """``POST /select`` and ``/select_and_reserve``: a prompt as token ids or as local block hashes. Not
    frozen, as ``routing.cost.Cost`` is not: one is built per request, and a frozen dataclass's
    ``__init__`` of these twelve fields costs 2.4 µs against 0.5; treat it as read only."""

    model_name: str
    routing_group: str = "default"
    token_ids: npt.NDArray[np.uint32] | None = None
    block_hashes: list[int] | None = None
    isl_tokens: int | None = None
    selection_id: str | None = None
    session_id: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    explain: bool = False
    fallbacks: int = 0
    probe: bool = False
    """Where the prompt would go, explained, without booking, counting, recording or session binding
    (``kvrouter top``'s pinned prompt); ``/select`` only."""
    whole: bool = False
    """The caller sends the request to one worker (the proxy, once the prefill workers refused it twice): a
    disaggregated partition does not split it."""
    priority: int = 0
    """Its class in the router queue (vLLM's meaning: lower first); the proxy's routes take it."""


@dataclass(frozen=True, slots=True)
class Thresholds:
    """``POST /busy_threshold``: a partition's new busy thresholds (None: no threshold)."""

    model_name: str
    routing_group: str
    decode: float | None
    prefill: int | None
    given: frozenset[str]
    """Which of the two the body set: the others keep the partition's value."""


def parse_body(body: bytes) -> dict[str, Any]:
    """A JSON object, or a 400."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise BadRequest(f"body must be a JSON object, got {type(value).__name__}")
    return value


def _int(body: Mapping[str, Any], name: str, default: int | None = None, *, low: int = 0, high: int = U64_MASK) -> int:
    value = body.get(name, default)
    if value is None:
        raise BadRequest(f"{name}: required")
    if type(value) is not int:
        raise BadRequest(f"{name}: expected an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise BadRequest(f"{name}: {value} is outside [{low}, {high}]")
    return value


def parse_priority(value: object, where: str = "priority") -> int:
    """A request's class in the router queue (vLLM's ``priority``: an integer, lower first); 0 when absent.

    Raises:
        BadRequest: not an integer in [-2**31, 2**31).
    """
    if value is None:
        return 0
    if type(value) is not int or not -(1 << 31) <= value < 1 << 31:
        raise BadRequest(f"{where}: expected an integer in [-2**31, 2**31) (lower first), got {value!r}", param=where)
    return value


def _opt_int(body: Mapping[str, Any], name: str, *, low: int = 0, high: int = U64_MASK) -> int | None:
    return None if body.get(name) is None else _int(body, name, low=low, high=high)


def _str(body: Mapping[str, Any], name: str, default: str | None = None, *, limit: int = MAX_NAME) -> str:
    value = body.get(name, default)
    if value is None:
        raise BadRequest(f"{name}: required")
    if not isinstance(value, str):
        raise BadRequest(f"{name}: expected a string, got {type(value).__name__}")
    if not value or len(value) > limit:
        raise BadRequest(f"{name}: expected 1..{limit} characters, got {len(value)}")
    return value


def _opt_str(body: Mapping[str, Any], name: str, *, limit: int = 2048) -> str | None:
    return None if body.get(name) is None else _str(body, name, limit=limit)


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{name}: expected true or false, got {type(value).__name__}")
    return value


def _endpoint(body: Mapping[str, Any], name: str, *, required: bool) -> str | None:
    value = _str(body, name) if required else _opt_str(body, name)
    if value is not None:
        try:
            offset_endpoint(value, 0)
        except ConfigError as exc:
            raise BadRequest(f"{name}: {exc}") from exc
    return value


def _http_endpoint(body: Mapping[str, Any]) -> str | None:
    value = _opt_str(body, "http_endpoint")
    if value is not None and not value.startswith(("http://", "https://")):
        value = "http://" + value  # ip:port, as a gateway writes it
    return value


def token_array(value: Any, name: str = "token_ids") -> npt.NDArray[np.uint32]:
    """A JSON list of token ids as a ``uint32`` array, each checked to be an integer in u32; or (the ZMQ
    fast path's msgpack ``bin``) their little-endian u32 bytes, read with no list at all."""
    if isinstance(value, bytes):
        if len(value) % 4:
            raise BadRequest(f"{name}: expected little-endian u32 bytes, got {len(value)} bytes (not a multiple of 4)")
        return np.frombuffer(value, dtype="<u4").astype(np.uint32)  # a writable native copy, 1 µs for 4 KB
    if not isinstance(value, list):
        raise BadRequest(f"{name}: expected a list of integers, got {type(value).__name__}")
    if not value:
        return np.empty(0, dtype=np.uint32)
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError) as exc:
        raise BadRequest(f"{name}: expected a flat list of integers: {exc}") from exc
    if array.ndim != 1 or array.dtype.kind not in "iu" or array.dtype == np.bool_:
        raise BadRequest(f"{name}: expected a flat list of integers in [0, 2**32)")
    if int(array.min()) < 0 or int(array.max()) > U32_MAX:
        raise BadRequest(f"{name}: token ids must be in [0, 2**32), got [{array.min()}, {array.max()}]")
    return array.astype(np.uint32)


def hash_list(value: Any, name: str = "block_hashes") -> list[int]:
    """Local block hashes: i64 as Dynamo sends them (reinterpreted as u64), or u64."""
    if not isinstance(value, list):
        raise BadRequest(f"{name}: expected a list of integers, got {type(value).__name__}")
    out = []
    for i, h in enumerate(value):
        if type(h) is not int or not I64_MIN <= h <= U64_MASK:
            raise BadRequest(f"{name}[{i}]: expected an integer in i64 or u64, got {h!r}")
        out.append(h & U64_MASK)
    return out


def _topic(body: Mapping[str, Any]) -> str:
    value = body.get("topic") or ""
    if not isinstance(value, str) or len(value) > MAX_NAME:
        raise BadRequest(f"topic: expected a string of at most {MAX_NAME} characters")
    return value


def cached_tokens(body: Mapping[str, Any]) -> int | None:
    """``prefill_complete``'s optional ``cached_tokens``: the prompt tokens the engine reused (``accuracy.py``).

    Raises:
        BadRequest: not an integer in 0..2^32-1.
    """
    return _opt_int(body, "cached_tokens", high=U32_MAX)


def parse_registration(body: Mapping[str, Any], *, endpoint_required: bool = True) -> Registration:
    transport = body.get("transport", "zmq")
    if transport not in TRANSPORTS:
        raise BadRequest(f"transport: expected one of {', '.join(TRANSPORTS)}, got {transport!r}")
    nats = transport == "nats"
    fmt = body.get("format", "kvrouter" if nats else "vllm")
    if fmt not in FORMATS:
        raise BadRequest(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if nats and fmt != "kvrouter":
        raise BadRequest(f"format: a nats-transport worker is followed as 'kvrouter' format, got {fmt!r}")
    if nats and body.get("endpoint") is not None:
        raise BadRequest("endpoint: not accepted with transport 'nats' (events come on the kv-events subject)")
    return Registration(
        instance_id=_int(body, "instance_id"),
        endpoint=None if nats else _endpoint(body, "endpoint", required=endpoint_required),
        transport=cast(Transport, transport),
        model_name=_str(body, "model_name", "default"),
        block_size=_int(body, "block_size", 16, low=1, high=1 << 20),
        dp_rank=_int(body, "dp_rank", 0, high=1023),
        routing_group=_str(body, "routing_group", "default"),
        replay_endpoint=_endpoint(body, "replay_endpoint", required=False),
        format=cast(Format, fmt),
        topic=_topic(body),
        query_endpoint=_endpoint(body, "query_endpoint", required=False),
        http_endpoint=_http_endpoint(body),
        total_kv_blocks=_opt_int(body, "total_kv_blocks", low=1, high=1 << 40),
        role=_role(body),
        topology_domain=_opt_str(body, "topology_domain", limit=MAX_NAME),
        lora_adapters=_adapters(body),
    )


def adapter_names(value: object) -> tuple[str, ...]:
    """A worker's LoRA adapter names, sorted and without repeats.

    Raises:
        ValueError: not a list of 1..``MAX_NAME``-character strings, or more than ``MAX_ADAPTERS`` of them.
    """
    if not isinstance(value, list | tuple):
        raise ValueError(f"expected a list of adapter names, got {type(value).__name__}")
    if len(value) > MAX_ADAPTERS:
        raise ValueError(f"at most {MAX_ADAPTERS} adapters per worker, got {len(value)}")
    for name in value:
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
            raise ValueError(f"expected adapter names of 1..{MAX_NAME} characters, got {name!r:.80}")
    return tuple(sorted(set(value)))


def _adapters(body: Mapping[str, Any]) -> tuple[str, ...]:
    try:
        return adapter_names(body.get("lora_adapters", ()))
    except ValueError as exc:
        raise BadRequest(f"lora_adapters: {exc}") from exc


def _role(body: Mapping[str, Any]) -> Role:
    role = body.get("role", DEFAULT_ROLE)
    if role not in ROLES:
        raise BadRequest(f"role: expected one of {', '.join(ROLES)}, got {role!r}")
    return cast(Role, role)


def selection_id(value: object, name: str = "selection_id") -> str:
    """A reservation's id as a client names it (a path segment or a field).

    Raises:
        BadRequest: not a string of 1..``MAX_ID`` characters.
    """
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ID:
        raise BadRequest(f"{name}: expected a string of 1..{MAX_ID} characters")
    return value


def reservation_id(segment: str) -> str:
    """A reservation's id as a route's path names it.

    Raises:
        NotFound: longer than ``MAX_ID``: no reservation was ever booked under it.
    """
    if len(segment) > MAX_ID:
        raise NotFound(f"reservation {segment[:MAX_ID]!r}... not found (ids are at most {MAX_ID} characters)")
    return segment


def session_id(header: str) -> str:
    """The reference's ``X-Dynamo-Session-ID`` header as a session id: cut to ``MAX_ID`` characters (a
    header is never refused, as the reference does not refuse it)."""
    return header[:MAX_ID]


def parse_thresholds(body: Mapping[str, Any]) -> Thresholds:
    """``POST /busy_threshold``'s body.

    Raises:
        BadRequest: a name that is not a string, a threshold that is not a number >= 0 (or null).
    """
    model = body.get("model_name", body.get("model", "default"))
    group = body.get("routing_group", "default")
    if not isinstance(model, str) or not isinstance(group, str):
        raise BadRequest("model_name and routing_group must be strings")
    decode = body.get("active_decode_blocks_threshold")
    prefill = body.get("active_prefill_tokens_threshold")
    if decode is not None and (isinstance(decode, bool) or not isinstance(decode, int | float) or decode < 0):
        raise BadRequest(f"active_decode_blocks_threshold: expected a number >= 0 or null, got {decode!r}")
    if prefill is not None and (type(prefill) is not int or prefill < 0):
        raise BadRequest(f"active_prefill_tokens_threshold: expected an integer >= 0 or null, got {prefill!r}")
    given = frozenset(k for k in ("active_decode_blocks_threshold", "active_prefill_tokens_threshold") if k in body)
    return Thresholds(model, group, None if decode is None else float(decode), prefill, given)


def parse_unregistration(body: Mapping[str, Any]) -> Unregistration:
    return Unregistration(
        instance_id=_int(body, "instance_id"),
        model_name=_str(body, "model_name", "default"),
        routing_group=_opt_str(body, "routing_group", limit=MAX_NAME),
        dp_rank=_opt_int(body, "dp_rank", high=1023),
    )


def parse_query(
    body: Mapping[str, Any], *, by_hash: bool, tokens: npt.NDArray[np.uint32] | None = None
) -> QueryRequest:
    """``tokens`` (``/query`` only): the body's ``token_ids`` already parsed and checked (``fastparse``; the
    body then holds ``[]`` in their place)."""
    hashes = None
    if by_hash:
        if body.get("cache_salt") is not None:
            raise BadRequest("cache_salt: not accepted by /query_by_hash (the hashes already carry it)")
        if "block_hashes" not in body:
            raise BadRequest("block_hashes: required")
        tokens, hashes = None, hash_list(body["block_hashes"])
    elif tokens is None:
        if "token_ids" not in body:
            raise BadRequest("token_ids: required")
        tokens = token_array(body["token_ids"])
    return QueryRequest(
        model_name=_str(body, "model_name", "default"),
        routing_group=_str(body, "routing_group", "default"),
        token_ids=tokens,
        block_hashes=hashes,
        lora_name=_opt_str(body, "lora_name", limit=MAX_NAME),
        cache_salt=_opt_str(body, "cache_salt"),
    )


def parse_select(body: Mapping[str, Any], *, tokens: npt.NDArray[np.uint32] | None = None) -> SelectRequest:
    """``tokens``: the body's ``token_ids`` already parsed and checked (``fastparse``; the body then holds
    ``[]`` in their place)."""
    hashes = None
    if tokens is not None:
        pass
    elif body.get("token_ids") is not None:
        tokens = token_array(body["token_ids"])
    elif body.get("block_hashes") is not None:
        hashes = hash_list(body["block_hashes"])
        if body.get("sequence_hashes") is not None:
            sequence = hash_list(body["sequence_hashes"], "sequence_hashes")
            if len(sequence) != len(hashes):
                raise BadRequest("sequence_hashes: expected one per block hash")
    else:
        raise BadRequest("token_ids or block_hashes: one is required")
    return SelectRequest(
        model_name=_str(body, "model_name", "default"),
        routing_group=_str(body, "routing_group", "default"),
        token_ids=tokens,
        block_hashes=hashes,
        isl_tokens=_opt_int(body, "isl_tokens", high=1 << 40),
        selection_id=_opt_str(body, "selection_id", limit=MAX_ID),
        session_id=_opt_str(body, "session_id", limit=MAX_ID),
        lora_name=_opt_str(body, "lora_name", limit=MAX_NAME),
        cache_salt=_opt_str(body, "cache_salt"),
        explain=_bool(body, "explain"),
        probe=_bool(body, "probe"),
        fallbacks=_int(body, "fallbacks", 0, high=MAX_FALLBACKS),
        priority=parse_priority(body.get("priority")),
    )
