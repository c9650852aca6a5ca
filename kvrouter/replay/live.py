"""``kvrouter replay --from FILE --live``: a recording played against a live router, at any speed.

This process stands in for the recorded engines and clients: for each recorded worker it binds a ZMQ PUB,
registers it with the router (under the model ``replay:<model>`` and ids offset by :data:`ID_OFFSET`, so a
live fleet's partitions and ids are never touched), re-publishes every recorded event batch at its
recorded time divided by ``speed``, and makes every recorded router call over HTTP at its time:
``/select_and_reserve`` (or ``/select``) with the recorded local hashes and ISL, then the reservation's
prefill completion and free. The router under test decides for itself, on its own index built from the
re-published events; the report compares its decisions with the recorded ones (agreement) and the hit
rate its index offered them (overlap / prompt blocks) with the recorded one.

Event ids: vLLM and SGLang payloads carry none (the ZMQ sequence number is this process's, consecutive
per worker and rank, back to 0 where the recording has an engine restart, so the router clears the worker
as it did). kvrouter-format payloads carry event ids: they are decoded and encoded again with ids
renumbered the same way, without the events the live router had already applied (``skip``).

What this is not: a replay of the engines. No engine caches anything here; the events are the recorded
ones, so a router that decides differently is judged on the index the recorded decisions produced (as in
the logical replay). Agreement is a statistic, not an identity: the router under test has its own seed,
and live timing moves batches against decisions. For the exact check use the logical replay (no
``--live``).

Rejected: driving mock engines with the recorded requests (a recording holds local hashes, not token ids,
and not the output lengths: the engines would cache other blocks than the recorded fleet did).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import zmq
import zmq.asyncio
from rich.console import Console
from rich.table import Table

from ..client import ApiError, Client, Selection, ServiceUnreachable
from ..errors import BadEvent
from ..events.codecs import kvrouter as kvrouter_codec
from ..recording import Recording
from .stack import LocalStack, ReplayError, StackConfig

__all__ = ["ID_OFFSET", "LiveReport", "render_live", "replay_live", "router_flags"]

log = logging.getLogger(__name__)

ID_OFFSET: Final = 1_000_000
"""Added to every recorded worker id when registering it with the live router."""
MODEL_PREFIX: Final = "replay:"
JOIN_TIMEOUT_S: Final = 30.0
"""How long a registered worker may take to be followed (its listener active) before the replay goes on."""
HTTP_TIMEOUT_S: Final = 30.0


@dataclass(slots=True)
class LiveReport:
    """What ``--live`` prints and ``--json`` holds."""

    path: str
    url: str
    speed: float
    decisions: int = 0
    answered: int = 0
    agreed: int = 0
    """Answered decisions that chose the recorded worker."""
    refused: int = 0
    """Calls the router refused (every worker busy, no worker, ...)."""
    event_batches: int = 0
    recorded_hit_blocks: int = 0
    live_hit_blocks: int = 0
    prompt_blocks: int = 0
    late_s: float = 0.0
    """The largest lag of a record behind its scheduled time."""
    elapsed_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        def ratio(part: int, whole: int) -> float:
            return round(part / whole, 4) if whole else 0.0

        return {
            "recording": self.path,
            "url": self.url,
            "speed": self.speed,
            "decisions": self.decisions,
            "answered": self.answered,
            "agreed": self.agreed,
            "agreement": ratio(self.agreed, self.answered),
            "refused": self.refused,
            "event_batches": self.event_batches,
            "hit_rate": {
                "recorded": ratio(self.recorded_hit_blocks, self.prompt_blocks),
                "live": ratio(self.live_hit_blocks, self.prompt_blocks),
            },
            "late_s": round(self.late_s, 3),
            "elapsed_s": round(self.elapsed_s, 2),
            "errors": self.errors[:20],
        }


@dataclass(slots=True)
class _Rank:
    """One recorded (worker, dp_rank) this process publishes for."""

    socket: zmq.asyncio.Socket
    endpoint: str
    seq: int = 0
    next_id: int = 0
    published: bool = False
    """A batch went out since the worker's registration."""
    rebuilding: bool = False
    """The recorded router is rebuilding a followed worker (its applier restarted): the history it fetches
    again was published already, so recovered batches are skipped until a live one comes."""


class _Player:
    def __init__(self, recording: Recording, client: Client, speed: float) -> None:
        self.recording = recording
        self.client = client
        self.url = client.url
        self.speed = speed
        self.context = zmq.asyncio.Context()
        self.ranks: dict[tuple[int, int], _Rank] = {}
        self.registered: dict[int, tuple[str, set[int]]] = {}
        self.booked: set[str] = set()
        """The recorded ids of the reservations the live router booked and has not freed."""
        self.run_id = secrets.token_hex(4)
        self.report = LiveReport(str(recording.path), self.url, speed)

    def _error(self, what: str) -> None:
        self.report.errors.append(what)
        if len(self.report.errors) == 1:
            log.warning("live replay: %s", what)

    # -- workers and their events ---------------------------------------------------------------

    def _rank(self, worker: int, rank: int) -> _Rank:
        found = self.ranks.get((worker, rank))
        if found is None:
            socket = self.context.socket(zmq.XPUB)  # a PUB that hears its subscribers subscribe
            socket.setsockopt(zmq.XPUB_VERBOSE, 1)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 1 << 20)
            port = socket.bind_to_random_port("tcp://127.0.0.1")
            found = self.ranks[(worker, rank)] = _Rank(socket, f"tcp://127.0.0.1:{port}")
        return found

    async def _register(self, record: Mapping[str, Any]) -> None:
        worker, rank = int(record["w"]), int(record["r"])
        model = MODEL_PREFIX + str(record["m"])
        target = self._rank(worker, rank)
        endpoint = target.endpoint
        target.seq = target.next_id = 0  # a registration is a new stream to the router: from 0
        target.published = target.rebuilding = False
        with contextlib.suppress(zmq.Again):
            while True:  # subscriptions of an earlier registration
                await target.socket.recv(zmq.NOBLOCK)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            try:
                await self.client.register(
                    worker + ID_OFFSET,
                    endpoint,
                    model_name=model,
                    routing_group=record["g"],
                    block_size=record["bs"],
                    dp_rank=rank,
                    format=record["fmt"],
                    role=record.get("role", "both"),
                    topology_domain=record.get("dom"),
                    lora_adapters=record.get("lora"),
                )
                break
            except ApiError as exc:
                if exc.status == 503 and time.monotonic() < deadline:  # a router started for us may be starting
                    await asyncio.sleep(0.1)
                    continue
                self._error(f"register worker {worker} dp {rank}: {exc.status} {exc.message[:200]}")
                return
        self.registered.setdefault(worker, (model, set()))[1].add(rank)
        try:  # events sent before the router's SUB subscribed would be lost: wait for its subscription
            while True:
                message = await asyncio.wait_for(target.socket.recv(), max(0.0, deadline - time.monotonic()))
                if message[:1] == b"\x01":
                    return
        except TimeoutError:
            self._error(f"worker {worker} dp {rank}: not subscribed to within {JOIN_TIMEOUT_S} s")

    async def _unregister(self, record: Mapping[str, Any]) -> None:
        worker = int(record["w"])
        entry = self.registered.get(worker)
        if entry is None:
            return
        rank = None if record.get("r") is None else int(record["r"])
        if rank is not None:
            entry[1].discard(rank)
        else:
            entry[1].clear()
        if not entry[1]:
            del self.registered[worker]
        try:
            await self.client.unregister(worker + ID_OFFSET, entry[0], dp_rank=rank)
        except ApiError as exc:
            self._error(f"unregister worker {worker}: {exc.status} {exc.message[:200]}")

    async def _publish(self, record: Mapping[str, Any]) -> None:
        target = self._rank(int(record["w"]), int(record["r"]))
        if record.get("rec"):
            if target.rebuilding:
                return
        else:
            target.rebuilding = False
        payload = bytes(record["p"])
        if record["fmt"] == "kvrouter":
            try:
                batch = kvrouter_codec.Decoder().decode(payload)
            except BadEvent as exc:
                self._error(f"a recorded batch does not decode: {exc}")
                return
            events = batch.events[int(record.get("skip", 0)) :]
            events = tuple(dataclasses.replace(e, event_id=target.next_id + i) for i, e in enumerate(events))
            target.next_id += len(events)
            payload = kvrouter_codec.Encoder(with_tokens=True).encode(dataclasses.replace(batch, events=events))
        await target.socket.send_multipart([b"", target.seq.to_bytes(8, "big"), payload])
        target.seq += 1
        target.published = True
        self.report.event_batches += 1

    def _cleared(self, record: Mapping[str, Any]) -> None:
        target = self._rank(int(record["w"]), int(record["r"]))
        why = record.get("why")
        if why in ("restart", "dump"):  # the router clears the worker when ids go back to 0
            target.seq = target.next_id = 0
        elif why in ("join", "segment") and target.published:  # not after a registration: an applier restarted
            target.rebuilding = True

    # -- router calls ---------------------------------------------------------------------------

    def _id(self, recorded: str) -> str:
        return f"replay-{self.run_id}-{recorded}"

    async def _decide(self, record: Mapping[str, Any]) -> None:
        report = self.report
        model = MODEL_PREFIX + str(record["m"])
        local = np.frombuffer(bytes(record["h"]), dtype="<u8").tolist()
        prompt: dict[str, Any] = {
            "routing_group": record["g"],
            "block_hashes": local,
            "isl_tokens": record["isl"],
            "lora_name": record.get("lora") or None,
        }
        reserve = record.get("id") is not None
        report.decisions += 1
        answer: Selection
        try:
            if reserve:
                answer = await self.client.select_and_reserve(model, selection_id=self._id(str(record["id"])), **prompt)
            else:
                answer = await self.client.select(model, probe=bool(record.get("probe")), **prompt)
        except ServiceUnreachable as exc:
            self._error(f"select: {exc!r}")
            return
        except ApiError:
            report.refused += 1
            return
        report.answered += 1
        if reserve:
            self.booked.add(str(record["id"]))
        worker = (int(answer["worker_id"]) - ID_OFFSET, int(answer["dp_rank"]))
        recorded = record.get("w")
        if recorded is not None and worker == (int(recorded[0]), int(recorded[1])):
            report.agreed += 1
        if not record.get("probe") and record.get("err") is None:
            block = int(answer.get("block_size") or 1)
            report.prompt_blocks += len(local)
            report.recorded_hit_blocks += int(record.get("o") or 0)
            report.live_hit_blocks += int(answer["overlap"]["gpu"]) // block

    async def _booked(self, record: Mapping[str, Any]) -> None:
        if str(record["id"]) not in self.booked:
            return
        selection = self._id(str(record["id"]))
        with contextlib.suppress(ApiError):  # expired or refused: the report counts decisions, not these
            if record["k"] == "pc":
                await self.client.prefill_complete(selection)
            else:
                self.booked.discard(str(record["id"]))
                await self.client.free(selection)

    async def play(self) -> LiveReport:
        records = self.recording.records
        if not records:
            return self.report
        base = records[0]["t"]
        started = time.monotonic()
        for record in records:
            due = started + (record["t"] - base) / 1e9 / self.speed
            lag = time.monotonic() - due
            if lag < 0:
                await asyncio.sleep(-lag)
            else:
                self.report.late_s = max(self.report.late_s, lag)
            kind = record["k"]
            if kind == "reg":
                await self._register(record)  # in line: what follows needs the worker followed
            elif kind == "unreg":
                await self._unregister(record)
            elif kind == "ev":
                await self._publish(record)
            elif kind == "clr":
                self._cleared(record)
            elif kind == "dec":  # in line, as every call: the recorded order of calls and batches is kept
                await self._decide(record)
            elif kind in ("pc", "free"):
                await self._booked(record)
        self.report.elapsed_s = time.monotonic() - started
        return self.report

    async def close(self) -> None:
        for worker, (model, _) in list(self.registered.items()):
            with contextlib.suppress(ApiError, ServiceUnreachable):
                await self.client.unregister(worker + ID_OFFSET, model)
        for rank in self.ranks.values():
            rank.socket.close(linger=0)
        self.context.term()


async def replay_live(
    recording: Recording, url: str | None, speed: float, *, shards: int = 2, logs: str | None = None
) -> LiveReport:
    """Play ``recording`` against the router at ``url`` (None: a ``kvrouter up`` started for it, its log kept
    in ``logs`` when given) at ``speed``.

    Raises:
        ReplayError: the router could not be started.
    """
    stack: LocalStack | None = None
    if url is None:
        seed = recording.header.get("seed")  # the recorded routers' seed: ties broken alike
        flags = router_flags(recording.header.get("router") or {})
        stack = LocalStack(StackConfig(mock_workers=0, shards=shards, router_seed=seed, router_args=flags, logs=logs))
        await stack.start()
        url = stack.url
    try:
        async with Client(url, timeout=HTTP_TIMEOUT_S) as client:
            player = _Player(recording, client, speed)
            try:
                return await player.play()
            finally:
                await player.close()
    except ServiceUnreachable as exc:
        raise ReplayError(f"the router at {url} did not answer: {exc}") from exc
    finally:
        if stack is not None:
            await stack.close()


def router_flags(recorded: Mapping[str, Any]) -> tuple[str, ...]:
    """``kvrouter up`` flags for the recorded router config (every field ``kvrouter up`` has a flag for; the
    others are ``kvrouter up``'s defaults in any recording it made)."""
    from ..cli.up import ROUTER_FLAGS  # here: the cli package imports every command

    args: list[str] = []
    for option, name in ROUTER_FLAGS.items():
        value = recorded.get(name)
        flag = option.replace("_", "-")
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            args += [f"--{flag}", str(value)]
    return tuple(args)


def render_live(console: Console, report: LiveReport) -> None:
    data = report.as_json()
    table = Table(title=f"live replay of {report.path} against {report.url} at x{report.speed:g}")
    for column in ("decisions", "answered", "agreed", "refused", "hit rate (recorded)", "events", "late s"):
        table.add_column(column, justify="right")
    table.add_row(
        str(report.decisions),
        str(report.answered),
        f"{report.agreed} ({data['agreement']:.0%})",
        str(report.refused),
        f"{data['hit_rate']['live']:.3f} ({data['hit_rate']['recorded']:.3f})",
        str(report.event_batches),
        f"{report.late_s:.2f}",
    )
    console.print(table)
    for error in report.errors[:5]:
        console.print(f"  {error}")
