"""``kvrouter replay --from FILE``: a recording run again in logical time, in this process.

The recording's records are taken in their interleaving order (``(t, n)``, ``recording/format.py``): event
batches are decoded again by the codec the worker registered with and applied to a :class:`RadixIndex`
(the oracle every kvrouter index is tested against; an :class:`ApproxIndex` in approximate mode), and
every router call is made again on a :class:`Router` per partition, built with the recorded config and
seed and reading a clock held at each record's time, exactly as the live router read it
(``recording/clock.py``). With nothing changed, every decision must come out as recorded; with
``overrides`` (``--router KEY=VALUE``) the same calls show what a changed router would have decided.

The index at a decision: an event batch counts as seen by a decision when its apply finished before the
decision began. A batch whose apply overlapped the decision's index walk (it began before the decision
ended and finished after it began) may or may not have been seen live; when the replayed index's overlaps
differ from the recorded ones, the fewest such records (per shard, in order) that make them agree are
applied before the decision (``races``). Any remaining difference is counted in ``index_differs`` and
reported with the decisions it concerns: a decision can then differ because the index did, not the router.

What a changed router cannot change: the events. They are what the engines did with the recorded
decisions; a router that sends a request elsewhere would have made other engines cache it. The replay
reports the decisions and the hit rate the index offered them (overlap / prompt blocks); what the engines
would then have cached is the simulator's question (``kvrouter simulate``).

Rejected: replaying into the shared-memory engine (forks appliers, and its applies are asynchronous, so a
decision would need a flush per record to see exactly what was recorded); re-deriving the interleaving
from the decisions' recorded overlaps alone (the overlaps say what a decision saw, not when each batch landed).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.table import Table

from ..errors import ConfigError, DuplicateRequest, EventError, KvRouterError, NoWorkerAvailable
from ..events.codecs import BatchDecoder, kvrouter, sglang, vllm
from ..events.model import Cleared, EngineHash, Removed, StorageTier, WorkerKey
from ..index import ApproxIndex
from ..index.reference import RadixIndex
from ..index.writer import AFTER_EVICTION
from ..recording import HeldClock, Recording
from ..routing.config import RouterConfig
from ..routing.router import NTIERS, Router
from ..routing.slots import DEFAULT_EXPIRY_SECS, SlotManager

__all__ = [
    "DIFFERENCES_KEPT",
    "LogicalReplay",
    "ReplayReport",
    "parse_overrides",
    "render",
    "replay_recording",
    "router_config",
]

log = logging.getLogger(__name__)

INDEX_KINDS: Final = ("ev", "clr", "evict")
"""The records that change the index, applied in ``(t, n)`` order or early by the race check."""
DIFFERENCES_KEPT: Final = 20
"""Differing decisions listed in the report (all are counted)."""
RACE_WINDOW_NS: Final = 1_000_000_000
"""How far past a decision the replay looks for a batch whose apply overlapped it: an apply that began
before the decision ended but took longer than this to finish is not looked for."""


def router_config(header: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> RouterConfig:
    """The recorded router config, with ``overrides`` (field name → value) applied.

    Raises:
        ConfigError: an unknown field, or a value the config refuses.
    """
    known = {f.name for f in fields(RouterConfig)}
    recorded = {k: v for k, v in dict(header.get("router") or {}).items() if k in known}
    for name in overrides or {}:
        if name not in known:
            raise ConfigError(f"router override {name!r}: not a RouterConfig field ({', '.join(sorted(known))})")
    return RouterConfig(**{**recorded, **(overrides or {})})


@dataclass(slots=True)
class _Partition:
    block_size: int
    router: Router
    approx: ApproxIndex | None


@dataclass(slots=True)
class ReplayReport:
    """What ``--from`` prints and ``--json`` holds (``as_json``)."""

    path: str
    version: int
    kvrouter: str
    seed: int
    overrides: dict[str, Any]
    records: int = 0
    event_batches: int = 0
    event_errors: int = 0
    """Events the index refused (parent not found, ...): the live appliers counted them alike."""
    after_eviction: int = 0
    """Events naming a block the cap had evicted from their worker (its Removed, a Stored under it): not
    errors, as the live applier counts them (``kvrouter_index_events_after_eviction_total``)."""
    decisions: int = 0
    matched: int = 0
    """Decisions with the recorded outcome: the same worker, or the same refusal."""
    index_differs: int = 0
    """Decisions whose replayed overlaps differ from the recorded ones (after the race check)."""
    races: int = 0
    """Decisions whose overlaps agreed once a batch applied while they ran was counted as seen."""
    recorded_hit_blocks: int = 0
    replayed_hit_blocks: int = 0
    prompt_blocks: int = 0
    dropped: int | None = None
    """Records the recorder dropped (front + appliers); None: the file has no end record."""
    evicted: int = 0
    """Entries the recorded run's index cap evicted (``--max-index-blocks``), from the end record."""
    evictions: int = 0
    """Evicted rows replayed from the ``evict`` records (the replay's index has no cap of its own). A run
    that evicted with none recorded (a recording made before they were) may differ from its first eviction on."""
    cut_at: int | None = None
    """Where a frame cut short ended the file (``--allow-cut``); None: whole."""
    differences: list[dict[str, Any]] = field(default_factory=list)

    @property
    def differing(self) -> int:
        return self.decisions - self.matched

    def as_json(self) -> dict[str, Any]:
        return {
            "recording": self.path,
            "version": self.version,
            "kvrouter": self.kvrouter,
            "seed": self.seed,
            "overrides": self.overrides,
            "records": self.records,
            "event_batches": self.event_batches,
            "event_errors": self.event_errors,
            "after_eviction": self.after_eviction,
            "decisions": self.decisions,
            "matched": self.matched,
            "differing": self.differing,
            "index_differs": self.index_differs,
            "races": self.races,
            "hit_rate": {
                "recorded": _ratio(self.recorded_hit_blocks, self.prompt_blocks),
                "replayed": _ratio(self.replayed_hit_blocks, self.prompt_blocks),
            },
            "dropped": self.dropped,
            "evicted": self.evicted,
            "evictions_replayed": self.evictions,
            "cut_at": self.cut_at,
            "differences": self.differences,
        }


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0


def _key(value: Sequence[int] | None) -> WorkerKey | None:
    return None if value is None else (int(value[0]), int(value[1]))


class LogicalReplay:
    """One replay of a recording (see the module docstring).

    Args:
        recording: the file read back (``read_recording``).
        overrides: RouterConfig fields to change (``{"router_temperature": 0.5}``); none: the recorded config.

    Raises:
        ConfigError: an override the config refuses.
    """

    def __init__(self, recording: Recording, overrides: Mapping[str, Any] | None = None) -> None:
        header = recording.header
        self.recording = recording
        self.config = router_config(header, overrides)
        self.seed = int(header.get("seed", 0))
        self.expiry_secs = float(header.get("expiry_secs", DEFAULT_EXPIRY_SECS))
        self.clock = HeldClock()
        self.index = RadixIndex()
        self.partitions: dict[tuple[str, str], _Partition] = {}
        self.owner: dict[int, tuple[str, str]] = {}
        self.reservations: dict[str, tuple[str, str]] = {}
        self.decoders: dict[tuple[int, int, str, int], BatchDecoder] = {}
        self.evicted_from: set[WorkerKey] = set()
        """Workers some of whose blocks an ``evict`` record removed."""
        self.shard_of: dict[WorkerKey, int] = {}
        """Each worker's shard, as its appliers' records say."""
        end = recording.end
        self.report = ReplayReport(
            str(recording.path),
            int(header["version"]),
            str(header.get("kvrouter", "")),
            self.seed,
            dict(overrides or {}),
            dropped=None if end is None else int(end.get("dropped", 0)) + int(end.get("tap_dropped", 0)),
            evicted=0 if end is None else int(end.get("evicted", 0)),
            cut_at=recording.cut_at,
        )

    # -- the index ----------------------------------------------------------------------------

    def _clear(self, worker: WorkerKey) -> None:
        for tier in StorageTier:
            self.index.apply_event(worker[0], Cleared(worker[0], dp_rank=worker[1], tier=tier))

    def _events(self, record: Mapping[str, Any]) -> None:
        worker, rank, fmt, block_size = int(record["w"]), int(record["r"]), str(record["fmt"]), int(record["bs"])
        key = (worker, rank, fmt, block_size)
        decoder = self.decoders.get(key)
        if decoder is None:  # the codec the applier's stream used (``decode`` is its ``decode_raw`` + objects)
            if fmt == "kvrouter":
                decoder = kvrouter.Decoder()
            else:
                decoder = (vllm if fmt == "vllm" else sglang).Decoder(worker, block_size)
            self.decoders[key] = decoder
        self.report.event_batches += 1
        try:
            batch = decoder.decode(bytes(record["p"]))
        except EventError:  # the live stream refused it before applying anything: not recorded then
            self.report.event_errors += 1
            return
        evicted = (worker, rank) in self.evicted_from
        for event in batch.events[int(record.get("skip", 0)) :]:
            try:
                self.index.apply_event(worker, event)
            except EventError as exc:  # the live applier's rule (``ShardWriter._excuse``): once the cap took a
                if evicted and exc.kind in AFTER_EVICTION:  # worker's blocks, an unknown one is taken for one
                    self.report.after_eviction += 1
                else:
                    self.report.event_errors += 1

    def _apply_index_record(self, record: Mapping[str, Any]) -> None:
        kind = record["k"]
        if "shard" in record:
            self.shard_of[int(record["w"]), int(record["r"])] = int(record["shard"])
        if kind == "ev":
            self._events(record)
        elif kind == "evict":  # what the index cap evicted: as the Removed events that would have done it
            worker, rank = int(record["w"]), int(record["r"])
            hashes = tuple(EngineHash(h) for h in np.frombuffer(record["h"], dtype="<u8").tolist())
            self.report.evictions += len(hashes)
            self.evicted_from.add((worker, rank))
            tier = list(StorageTier)[int(record["tier"])]
            try:
                self.index.apply_event(worker, Removed(worker, hashes, dp_rank=rank, tier=tier))
            except EventError:  # the replayed index already lacks a block the live one evicted: counted, not fatal
                self.report.event_errors += 1
        else:
            self._clear((int(record["w"]), int(record["r"])))

    # -- the routers --------------------------------------------------------------------------

    def _router(self, config: RouterConfig, block_size: int, slots: SlotManager | None = None) -> Router:
        return Router(config, block_size=block_size, seed=self.seed, clock=self.clock, slots=slots)

    def _register(self, record: Mapping[str, Any]) -> None:
        name = (str(record["m"]), str(record["g"]))
        worker = int(record["w"])
        self.owner[worker] = name
        if name in self.partitions:
            return
        block_size = int(record["bs"])
        config = self.config
        slots = SlotManager(
            block_size=block_size,
            track_active_blocks=config.router_track_active_blocks,
            track_prefill_tokens=config.router_track_prefill_tokens,
            assume_kv_reuse=config.router_assume_kv_reuse,
            expiry_secs=self.expiry_secs,
            clock=self.clock,
        )
        router = self._router(config, block_size, slots)
        approx = None if config.use_kv_events else ApproxIndex(ttl=config.router_ttl_secs, clock=self.clock)
        self.partitions[name] = _Partition(block_size, router, approx)

    def _unregister(self, record: Mapping[str, Any]) -> None:
        worker = int(record["w"])
        # the live engine stops following every rank of the worker and follows the others again (each
        # rejoining, recorded as a ``clr`` then its events), so the index forgets the whole worker here
        self.index.remove_worker(worker)
        for partition in self.partitions.values():
            if partition.approx is not None:
                partition.approx.remove_worker(worker)

    def _thresholds(self, record: Mapping[str, Any]) -> None:
        partition = self.partitions.get((str(record["m"]), str(record["g"])))
        if partition is None:
            return
        old = partition.router
        config = replace(
            old.config,
            active_decode_blocks_threshold=record.get("decode"),
            active_prefill_tokens_threshold=record.get("prefill"),
        )
        partition.router = self._router(config, partition.block_size, old.slots)
        partition.router.set_untrusted(old.untrusted)

    def _overlaps(self, index: Any, local: npt.NDArray[np.uint64], candidates: Sequence[WorkerKey]) -> list[list[int]]:
        """The index's answer for the candidates as the router's record holds it: ``(tiers, candidates)``."""
        by_tier = index.find_matches_by_tier(local.tolist())
        return [[int(by_tier.get(tier, {}).get(key, 0)) for key in candidates] for tier in list(StorageTier)[:NTIERS]]

    def _decide(self, record: Mapping[str, Any], later: Sequence[Mapping[str, Any]], taken: set[int]) -> None:
        report = self.report
        name = (str(record["m"]), str(record["g"]))
        partition = self.partitions.get(name)
        report.decisions += 1
        local = np.frombuffer(bytes(record["h"]), dtype="<u8").astype(np.uint64)
        candidates = tuple((int(w), int(r)) for w, r in record["cand"])
        recorded_worker = _key(record.get("w"))
        recorded_error = record.get("err")
        if partition is None:
            self._differ(record, None, "no such partition", recorded_worker, recorded_error)
            return
        index: Any = partition.approx if partition.approx is not None else self.index
        down = record.get("down")
        if down:  # shards the live walk could not read: their workers had overlap 0 for this decision
            index = _Unanswered(index, {key for key, shard in self.shard_of.items() if shard in down})
        recorded_overlaps = record.get("ov")
        if recorded_overlaps is not None and self._overlaps(index, local, candidates) != recorded_overlaps:
            if self._race(record, index, local, candidates, later, taken):
                report.races += 1
            else:
                report.index_differs += 1
        router = partition.router
        router.set_untrusted((int(w), int(r)) for w, r in record.get("untr") or ())
        capacities = None if record.get("cap") is None else {(int(w), int(r)): int(c) for w, r, c in record["cap"]}
        request_id = record.get("id")
        worker: WorkerKey | None = None
        error: str | None = None
        overlap = 0
        try:
            selection = router.select(
                index,
                candidates,
                local_hashes=local,
                isl_tokens=int(record["isl"]),
                capacities=capacities,
                request_id=request_id,
            )
            worker, overlap = selection.worker, selection.overlap_blocks
        except NoWorkerAvailable:
            error = "overloaded"
        except DuplicateRequest:
            error = "duplicate"
        except KvRouterError as exc:
            error = f"error: {exc}"
        if worker is not None and request_id is not None:
            self.reservations[str(request_id)] = name
        if not record.get("probe") and recorded_error is None:
            report.prompt_blocks += len(local)
            report.recorded_hit_blocks += int(record.get("o") or 0)
            report.replayed_hit_blocks += overlap
        if worker == recorded_worker and error == recorded_error:
            report.matched += 1
        else:
            self._differ(record, worker, error, recorded_worker, recorded_error)

    def _race(
        self,
        record: Mapping[str, Any],
        index: Any,
        local: npt.NDArray[np.uint64],
        candidates: Sequence[WorkerKey],
        later: Sequence[Mapping[str, Any]],
        taken: set[int],
    ) -> bool:
        """Apply, shard by shard, the fewest index records whose apply overlapped this decision that make the
        shard's candidates' overlaps agree with the recorded ones (see the module docstring); whether all agree.

        Shard by shard, because the live walk read each shard at its own instant; record by record, because
        a batch's ``evict`` records land after its events (``ShardWriter._evict`` runs at the batch's end), so
        a walk may have seen a batch's blocks but not yet its eviction. Records of a shard apply in order:
        the walk saw a prefix of what its applier wrote."""
        recorded = record["ov"]
        began, ended = int(record["t"]), int(record.get("t1", record["t"]))
        raced: dict[int | None, list[Mapping[str, Any]]] = {}
        for other in later:
            if other["t"] > ended + RACE_WINDOW_NS:
                break
            overlapped = int(other.get("t0", other["t"])) <= ended and other["t"] >= began
            if overlapped and other["k"] in INDEX_KINDS and other["n"] not in taken:
                raced.setdefault(other.get("shard"), []).append(other)
        shard_of: dict[WorkerKey, int | None] = {**self.shard_of}
        for shard, records in raced.items():
            shard_of.update(((int(other["w"]), int(other["r"])), shard) for other in records)
        columns: dict[int | None, list[int]] = {}
        for column, key in enumerate(candidates):
            columns.setdefault(shard_of.get(key), []).append(column)

        def agrees(shard: int | None) -> bool:
            mine = self._overlaps(index, local, candidates)
            return all(mine[tier][c] == recorded[tier][c] for tier in range(len(mine)) for c in columns.get(shard, ()))

        for shard, records in raced.items():
            for other in records:
                if agrees(shard):
                    break
                taken.add(other["n"])
                self._apply_index_record(other)
        return bool(raced) and self._overlaps(index, local, candidates) == recorded

    def _differ(
        self,
        record: Mapping[str, Any],
        worker: WorkerKey | None,
        error: str | None,
        recorded_worker: WorkerKey | None,
        recorded_error: str | None,
    ) -> None:
        if len(self.report.differences) < DIFFERENCES_KEPT:
            self.report.differences.append(
                {
                    "n": record["n"],
                    "request_id": record.get("id"),
                    "recorded": list(recorded_worker) if recorded_worker else recorded_error,
                    "replayed": list(worker) if worker else error,
                }
            )

    def _booked(self, record: Mapping[str, Any]) -> None:
        request_id = str(record["id"])
        name = self.reservations.get(request_id)
        partition = None if name is None else self.partitions.get(name)
        if partition is None:
            return
        try:
            if record["k"] == "pc":
                partition.router.slots.mark_prefill_completed(request_id)
            else:
                partition.router.slots.free(request_id)
                self.reservations.pop(request_id, None)
        except KvRouterError:
            pass  # a changed router's bookings may differ; the live one had it

    def run(self) -> ReplayReport:
        """Replay every record once, in order; returns the report."""
        records = self.recording.records
        taken: set[int] = set()
        """Index records applied early by :meth:`_race`."""
        clock = self.clock
        for position, record in enumerate(records):
            kind = record["k"]
            self.report.records += 1
            if kind in INDEX_KINDS:
                if record["n"] not in taken:
                    self._apply_index_record(record)
                continue
            clock.held = record["t"] / 1e9
            try:
                if kind == "dec":
                    self._decide(record, records[position + 1 :], taken)
                elif kind in ("pc", "free"):
                    self._booked(record)
                elif kind == "reg":
                    self._register(record)
                elif kind == "unreg":
                    self._unregister(record)
                elif kind == "busy":
                    self._thresholds(record)
                elif kind == "sweep":
                    partition = self.partitions.get((str(record["m"]), str(record["g"])))
                    if partition is not None:
                        partition.router.slots.sweep()
            finally:
                clock.release()
        return self.report


class _Unanswered:
    """An index whose answers leave out ``hidden`` workers: a live decision's view when its walk could not
    read their shard (``dec``'s ``down``)."""

    def __init__(self, index: Any, hidden: set[WorkerKey]) -> None:
        self._index = index
        self._hidden = hidden

    def find_matches_by_tier(self, local_hashes: Sequence[int]) -> dict[StorageTier, dict[WorkerKey, int]]:
        answer: dict[StorageTier, dict[WorkerKey, int]] = self._index.find_matches_by_tier(local_hashes)
        return {tier: {k: v for k, v in found.items() if k not in self._hidden} for tier, found in answer.items()}


def replay_recording(recording: Recording, overrides: Mapping[str, Any] | None = None) -> ReplayReport:
    """Replay ``recording`` in logical time (see the module docstring) and report.

    Raises:
        ConfigError: an override the config refuses.
    """
    return LogicalReplay(recording, overrides).run()


def parse_overrides(values: Iterable[str]) -> dict[str, Any]:
    """``KEY=VALUE`` router overrides (``--router``): KEY a RouterConfig field or a ``kvrouter up`` router flag
    (``router-temperature``, ``router_kv_overlap_score_credit``...); VALUE a number, true/false, none, or text.

    Raises:
        ConfigError: no ``=``, or a key that names no router setting.
    """
    from ..cli.up import ROUTER_FLAGS

    known = {f.name for f in fields(RouterConfig)}
    out: dict[str, Any] = {}
    for item in values:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"router override {item!r}: expected KEY=VALUE")
        name = key.strip().lstrip("-").replace("-", "_")
        name = ROUTER_FLAGS.get(name, name)
        if name not in known:
            raise ConfigError(f"router override {key!r}: no such router setting")
        out[name] = _value(text.strip())
    return out


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null", "off"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def render(console: Console, report: ReplayReport) -> None:
    """The replay's summary, and its differing decisions, as ``--from`` prints them."""
    data = report.as_json()
    table = Table(title=f"replay of {report.path} (format v{report.version}, kvrouter {report.kvrouter})")
    for column in ("decisions", "matched", "differing", "index differs", "races", "hit rate (recorded)", "events"):
        table.add_column(column, justify="right")
    table.add_row(
        str(report.decisions),
        str(report.matched),
        str(report.differing),
        str(report.index_differs),
        str(report.races),
        f"{data['hit_rate']['replayed']:.3f} ({data['hit_rate']['recorded']:.3f})",
        f"{report.event_batches} batches, {report.event_errors} refused"
        + (f", {report.after_eviction} after eviction" if report.after_eviction else ""),
    )
    console.print(table)
    if report.overrides:
        console.print(f"router overrides: {', '.join(f'{k}={v}' for k, v in report.overrides.items())}")
    if report.cut_at is not None:
        console.print(f"the recording is cut short at byte {report.cut_at}: the frames before it were replayed")
    if report.dropped is None:
        console.print("the recording has no end record: its router did not close it (killed, or still running)")
    elif report.dropped:
        console.print(f"the recorder dropped {report.dropped} records: decisions may differ for that reason")
    if report.evicted and not report.evictions:
        console.print(
            f"the recorded run's index cap (--max-index-blocks) evicted {report.evicted} entries and the recording"
            " has no evict records: overlaps and decisions may differ from the first eviction on"
        )
    elif report.evicted:
        console.print(
            f"the recorded run's index cap evicted {report.evicted} entries: replayed from {report.evictions}"
            " evicted rows"
        )
    for difference in report.differences:
        console.print(
            f"  record {difference['n']} request {difference['request_id']}: "
            f"recorded {difference['recorded']}, replayed {difference['replayed']}"
        )
    if report.differing > len(report.differences):
        console.print(f"  ... and {report.differing - len(report.differences)} more")
