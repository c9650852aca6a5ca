"""Record → replay round trip (issue 14, item 2): a real service records a short run, ``--from`` replays it.

The service runs in this process with ``record`` set (its appliers are real processes, their taps real
ZMQ sockets) and two real ``kvrouter mock-worker`` engines behind its ``/v1/completions`` proxy. Requests
go out four at a time, so event batches and decisions interleave; six conversations grow turn by turn on
a shared system prompt, so the index's overlaps decide. The replay in logical time must then give every
decision the recorded outcome; a changed router replays the same calls and decides for itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from typer.testing import CliRunner

from kvrouter.cli import app
from kvrouter.events.codecs import kvrouter as kvrouter_codec
from kvrouter.events.model import EngineHash, EventBatch, LocalHash, StorageTier, Stored, StoredBlock
from kvrouter.index.reference import RadixIndex
from kvrouter.recording import MAGIC, VERSION, Recording, frame, read_recording
from kvrouter.replay.logical import parse_overrides, replay_recording
from kvrouter.routing.config import RouterConfig
from kvrouter.service import Service, ServiceConfig
from tests.conftest import _wait_until
from tests.service.conftest import BLOCK, MODEL, TOKEN, Running, serving

CONVERSATIONS = 6
TURNS = 6
SEED = 11
CAP = 12
"""Small enough that both shards evict as the conversations grow: the replay mirrors the recorded evictions."""

runner = CliRunner()


def _listening(run: Running) -> bool:
    _, rows, _ = run.call("GET", "/workers")
    listeners = [listener for row in rows for listener in row.get("listeners", {}).values()]
    return len(listeners) == 2 and all(listener.get("state") == "exact" for listener in listeners)


def _frame_spans(raw: bytes) -> list[tuple[int, int]]:
    """(start, end) of every frame after the magic: where a test may cut or drop one."""
    spans, at = [], len(MAGIC)
    while at < len(raw):
        end = at + 4 + int.from_bytes(raw[at : at + 4], "little")
        spans.append((at, end))
        at = end
    return spans


def _complete(url: str, tokens: list[int]) -> int:
    body = f'{{"model": "{MODEL}", "prompt": {tokens}, "max_tokens": 2}}'.encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
        return int(response.status)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """(the recording of a short run, the router calls it made)."""
    folder = tmp_path_factory.mktemp("record")
    path = folder / "run.kvr"
    config = ServiceConfig(
        port=0,
        shards=2,
        auth_token=TOKEN,
        health_interval_secs=0.1,
        drain_secs=2.0,
        router=RouterConfig(predicted_credit=2.0),  # the reference's cost, with the predicted tier
        record=str(path),
        router_seed=SEED,
        max_index_blocks=CAP,
    )
    rng = random.Random(SEED)
    system = [rng.randrange(1, 30_000) for _ in range(4 * BLOCK)]
    turns = [[rng.randrange(1, 30_000) for _ in range(2 * BLOCK + 5)] for _ in range(CONVERSATIONS * TURNS)]
    calls = 0
    with serving(config, folder) as run:
        _wait_until(lambda: _listening(run), what="both engines followed")
        with ThreadPoolExecutor(4) as pool:
            for turn in range(TURNS):  # each turn of every conversation at once; the next turn extends it
                prompts = [
                    system + [t for k in range(turn + 1) for t in turns[c * TURNS + k]] for c in range(CONVERSATIONS)
                ]
                assert list(pool.map(lambda p: _complete(run.url, p), prompts)) == [200] * CONVERSATIONS
                calls += CONVERSATIONS
        for c in range(3):  # plain selects and a probe draw from the router's RNG too
            run.ok("POST", "/select", {"model_name": MODEL, "token_ids": system + turns[c * TURNS]})
            calls += 1
        run.ok("POST", "/select", {"model_name": MODEL, "token_ids": system, "probe": True})
        calls += 1
        for _ in range(2):  # a long prompt queued on each worker through a quiet spell: a busy fleet, as the
            # decisions below see it (the seen load), so the tier's credit decides where the followers go
            busy = [rng.randrange(1, 30_000) for _ in range(16 * BLOCK)]
            run.ok("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": busy})
            calls += 1
        time.sleep(3.0)
        fresh = [rng.randrange(1, 30_000) for _ in range(8 * BLOCK)]  # reserved, never sent: predicted only
        for n in range(3):
            run.ok("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": fresh + [n + 1] * BLOCK})
            calls += 1
        request = urllib.request.Request(run.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            metrics = response.read().decode()
    assert 'kvrouter_recording_dropped_total{source="front"} 0.0' in metrics
    assert 'kvrouter_recording_dropped_total{source="applier"} 0.0' in metrics
    assert "kvrouter_recording_records_total" in metrics
    return path, calls


def test_every_decision_of_a_recorded_run_replays_as_recorded(recorded):
    path, calls = recorded
    recording = read_recording(path, allow_open=False)
    assert recording.header["seed"] == SEED
    assert recording.count("reg") == 2
    assert recording.count("pc") == recording.count("free") == CONVERSATIONS * TURNS
    assert all(r["down"] == [] for r in recording.records if r["k"] == "dec")  # every shard read, each time
    report = replay_recording(recording)
    assert report.decisions == calls
    assert report.matched == report.decisions, report.differences
    assert report.dropped == 0
    assert recording.end is not None
    assert recording.end["evicted"] == report.evicted > 0  # the cap evicted, and the replay still agrees:
    assert report.evictions >= report.evicted  # it mirrored every evicted row
    assert report.index_differs == 0
    assert report.event_batches > 0
    assert report.event_errors == 0
    assert report.recorded_hit_blocks > 0  # the index mattered: later turns found their conversation's blocks
    assert report.replayed_hit_blocks == report.recorded_hit_blocks


def test_predictions_replay_with_the_calls_that_made_them(recorded):
    """Three reservations on a fresh prefix end the run, on a fleet busy for seconds before them: no engine
    computes the prefix, so the later ones find it only as predicted. The replay books the same calls at the
    recorded times, so it predicts the same; without the tier it decides otherwise."""
    path, calls = recorded
    recording = read_recording(path)
    assert replay_recording(recording).matched == calls
    without = replay_recording(recording, parse_overrides(["router-predicted-credit=0"]))
    assert without.overrides == {"predicted_credit": 0}
    assert without.differing > 0


def test_a_changed_router_replays_the_same_calls_and_decides_for_itself(recorded):
    path, calls = recorded
    report = replay_recording(read_recording(path), parse_overrides(["router-kv-overlap-score-credit=0"]))
    assert report.overrides == {"overlap_score_credit": 0}
    assert report.decisions == calls
    assert report.matched + report.differing == calls
    assert report.as_json()["hit_rate"]["recorded"] == round(report.recorded_hit_blocks / report.prompt_blocks, 4)


def test_replay_from_prints_the_table_writes_the_json_and_exits_0(recorded, tmp_path):
    path, calls = recorded
    out = tmp_path / "replay.json"
    result = runner.invoke(app, ["replay", "--from", str(path), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "matched" in result.output
    document = orjson.loads(out.read_bytes())
    assert document["decisions"] == document["matched"] == calls
    assert document["version"] == VERSION
    assert document["seed"] == SEED


def test_a_replay_mirrors_the_recorded_evictions_and_says_when_a_recording_has_none(recorded, tmp_path):
    """The recorded run's cap evicted: ``--from`` replays its ``evict`` records and says so. The same file
    without them (as a recording made before they existed) is told apart: its decisions may differ."""
    path, _ = recorded
    out = tmp_path / "replay.json"
    result = runner.invoke(app, ["replay", "--from", str(path), "--json", str(out)])
    assert result.exit_code == 0, result.output
    document = orjson.loads(out.read_bytes())
    assert document["evicted"] > 0
    assert f"the recorded run's index cap evicted {document['evicted']} entries: replayed from" in " ".join(
        result.output.split()
    )
    raw = path.read_bytes()
    kept = [MAGIC]
    for at, end in _frame_spans(raw):
        if msgpack.unpackb(raw[at + 4 : end], raw=False).get("k") != "evict":
            kept.append(raw[at:end])
    older = tmp_path / "older.kvr"
    older.write_bytes(b"".join(kept))
    result = runner.invoke(app, ["replay", "--from", str(older)])
    assert result.exit_code in (0, 1), result.output
    assert "has no evict records: overlaps and decisions may differ" in " ".join(result.output.split())


def test_a_cut_short_or_other_version_recording_and_a_bad_router_change_are_usage_errors(recorded, tmp_path):
    path, _ = recorded
    whole = path.read_bytes()
    middle = next(at for at, end in _frame_spans(whole) if end > len(whole) // 2)
    cut = tmp_path / "cut.kvr"
    cut.write_bytes(whole[: middle + 5])  # the middle frame's length and one byte of its body
    result = runner.invoke(app, ["replay", "--from", str(cut)])
    assert result.exit_code == 2
    assert f"truncated at byte {middle}:" in " ".join(result.output.split())
    result = runner.invoke(app, ["replay", "--from", str(cut), "--allow-cut"])
    assert result.exit_code == 0, result.output
    assert f"cut short at byte {middle}:" in " ".join(result.output.split())
    header_length = int.from_bytes(whole[len(MAGIC) : len(MAGIC) + 4], "little")
    header = msgpack.unpackb(whole[len(MAGIC) + 4 : len(MAGIC) + 4 + header_length])
    other = tmp_path / "v2.kvr"
    other.write_bytes(MAGIC + frame({**header, "version": VERSION + 1}) + whole[len(MAGIC) + 4 + header_length :])
    result = runner.invoke(app, ["replay", "--from", str(other)])
    assert result.exit_code == 2
    assert f"recording format version {VERSION + 1}" in result.output
    result = runner.invoke(app, ["replay", "--from", str(path), "--live", "--router", "router-temperature=1"])
    assert result.exit_code == 2
    result = runner.invoke(app, ["replay", "--from", str(path), "--router", "no-such-knob=1"])
    assert result.exit_code == 2


def _raced(applied_from: int, *, raced_by: tuple[dict[str, Any], ...] = ()) -> Recording:
    """A decision at t 1000..2000 whose recorded overlaps saw worker 2's batch, applied from ``applied_from`` to 2500
    (the recording of the moment a batch lands while a decision walks the index); ``raced_by``: more index
    records in the same window that the decision did not see."""
    blocks = tuple(StoredBlock(EngineHash(100 + h), LocalHash(h)) for h in (11, 12, 13, 14))
    payload = kvrouter_codec.Encoder().encode(EventBatch((Stored(2, None, blocks),)))
    seen = RadixIndex()
    seen.apply_event(2, Stored(2, None, blocks))
    by_tier = seen.find_matches_by_tier([11, 12, 13, 14])
    overlaps = [[by_tier.get(tier, {}).get(key, 0) for key in ((1, 0), (2, 0))] for tier in StorageTier]
    records: list[dict[str, Any]] = [
        {"k": "reg", "n": 0, "t": 100, "m": MODEL, "g": "default", "w": 1, "r": 0, "bs": BLOCK, "fmt": "kvrouter"},
        {"k": "reg", "n": 1, "t": 101, "m": MODEL, "g": "default", "w": 2, "r": 0, "bs": BLOCK, "fmt": "kvrouter"},
        {"k": "dec", "n": 2, "t": 1000, "t1": 2000, "m": MODEL, "g": "default", "id": "a", "probe": False,
         "h": np.array([11, 12, 13, 14], dtype="<u8").tobytes(), "isl": 4 * BLOCK, "lora": None,
         "cand": [[1, 0], [2, 0]], "cap": None, "untr": [], "w": [2, 0], "o": 4, "ov": overlaps, "err": None},
        {"k": "ev", "n": 3, "t": 2500, "t0": applied_from, "w": 2, "r": 0, "fmt": "kvrouter", "bs": BLOCK,
         "skip": 0, "p": payload, "shard": 1},
    ]  # fmt: skip
    records += [{**other, "n": 4 + k} for k, other in enumerate(raced_by)]
    header = {"kind": "header", "version": VERSION, "seed": 1, "router": dataclasses.asdict(RouterConfig())}
    return Recording(Path("raced.kvr"), header, records)


def test_a_batch_applied_while_a_decision_walked_the_index_counts_as_seen_when_the_overlaps_say_so():
    report = replay_recording(_raced(applied_from=1500))  # began before the decision ended: it may have been seen
    assert report.races == 1
    assert report.index_differs == 0
    assert report.matched == report.decisions == 1
    late = replay_recording(_raced(applied_from=2100))  # began after the decision ended: it cannot have been
    assert late.races == 0
    assert late.index_differs == 1


def test_a_racing_batch_counts_as_seen_without_its_eviction_or_another_shards_batch():
    """The live walk reads each shard at its own instant, and the cap evicts at a batch's end: a decision
    can see a batch's blocks but not the eviction recorded after it, nor a batch another shard applied in
    the same window. The replay applies the fewest records of each shard that make the overlaps agree."""
    eviction = {"k": "evict", "t": 2500, "t0": 1500, "w": 2, "r": 0, "tier": 0, "shard": 1,
                "h": np.array([114], dtype="<u8").tobytes()}  # fmt: skip
    other = kvrouter_codec.Encoder().encode(
        EventBatch((Stored(1, None, (StoredBlock(EngineHash(211), LocalHash(11)),)),))
    )
    elsewhere = {"k": "ev", "t": 2400, "t0": 1400, "w": 1, "r": 0, "fmt": "kvrouter", "bs": BLOCK, "skip": 0,
                 "p": other, "shard": 0}  # fmt: skip
    report = replay_recording(_raced(applied_from=1500, raced_by=(eviction, elsewhere)))
    assert (report.races, report.index_differs, report.matched, report.event_errors) == (1, 0, 1, 0)
    assert report.evictions == 1  # applied after the decision, in its turn


def _unread(down: list[int]) -> Recording:
    """Worker 1 (shard 0) holds the prompt's first 2 blocks, worker 2 (shard 1) all 4; the live decision
    could not read shard 1 (its applier died mid-write), saw worker 2 at 0 and chose worker 1."""
    held = {1: (11, 12), 2: (11, 12, 13, 14)}
    records: list[dict[str, Any]] = [
        {"k": "reg", "n": w - 1, "t": 100 + w, "m": MODEL, "g": "default", "w": w, "r": 0, "bs": BLOCK,
         "fmt": "kvrouter"}
        for w in (1, 2)
    ]  # fmt: skip
    for w, local in held.items():
        blocks = tuple(StoredBlock(EngineHash(100 * w + h), LocalHash(h)) for h in local)
        payload = kvrouter_codec.Encoder().encode(EventBatch((Stored(w, None, blocks),)))
        records.append({"k": "ev", "n": 1 + w, "t": 500 + w, "t0": 400, "w": w, "r": 0, "fmt": "kvrouter",
                        "bs": BLOCK, "skip": 0, "p": payload, "shard": w - 1})  # fmt: skip
    seen = [[2, 0] for _ in StorageTier]  # worker 2 hidden
    records.append(
        {"k": "dec", "n": 4, "t": 1000, "t1": 1100, "m": MODEL, "g": "default", "id": None, "probe": False,
         "h": np.array([11, 12, 13, 14], dtype="<u8").tobytes(), "isl": 4 * BLOCK, "lora": None,
         "cand": [[1, 0], [2, 0]], "cap": None, "untr": [], "w": [1, 0], "o": 2, "ov": seen, "err": None,
         "down": down}
    )  # fmt: skip
    header = {"kind": "header", "version": VERSION, "seed": 1, "router": dataclasses.asdict(RouterConfig())}
    return Recording(Path("unread.kvr"), header, records)


def test_a_shard_the_live_walk_could_not_read_is_left_out_of_the_replayed_decision():
    report = replay_recording(_unread(down=[1]))
    assert (report.index_differs, report.matched, report.decisions) == (0, 1, 1)
    blind = replay_recording(_unread(down=[]))  # as recordings made before ``down``: the replay sees worker 2
    assert (blind.index_differs, blind.matched) == (1, 0)


def test_an_evict_record_naming_a_block_the_replay_lacks_is_counted_not_fatal():
    records: list[dict[str, Any]] = [
        {"k": "reg", "n": 0, "t": 100, "m": MODEL, "g": "default", "w": 1, "r": 0, "bs": BLOCK, "fmt": "kvrouter"},
        {"k": "evict", "n": 1, "t": 200, "w": 1, "r": 0, "tier": 0, "h": np.array([99], dtype="<u8").tobytes(),
         "shard": 0},
    ]  # fmt: skip
    header = {"kind": "header", "version": VERSION, "seed": 1, "router": dataclasses.asdict(RouterConfig())}
    report = replay_recording(Recording(Path("lacking.kvr"), header, records))
    assert (report.event_errors, report.evictions) == (1, 1)


def test_live_plays_the_recording_to_a_router_started_for_it(recorded, tmp_path):
    """``--live``: a ``kvrouter up`` started with the recorded seed and config; the recorded workers' events
    re-published from this process, every call made again. Agreement depends on live timing, so only the
    accounting is asserted: every call answered, every batch sent, no error."""
    path, calls = recorded
    out = tmp_path / "live.json"
    result = runner.invoke(app, ["replay", "--from", str(path), "--live", "--speed", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    document = orjson.loads(out.read_bytes())
    assert document["decisions"] == document["answered"] == calls
    assert document["refused"] == 0
    assert document["errors"] == []
    assert document["event_batches"] == read_recording(path).count("ev")


def test_an_approximate_mode_recording_replays_on_an_approx_index(tmp_path):
    """No events at all: the ``ApproxIndex`` is fed by the decisions themselves, under the held clock (its TTL)."""
    path = tmp_path / "approx.kvr"
    config = ServiceConfig(
        port=0, shards=1, router=RouterConfig(use_kv_events=False, router_ttl_secs=60), record=str(path), router_seed=5
    )
    service = Service(config)  # served without its engine: approximate mode never asks it
    assert service.recording is not None
    rng = random.Random(5)
    prefixes = [[rng.randrange(1, 30_000) for _ in range(3 * BLOCK)] for _ in range(3)]
    steps: list[tuple[str, str, Any]] = [
        ("POST", "/register", {"instance_id": wid, "model_name": MODEL, "block_size": BLOCK}) for wid in (1, 2, 3)
    ]
    for i in range(18):
        body = {"model_name": MODEL, "token_ids": prefixes[i % 3] + [i + 1] * BLOCK, "selection_id": f"r{i}"}
        steps.append(("POST", "/select_and_reserve", body))
        if i % 2:
            steps.append(("POST", f"/reservations/r{i - 1}/prefill_complete", {}))
            steps.append(("DELETE", f"/reservations/r{i - 1}", None))
    service.recording.open()
    try:
        answers = asyncio.run(_exchange(service, steps))
    finally:
        service.recording.close(evicted=0)
    assert all(status in (200, 201) for status, _ in answers), answers
    report = replay_recording(read_recording(path, allow_open=False))
    assert report.decisions == 18
    assert report.matched == 18, report.differences
    assert report.recorded_hit_blocks > 0  # later requests followed their prefix's first decision
    assert report.event_batches == 0


def test_roles_are_recorded_and_a_fleet_with_a_prefill_worker_replays(tmp_path):
    """A disaggregated partition's decisions replay as recorded, each request's two router calls (the prefill
    choice, then the decode worker's) in order; a ``reg`` record keeps its role, domain and LoRA adapters (a
    ``both`` worker's keeps the fields recordings had before roles)."""
    path = tmp_path / "roles.kvr"
    config = ServiceConfig(
        port=0, shards=1, router=RouterConfig(use_kv_events=False, router_ttl_secs=60), record=str(path), router_seed=7
    )
    service = Service(config)  # approximate mode: no engine
    assert service.recording is not None
    roles: dict[int, dict[str, Any]] = {
        1: {"role": "prefill", "topology_domain": "rack-a"},
        2: {"role": "decode", "lora_adapters": ["t"]},
        3: {},
    }
    steps: list[tuple[str, str, Any]] = [
        ("POST", "/register", {"instance_id": wid, "model_name": MODEL, "block_size": BLOCK, **fields})
        for wid, fields in roles.items()
    ]
    rng = random.Random(7)
    prefix = [rng.randrange(1, 30_000) for _ in range(3 * BLOCK)]
    steps += [("POST", "/select", {"model_name": MODEL, "token_ids": prefix + [i + 1] * BLOCK}) for i in range(8)]
    service.recording.open()
    try:
        answers = asyncio.run(_exchange(service, steps))
    finally:
        service.recording.close(evicted=0)
    assert [status for status, _ in answers] == [201] * 3 + [200] * 8
    assert {answer["worker_id"] for _, answer in answers[3:]} <= {2, 3}
    recording = read_recording(path, allow_open=False)
    registered = {r["w"]: (r.get("role"), r.get("dom"), r.get("lora")) for r in recording.records if r["k"] == "reg"}
    assert registered == {1: ("prefill", "rack-a", None), 2: ("decode", None, ["t"]), 3: (None, None, None)}
    assert {answer["split"] for _, answer in answers[3:]} == {False}  # short prompts: prefilled where decoded
    report = replay_recording(recording)
    assert (report.decisions, report.matched) == (16, 16), report.differences  # each: the prefill choice, the decode


def test_split_reservations_are_recorded_and_replay_with_both_bookings(tmp_path):
    """Each split reservation is three router calls (the prefill choice, its booking as ``<id>#prefill``, the
    decode worker's booking), then its first token and end: every call replays as recorded, in order."""
    path = tmp_path / "split.kvr"
    config = ServiceConfig(
        port=0, shards=1, router=RouterConfig(use_kv_events=False, router_ttl_secs=60), record=str(path), router_seed=9
    )
    service = Service(config)
    assert service.recording is not None
    steps: list[tuple[str, str, Any]] = [
        ("POST", "/register", {"instance_id": wid, "model_name": MODEL, "block_size": BLOCK, "role": role})
        for wid, role in ((1, "prefill"), (2, "prefill"), (3, "decode"), (4, "decode"))
    ]
    rng = random.Random(9)
    for i in range(6):
        prompt = [rng.randrange(1, 30_000) for _ in range(300 * BLOCK)]  # 4,800 tokens: split
        steps.append(
            ("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": prompt, "selection_id": f"s{i}"})
        )
        steps.append(("POST", f"/reservations/s{i}/prefill_complete", {}))
        if i % 2:
            steps.append(("DELETE", f"/reservations/s{i}", None))
    service.recording.open()
    try:
        answers = asyncio.run(_exchange(service, steps))
    finally:
        service.recording.close(evicted=0)
    assert all(status in (200, 201) for status, _ in answers), answers
    splits = [answer for _, answer in answers if isinstance(answer, dict) and "split" in answer]
    assert [answer["split"] for answer in splits] == [True] * 6
    recording = read_recording(path, allow_open=False)
    booked = sorted({r["id"] for r in recording.records if r["k"] == "dec" and r.get("id")})
    assert booked == sorted([f"s{i}" for i in range(6)] + [f"s{i}#prefill" for i in range(6)])
    report = replay_recording(recording)
    assert (report.decisions, report.matched) == (18, 18), report.differences


async def _exchange(service: Service, steps: list[tuple[str, str, Any]]) -> list[tuple[int, Any]]:
    answers = []
    async with TestClient(TestServer(service.app, host="127.0.0.1")) as client:
        for method, url, body in steps:
            response = await client.request(method, url, json=body)
            answers.append((response.status, await response.json()))
    return answers
