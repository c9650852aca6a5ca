"""The real feeds: a local router read from shared memory (:class:`ShmFeed`), a remote one over HTTP
(:class:`HttpFeed`), and :func:`discover` to find the local ones.

:class:`ShmFeed` polls with zero requests to the router: the appliers' side (shards, worker rows, gaps)
comes from the engine's control segment, mapped read-only (``kvrouter.engine.read_shards`` /
``read_workers``, what ``Engine.stats()`` reads), and the front's side (loads, counters, decisions, log,
weights) from the stats segment the service republishes at 4 Hz (``kvrouter/stats/segment.py``). A
poll is two ``stat`` calls, a copy of one blob (tens of KB) and a walk of the rows in use (not measured
against a busy router yet). Only :meth:`~ShmFeed.probe` asks the router (``POST /select`` with ``probe``: explained,
nothing booked, counted or recorded), since the cost of a prompt is the router's to compute.

:class:`HttpFeed` builds the same :class:`~tui.model.Snapshot` from ``GET /loads``, ``/workers``,
``/metrics``, ``/decisions?since=`` and ``/events?since=`` (five requests a poll, on the kept-alive
connection of a :class:`kvrouter.SyncClient`), keeping the recent decisions and events itself. Both feeds
turn a ring entry into a ``Decision`` or ``LogEvent`` with the same functions (:func:`decision_of`,
:func:`log_event_of`): the stats blob carries the ring entries in the HTTP routes' shape, so the two
sources cannot drift apart.

Anything wrong with the source (gone, not a kvrouter segment, a corrupt blob, a refused connection, an
answer that does not parse) raises :class:`~tui.model.RouterGone` with a message saying what and where
(:class:`BadSource`, a subclass, when the source is there but is not what it should be), never another
exception: the app shows the message and keeps polling.
"""

from __future__ import annotations

import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, Final, ParamSpec, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from kvrouter.client import ApiError, ServiceUnreachable, SyncClient
from kvrouter.engine import WorkerStats, read_shards, read_workers
from kvrouter.errors import StatsError
from kvrouter.index.layout import PREFIX, SHM_DIR, Control, control_name, stats_name
from kvrouter.stats.discovery import Discovered, entries, pid_alive, runtime_dir
from kvrouter.stats.segment import DECISIONS_SHOWN, EVENTS_SHOWN, StatsReader, percentiles

from .model import TIERS, Candidate, Decision, LogEvent, ProbeRow, RouterGone, Shadow, Snapshot, WorkerRow

__all__ = [
    "HTTP_TIMEOUT_S",
    "BadSource",
    "HttpFeed",
    "LocalFeed",
    "ShmFeed",
    "decision_of",
    "discover",
    "log_event_of",
    "shm_names",
]

HTTP_TIMEOUT_S: Final = 2.0
"""Per request: a router that does not answer within this is reported not there [s]."""
LATENCIES_KEPT: Final = 1024
"""Decision latencies the HTTP feed keeps for p50/p99: the service's decisions ring length."""
_SHM_NAME: Final = re.compile(rf"^(?:{PREFIX})?(\d+)(?:-(?:ctl|stats))?$")
P = ParamSpec("P")
T = TypeVar("T")


class BadSource(RouterGone):
    """The source is there but is not a readable kvrouter router: a segment of another layout, a corrupt
    stats blob, an HTTP answer that does not parse. The message says which and where."""


def discover(directory: Path | None = None) -> list[Discovered]:
    """The ``kvrouter up`` services running on this host, oldest first, from their discovery files
    (``kvrouter/stats/discovery.py``); files of dead processes and files that do not parse are skipped."""
    return entries(directory)


def shm_names(name: str) -> tuple[str, str]:
    """``(control, stats)`` segment names from what ``--shm`` may give: ``kvrouter-<pid>-stats``,
    ``kvrouter-<pid>-ctl``, ``kvrouter-<pid>`` or the pid.

    Raises:
        BadSource: the name is none of those.
    """
    match = _SHM_NAME.match(name.removeprefix(f"{SHM_DIR}/"))
    if match is None:
        raise BadSource(f"{name!r}: expected kvrouter-<pid>-stats, kvrouter-<pid>-ctl or a pid")
    pid = int(match.group(1))
    return control_name(pid), stats_name(pid)


# -- ring entries and rows: shared by both feeds ---------------------------------------------------


def _float(value: Any, default: float = 0.0) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def decision_of(entry: Mapping[str, Any]) -> Decision:
    """A decisions-ring entry (``GET /decisions``'s and the stats blob's shape) as a :class:`Decision`."""
    candidates = tuple(
        Candidate(
            worker_id=_int(c.get("worker_id")),
            dp_rank=_int(c.get("dp_rank")),
            overlap_blocks=_int(c.get("overlap_blocks")),
            predicted_blocks=_predicted(c),
            prefill_cost=_float(c.get("prefill_cost")),
            decode_blocks=_int(c.get("decode_cost")),
            request_cost=_float(c.get("request_cost")),
            total=_float(c.get("cost")),
            probability=_float(c.get("prob")),
            selected=bool(c.get("selected")),
            busy=bool(c.get("busy")),
        )
        for c in entry.get("explain") or ()
        if isinstance(c, Mapping)
    )
    return Decision(
        seq=_int(entry.get("seq")),
        at=_float(entry.get("at")),
        worker_id=_int(entry.get("worker_id")),
        dp_rank=_int(entry.get("dp_rank")),
        overlap_blocks=_int(entry.get("overlap_blocks")),
        prompt_blocks=_int(entry.get("prompt_blocks")),
        cost=_float(entry.get("cost")),
        decision_us=_float(entry.get("decision_us")),
        candidates=candidates,
    )


def log_event_of(entry: Mapping[str, Any]) -> LogEvent:
    """An event-log entry (``GET /events``'s and the stats blob's shape) as a :class:`LogEvent`: its
    fields other than ``seq``, ``at`` and ``kind`` rendered ``key=value``."""
    text = " ".join(f"{k}={v}" for k, v in entry.items() if k not in ("seq", "at", "kind"))
    return LogEvent(_int(entry.get("seq")), _float(entry.get("at")), str(entry.get("kind", "")), text)


def _recent(decisions: Iterable[Mapping[str, Any]], explained: Mapping[str, Any] | None) -> tuple[Decision, ...]:
    """The recent decisions, oldest first, with the last explained one in front when it is older than them
    all (one decision is explained every 100 ms: under load it has left the recent window)."""
    out = [decision_of(d) for d in decisions]
    if explained is not None:
        seq = _int(explained.get("seq"))
        if not any(d.seq == seq for d in out):
            out.insert(0, decision_of(explained))
            out.sort(key=lambda d: d.seq)
    return tuple(out)


def _state(plane: str | None, stale: bool, unhealthy: Any, approximate: bool, trust: Any = None) -> str:
    if unhealthy:
        return "unhealthy"
    if trust == "misconfigured":
        return "misconfig"  # the service's trust state, shortened to fit the state column
    if approximate:
        return "approximate"
    if plane is None:
        return "unknown"
    return "stale" if stale else plane


def _row(
    load: Mapping[str, Any], state: str, cached: Mapping[str, Any], gaps: tuple[int, int], last: float | None
) -> WorkerRow:
    """One worker's row; ``cached`` is its blocks by tier name (``WorkerStats.cached_by_tier``, the
    ``/workers`` listener's ``cached_by_tier``), a tier missing from it counting 0."""
    device, host, disk, shared = (_int(cached.get(tier)) for tier in TIERS)
    return WorkerRow(
        worker_id=_int(load.get("worker_id")),
        dp_rank=_int(load.get("dp_rank")),
        model=str(load.get("model_name", "")),
        state=state,
        cached_blocks=device,
        cached_offloaded=(host, disk, shared),
        active_blocks=_int(load.get("potential_decode_blocks")),
        prefill_tokens=_int(load.get("potential_prefill_tokens")),
        requests=_int(load.get("active_requests")),
        gaps_detected=gaps[0],
        gaps_lost=gaps[1],
        last_event_at=last,
        accuracy=_opt_float(load.get("accuracy")),
        drift=load.get("drift") is True,
        problems=_problems(load.get("problems")),
        role=str(load.get("role") or "both"),
    )


def _predicted(terms: Mapping[str, Any]) -> int:
    """A candidate's predicted blocks (``overlap.predicted``; 0 from a router without the tier)."""
    overlap = terms.get("overlap")
    return _int(overlap.get("predicted")) if isinstance(overlap, Mapping) else 0


def _probe_rows(answer: Any) -> list[ProbeRow]:
    workers = answer.get("explain", {}).get("workers", ()) if isinstance(answer, dict) else ()
    return [
        ProbeRow(
            worker_id=_int(w.get("worker_id")),
            dp_rank=_int(w.get("dp_rank")),
            overlap_blocks=_int(w.get("overlap_blocks")),
            predicted_blocks=_predicted(w),
            total=_float(w.get("cost")),
            busy=bool(w.get("busy")),
        )
        for w in workers
        if isinstance(w, Mapping)
    ]


def _asking(client: SyncClient, route: str, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``call(*args, **kwargs)``, a method of ``client`` asking ``route``, with the client's errors as the feed's.

    Raises:
        RouterGone: the router cannot be reached or answered 5xx. BadSource: another refusal, or an answer
            that does not parse.
    """
    try:
        return call(*args, **kwargs)
    except ServiceUnreachable as exc:  # refused, reset, timed out, no route
        raise RouterGone(f"{client.url}{route}: {exc}") from exc
    except ApiError as exc:
        what = f"{client.url}{route}: {exc.status} {exc.message[:200]}"
        raise (RouterGone(what) if exc.status >= 500 else BadSource(what)) from exc


def _probe(client: SyncClient, partitions: Iterable[tuple[str, str]], tokens: Sequence[int]) -> tuple[ProbeRow, ...]:
    rows: list[ProbeRow] = []
    for model, group in partitions:
        answer = _asking(client, "/select", client.select, model, routing_group=group, token_ids=tokens, probe=True)
        rows += _probe_rows(answer)
    return tuple(rows)


def _partitions(loads: Iterable[Mapping[str, Any]]) -> list[tuple[str, str]]:
    return list(dict.fromkeys((str(x.get("model_name")), str(x.get("routing_group"))) for x in loads))


# -- shared memory -----------------------------------------------------------------------------------


class ShmFeed:
    """A local router, read from its control and stats segments (see the module docstring).

    Attaching is lazy and repeated: a router that is not there yet, or went away, makes :meth:`poll` raise
    :class:`RouterGone` and the next poll try again. A segment that was unlinked (the router stopped) is
    noticed by its name being gone from ``/dev/shm``, not by its mapping, which stays readable.

    Args:
        stats: the stats segment (``kvrouter-<pid>-stats``); ``--shm`` forms go through :func:`shm_names`.
        clock: ``taken_at`` of every snapshot (``time.time``).
    """

    def __init__(self, stats: str, *, clock: Callable[[], float] = time.time) -> None:
        self.stats_name = stats
        self._clock = clock
        self._reader: StatsReader | None = None
        self._control: Control | None = None
        self._inodes: tuple[int, int] = (0, 0)
        self._blob: dict[str, Any] = {}
        self._prober: SyncClient | None = None
        """The client of the router's URL (from its blob), made at the first probe: polls ask nothing."""

    @classmethod
    def of(cls, entry: Discovered) -> ShmFeed:
        """The feed of a discovered service."""
        return cls(entry.stats)

    @property
    def source(self) -> str:
        return f"shm:{self.stats_name}"

    def _inode(self, name: str) -> int:
        try:
            return os.stat(f"{SHM_DIR}/{name}").st_ino
        except FileNotFoundError:
            return 0

    def _attach(self) -> tuple[StatsReader, Control]:
        reader, control = self._reader, self._control
        stats_inode = self._inode(self.stats_name)
        if reader is not None and control is not None:
            current = (stats_inode, self._inode(control.name))
            if stats_inode and current == self._inodes:  # the same segments: no new router meanwhile
                return reader, control
        self._detach()
        if not stats_inode:
            raise RouterGone(f"{self.stats_name} is not in {SHM_DIR}: no router publishes there (stopped?)")
        try:
            reader = StatsReader(self.stats_name)
        except FileNotFoundError as exc:
            raise RouterGone(f"{self.stats_name} is not in {SHM_DIR}: no router publishes there") from exc
        except StatsError as exc:
            raise BadSource(str(exc)) from exc
        except OSError as exc:
            raise BadSource(f"{self.stats_name}: {exc}") from exc
        try:
            blob = self._read(reader)
            name = blob.get("control")
            if not isinstance(name, str):
                raise BadSource(f"{self.stats_name}: the stats blob names no control segment")
            try:
                control = Control.attach(name)
            except FileNotFoundError as exc:
                raise RouterGone(f"{name} is not in {SHM_DIR}: the router's engine is gone") from exc
            except (ValueError, IndexError, OSError) as exc:  # Control: magic / version / size wrong
                raise BadSource(f"{name}: not a kvrouter control segment of this layout ({exc})") from exc
        except BaseException:
            reader.close()
            raise
        self._reader, self._control = reader, control
        self._inodes = (stats_inode, self._inode(name))
        return reader, control

    def _read(self, reader: StatsReader) -> dict[str, Any]:
        try:
            blob = reader.read()
        except StatsError as exc:
            raise BadSource(str(exc)) from exc
        self._blob = blob
        return blob

    def _detach(self) -> None:
        reader, self._reader = self._reader, None
        control, self._control = self._control, None
        if reader is not None:
            reader.close()
        if control is not None:
            control.close()
        self._inodes = (0, 0)

    def poll(self) -> Snapshot:
        reader, control = self._attach()
        blob = self._read(reader)
        pid = _int(blob.get("pid"))
        try:
            shards = read_shards(control)
            rows = read_workers(control)
        except (ValueError, IndexError) as exc:
            raise BadSource(f"{control.name}: unreadable ({exc})") from exc
        if pid and not pid_alive(pid):  # killed: its segments stay until the next engine sweeps them
            self._detach()
            raise RouterGone(f"the router (pid {pid}) is gone")
        return self._snapshot(blob, shards, rows)

    def _snapshot(self, blob: Mapping[str, Any], shards: Sequence[Any], rows: Mapping[Any, WorkerStats]) -> Snapshot:
        approximate = bool(blob.get("approximate"))
        loads = [x for x in blob.get("loads") or () if isinstance(x, Mapping)]
        workers = []
        for load in loads:
            row = rows.get((_int(load.get("worker_id")), _int(load.get("dp_rank"))))
            plane = row.state if row else None
            state = _state(plane, bool(row and row.stale), load.get("unhealthy"), approximate, load.get("trust"))
            if row is None:
                workers.append(_row(load, state, {}, (0, 0), None))
            else:
                last = row.last_event_ns / 1e9 if row.last_event_ns else None
                workers.append(_row(load, state, row.cached_by_tier, (row.gaps_detected, row.gaps_lost), last))
        workers.sort(key=lambda w: w.key)
        weights = blob.get("weights")
        return Snapshot(
            source=self.source,
            taken_at=self._clock(),
            started_at=_float(blob.get("started_at")),
            shards=len(shards),
            shards_up=sum(s.status == "up" for s in shards),
            shards_recovering=sum(s.status == "recovering" for s in shards),
            events_total=sum(s.events_applied for s in shards),
            queries_total=_int(blob.get("queries_total")),
            decisions_total=_int(blob.get("decisions_total")),
            route_p50_us=_opt_float(blob.get("route_p50_us")),
            route_p99_us=_opt_float(blob.get("route_p99_us")),
            gaps_detected=sum(r.gaps_detected for r in rows.values()),
            gaps_recovered=sum(r.gaps_recovered for r in rows.values()),
            gaps_lost=sum(r.gaps_lost for r in rows.values()),
            last_gap_at=_opt_float(blob.get("last_gap_at")),
            weights={str(k): _float(v) for k, v in weights.items()} if isinstance(weights, Mapping) else {},
            workers=tuple(workers),
            decisions=_recent(
                [d for d in blob.get("decisions") or () if isinstance(d, Mapping)],
                blob.get("explained") if isinstance(blob.get("explained"), Mapping) else None,
            ),
            events=tuple(log_event_of(e) for e in blob.get("events") or () if isinstance(e, Mapping)),
            index_lag_ms=_lag_ms((s.lag_us for s in shards), 1e-3),
            replicas=None if blob.get("replicas") is None else _int(blob.get("replicas")),
            sync_lag_ms=_opt_float(blob.get("sync_lag_ms")),
            extra=_extra(blob),
            shadows=_blob_shadows(blob.get("shadows")),
            index_blocks=sum(s.entries for s in shards),
            index_blocks_cap=sum(s.budget for s in shards),
            index_evicted=sum(sum(s.evicted.values()) for s in shards),
        )

    def probe(self, tokens: Sequence[int]) -> tuple[ProbeRow, ...]:
        reader, _ = self._attach()
        blob = self._read(reader)
        url = blob.get("url")
        if not isinstance(url, str) or not url:
            raise BadSource(f"{self.stats_name}: the stats blob names no URL to probe")
        if self._prober is None or self._prober.url != url.rstrip("/"):
            self._close_prober()
            self._prober = SyncClient(url, timeout=HTTP_TIMEOUT_S)
        partitions = _partitions(x for x in blob.get("loads") or () if isinstance(x, Mapping))
        return _probe(self._prober, partitions, tokens)

    def _close_prober(self) -> None:
        prober, self._prober = self._prober, None
        if prober is not None:
            prober.close()

    def close(self) -> None:
        self._detach()
        self._close_prober()


class LocalFeed:
    """Whichever ``kvrouter up`` runs on this host: found through the discovery files, followed through
    its segments (:class:`ShmFeed`), and found afresh when it stops, so ``kvrouter top`` started before the
    router, or left open across a restart, attaches by itself. With several running, the newest.

    Args:
        directory: the discovery directory (``runtime_dir()`` by default).
        clock: as :class:`ShmFeed`'s.
    """

    def __init__(self, *, directory: Path | None = None, clock: Callable[[], float] = time.time) -> None:
        self._directory = directory
        self._clock = clock
        self._feed: ShmFeed | None = None

    @property
    def source(self) -> str:
        return "local (no kvrouter up found yet)" if self._feed is None else self._feed.source

    def _current(self) -> ShmFeed:
        if self._feed is None:
            found = discover(self._directory)
            if not found:
                where = runtime_dir() if self._directory is None else self._directory
                raise RouterGone(f"no kvrouter up on this host (no live discovery file in {where})")
            self._feed = ShmFeed(found[-1].stats, clock=self._clock)
        return self._feed

    def _forget(self) -> None:
        feed, self._feed = self._feed, None
        if feed is not None:
            feed.close()

    def poll(self) -> Snapshot:
        feed = self._current()
        try:
            return feed.poll()
        except RouterGone:
            self._forget()  # the next poll looks for a router again
            raise

    def probe(self, tokens: Sequence[int]) -> tuple[ProbeRow, ...]:
        return self._current().probe(tokens)

    def close(self) -> None:
        self._forget()


def _lag_ms(lags: Iterable[float], to_ms: float) -> float | None:
    """The index lag to show: the worst shard's, in ms; None when no shard has one yet (0)."""
    worst = max((lag for lag in lags if lag > 0), default=0.0)
    return worst * to_ms if worst else None


def _opt_float(value: Any) -> float | None:
    return None if value is None else _float(value)


def _extra(blob: Mapping[str, Any]) -> dict[str, str]:
    extra = {}
    for key, name in (("model_name", "model"), ("policy", "policy"), ("url", "url"), ("pid", "pid")):
        if blob.get(key) not in (None, ""):
            extra[name] = str(blob[key])
    if blob.get("trimmed"):
        extra["trimmed"] = "rings trimmed to fit the stats segment"
    return extra


# -- HTTP ----------------------------------------------------------------------------------------------


class HttpFeed:
    """A router over HTTP (``kvrouter top --url``): five GETs a poll, nothing booked (module docstring).

    Keeps the last ``DECISIONS_SHOWN`` decisions and ``EVENTS_SHOWN`` events it saw (asking only for
    those after the last seq), the last explained decision, and the last ``LATENCIES_KEPT`` decision
    latencies for p50/p99. A router that restarted (its seq went back) is followed from its start.
    """

    def __init__(self, url: str, *, clock: Callable[[], float] = time.time, timeout: float = HTTP_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self._clock = clock
        self._client = SyncClient(self.url, timeout=timeout)
        self._decisions: deque[dict[str, Any]] = deque(maxlen=DECISIONS_SHOWN)
        self._events: deque[dict[str, Any]] = deque(maxlen=EVENTS_SHOWN)
        self._latencies: deque[float] = deque(maxlen=LATENCIES_KEPT)
        self._explained: dict[str, Any] | None = None
        self._last_gap_at: float | None = None
        self._since = {"decisions": 0, "events": 0}
        self._partitions: list[tuple[str, str]] = []

    @property
    def source(self) -> str:
        return self.url

    def _ring(self, name: str) -> list[dict[str, Any]]:
        since = self._since[name]
        ask = self._client.decisions if name == "decisions" else self._client.events
        answer: Any = _asking(self._client, f"/{name}", ask, since)
        if not isinstance(answer, dict) or not isinstance(answer.get(name), list):
            raise BadSource(f"{self.url}/{name}: not a ring answer")
        last = _int(answer.get("last"))
        if last < self._since[name]:  # the router restarted: start again
            self._since[name] = 0
            if name == "decisions":
                self._decisions.clear()
                self._latencies.clear()
                self._explained = None
            else:
                self._events.clear()
            return self._ring(name)
        self._since[name] = last
        return [e for e in answer[name] if isinstance(e, dict)]

    def poll(self) -> Snapshot:
        client = self._client
        loads_answer: Any = _asking(client, "/loads", client.loads)
        workers_answer: Any = _asking(client, "/workers", client.workers)
        text = _asking(client, "/metrics", client.metrics)
        if not isinstance(loads_answer, list) or not isinstance(workers_answer, list):
            raise BadSource(f"{self.url}: /loads, /workers or /metrics answered in an unexpected shape")
        for entry in self._ring("decisions"):
            self._decisions.append(entry)
            self._latencies.append(_float(entry.get("decision_us")))
            if entry.get("explain"):
                self._explained = entry
        for entry in self._ring("events"):
            self._events.append(entry)
            if entry.get("kind") == "gaps_detected":
                self._last_gap_at = _float(entry.get("at"))
        metrics = _metrics(text, self.url)
        loads = _flat_loads(loads_answer)
        self._partitions = _partitions(loads)
        p50, p99 = percentiles(list(self._latencies), 0.5, 0.99)
        statuses = metrics.get("kvrouter_shard_status", {})
        queries = _where(metrics, "kvrouter_http_requests_total", "endpoint", "/query", "/query_by_hash")
        decisions = _int(_where(metrics, "kvrouter_decisions_total"))
        return Snapshot(
            source=self.url,
            taken_at=self._clock(),
            started_at=_where(metrics, "kvrouter_start_time_seconds"),
            shards=len({dict(k).get("shard") for k in statuses}),
            shards_up=_int(_where(metrics, "kvrouter_shard_status", "status", "up")),
            shards_recovering=_int(_where(metrics, "kvrouter_shard_status", "status", "recovering")),
            events_total=_int(_where(metrics, "kvrouter_kv_events_total")),
            queries_total=decisions + _int(queries),
            decisions_total=decisions,
            route_p50_us=p50,
            route_p99_us=p99,
            gaps_detected=_int(_where(metrics, "kvrouter_kv_event_gaps_total", "outcome", "detected")),
            gaps_recovered=_int(_where(metrics, "kvrouter_kv_event_gaps_total", "outcome", "recovered")),
            gaps_lost=_int(_where(metrics, "kvrouter_kv_event_gaps_total", "outcome", "lost")),
            last_gap_at=self._last_gap_at,
            weights={dict(k).get("name", "?"): v for k, v in metrics.get("kvrouter_router_weight", {}).items()},
            workers=_http_workers(loads, workers_answer),
            decisions=_recent(self._decisions, self._explained),
            events=tuple(log_event_of(e) for e in self._events),
            index_lag_ms=_lag_ms(metrics.get("kvrouter_index_lag_seconds", {}).values(), 1e3),
            replicas=_int(_where(metrics, "kvrouter_replica_sync_peers"))
            if "kvrouter_replica_sync_peers" in metrics
            else None,
            sync_lag_ms=_lag_ms(metrics.get("kvrouter_replica_sync_lag_seconds", {}).values(), 1e3),
            shadows=_metric_shadows(metrics),
            index_blocks=_int(_where(metrics, "kvrouter_index_blocks")) if "kvrouter_index_blocks" in metrics else None,
            index_blocks_cap=_int(_where(metrics, "kvrouter_index_blocks_cap")),
            index_evicted=_int(_where(metrics, "kvrouter_index_evictions_total")),
        )

    def probe(self, tokens: Sequence[int]) -> tuple[ProbeRow, ...]:
        if not self._partitions:
            self.poll()
        return _probe(self._client, self._partitions, tokens)

    def close(self) -> None:
        """Close the client: its kept-alive connection and its loop's thread."""
        self._client.close()


Labels = tuple[tuple[str, str], ...]


def _metrics(text: str, url: str) -> dict[str, dict[Labels, float]]:
    """``/metrics`` as sample name -> labels -> value.

    Raises:
        BadSource: the text is not Prometheus exposition.
    """
    out: dict[str, dict[Labels, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = float(sample.value)
    except (ValueError, TypeError) as exc:
        raise BadSource(f"{url}/metrics: not Prometheus text: {exc}") from exc
    return out


def _problems(value: Any) -> tuple[str, ...]:
    """The service's misconfiguration messages of a worker (``trust.py``), by check name."""
    if not isinstance(value, Mapping):
        return ()
    return tuple(str(message) for _, message in sorted(value.items()))


def _blob_shadows(value: Any) -> dict[str, Shadow]:
    """The stats blob's ``shadows``: per policy, the six sums in ``Shadow``'s order."""
    if not isinstance(value, Mapping):
        return {}
    return {
        str(name): Shadow(*(_float(v) for v in sums))
        for name, sums in value.items()
        if isinstance(sums, list | tuple) and len(sums) == len(fields(Shadow))
    }


_SHADOW_METRICS: Final = (
    "kvrouter_shadow_decisions_total",
    "kvrouter_shadow_agreements_total",
    "kvrouter_shadow_overlap_blocks_total",
    "kvrouter_shadow_live_overlap_blocks_total",
    "kvrouter_shadow_cost_total",
    "kvrouter_shadow_live_cost_total",
)


def _metric_shadows(metrics: Mapping[str, Mapping[Labels, float]]) -> dict[str, Shadow]:
    """The same from ``/metrics``' ``kvrouter_shadow_*`` families."""
    policies = {dict(k).get("policy", "?") for k in metrics.get(_SHADOW_METRICS[0], {})}
    return {p: Shadow(*(_where(metrics, name, "policy", p) for name in _SHADOW_METRICS)) for p in sorted(policies)}


def _where(metrics: Mapping[str, Mapping[Labels, float]], name: str, label: str = "", *values: str) -> float:
    """The sum of ``name``'s samples, only those whose ``label`` is one of ``values`` when given."""
    series = metrics.get(name, {})
    return sum(v for k, v in series.items() if not label or dict(k).get(label) in values)


def _flat_loads(answer: Iterable[Any]) -> list[dict[str, Any]]:
    """``GET /loads``'s partitions flattened: one entry per worker, with its partition's names."""
    loads = []
    for partition in answer:
        if isinstance(partition, dict):
            names = {"model_name": partition.get("model_name"), "routing_group": partition.get("routing_group")}
            loads += [{**load, **names} for load in partition.get("loads") or () if isinstance(load, dict)]
    return loads


def _http_workers(loads: Iterable[Mapping[str, Any]], instances: Iterable[Any]) -> tuple[WorkerRow, ...]:
    """Worker rows from ``/loads`` (the booked load) joined with ``/workers``' listeners (the event plane)."""
    listeners: dict[tuple[int, int], dict[str, Any]] = {}
    accuracy: dict[tuple[int, int], dict[str, Any]] = {}
    for instance in instances:
        if isinstance(instance, dict) and isinstance(instance.get("listeners"), dict):
            for rank, listener in instance["listeners"].items():
                if isinstance(listener, dict) and str(rank).isdigit():
                    listeners[_int(instance.get("instance_id")), int(rank)] = listener
        if isinstance(instance, dict) and isinstance(instance.get("accuracy"), dict):
            for rank, view in instance["accuracy"].items():
                if isinstance(view, dict) and str(rank).isdigit():
                    accuracy[_int(instance.get("instance_id")), int(rank)] = view
    workers = []
    for load in loads:
        listener = listeners.get((_int(load.get("worker_id")), _int(load.get("dp_rank"))), {})
        unhealthy = None if load.get("schedulable", True) else "skipped"
        plane = listener.get("state") if isinstance(listener.get("state"), str) else None
        approximate = listener.get("status") == "approximate"
        state = _state(plane, bool(listener.get("stale")), unhealthy, approximate, listener.get("trust"))
        gaps = (_int(listener.get("gaps_detected")), _int(listener.get("gaps_lost")))
        last = _opt_float(listener.get("last_event_at"))
        tiers = listener.get("cached_by_tier")
        if not isinstance(tiers, dict):  # a router from before layout 3: its device count only
            tiers = {TIERS[0]: listener.get("cached_blocks")}
        view = accuracy.get((_int(load.get("worker_id")), _int(load.get("dp_rank"))), {})
        load = {
            **load,
            "accuracy": view.get("rolling"),
            "drift": view.get("drift"),
            "problems": listener.get("problems"),
        }
        workers.append(_row(load, state, tiers, gaps, last))
    return tuple(sorted(workers, key=lambda w: w.key))
