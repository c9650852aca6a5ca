"""The fast ``Router`` against the oracle, ``ReferenceRouter``: same worker, same draws, same explanation.

Hypothesis builds a configuration (every switch the cost and the selector read: temperature 0 and above
with one seed, busy thresholds, approximate mode, tier credits, the lmetric policy, the recent prefill
work factor, the tracking and
reuse switches, optionally a shared slot manager whose switches differ from the config's, as the
simulator's does) and a stream of steps: blocks stored on random workers and tiers, decisions over
random candidate sets (duplicates, tuples, lists) from tokens or local hashes in every accepted form,
booked or not, with capacities, and the lifecycle of booked requests (prefill done, freed, swept by an
injected clock that the router's own sweep also reads). After every decision the two selections must
match term by term (1e-9), the two random generators must be in the same state (the same draws were
consumed), and the two slot managers must report the same loads. The shared-memory engine is checked
on fewer examples: the fast router reading it must choose as the oracle reading a ``RadixIndex`` fed the
same events.
"""

from __future__ import annotations

import itertools
import math
import random
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import fields, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvrouter.engine import Engine
from kvrouter.errors import KvRouterError
from kvrouter.events.model import EngineHash, LocalHash, StorageTier, Stored, StoredBlock, WorkerKey
from kvrouter.hashing import block_hashes, sequence_hashes
from kvrouter.index import ApproxIndex, RadixIndex
from kvrouter.routing import ReferenceRouter, ReferenceSlotManager, Router, RouterConfig, Selection, SlotManager
from kvrouter.routing.config import KVROUTER_CONFIG
from tests.clock import FakeClock

B = 4
WORKER_IDS = range(1, 6)
RANKS = range(2)
TOL = 1e-9

paths = st.lists(st.integers(0, 2), max_size=7)
"""A prompt's blocks as choices in a small tree: prompts share prefixes often and diverge anywhere."""


def prompt_tokens(path: Sequence[int], tail: int) -> list[int]:
    """Token ids whose block ``i`` depends only on ``(i, path[i])``, plus ``tail`` tokens of a partial block."""
    tokens = [t for depth, choice in enumerate(path) for t in (depth + 1, choice, 7, 9)]
    return tokens + [5] * tail


@st.composite
def configs(draw: st.DrawFn) -> RouterConfig:
    track_blocks, reuse = draw(st.booleans()), draw(st.booleans())
    return RouterConfig(
        predicted_credit=draw(st.sampled_from([0.0, 0.0, 2.0, 1.0, 0.5])),
        credit_load_gain=draw(st.sampled_from([0.0, 0.0, 1.0, 0.3])),
        overlap_score_credit=draw(st.sampled_from([1.0, 0.0, 1.5, 2.0])),
        overlap_score_credit_decay=draw(st.sampled_from([0.0, 0.5, 3.0])),
        prefill_load_scale=draw(st.sampled_from([1.0, 0.5, 2.5])),
        decode_active_request_weight=draw(st.sampled_from([0.0, 1.0, 0.3])),
        prefill_work_weight=draw(st.sampled_from([0.0, 1.0, 0.5, 3.0])),
        host_cache_hit_weight=draw(st.sampled_from([0.75, 0.0, 1.2])),
        disk_cache_hit_weight=draw(st.sampled_from([0.25, 0.6])),
        shared_cache_multiplier=draw(st.sampled_from([None, 0.4])),
        shared_cache_type=draw(st.sampled_from(["none", "hicache"])),
        router_temperature=draw(st.sampled_from([0.0, 0.0, 1e-300, 0.1, 1.0, 5.0])),
        router_selection_policy=draw(st.sampled_from(["default", "lmetric"])),
        use_kv_events=draw(st.booleans()),
        router_track_active_blocks=track_blocks,
        router_track_prefill_tokens=draw(st.booleans()),
        router_assume_kv_reuse=reuse,
        active_decode_blocks_threshold=draw(st.sampled_from([None, None, 0.5, 1.0])),
        active_prefill_tokens_threshold=draw(st.sampled_from([None, None, 0, 12, 40])),
        untrusted_overlap_weight=draw(st.sampled_from([1.0, 1.0, 0.5, 0.0])),
    )


workers = st.tuples(st.sampled_from(WORKER_IDS), st.sampled_from(RANKS))
select_steps = st.fixed_dictionaries(
    {
        "path": paths,
        "tail": st.integers(0, B - 1),
        "candidates": st.lists(workers, min_size=0, max_size=8),
        "as_tuple": st.booleans(),
        "form": st.sampled_from(["tokens", "tokens_array", "tokens_numpy", "tokens_int64", "local", "local_numpy"]),
        "isl": st.none() | st.integers(0, 60),
        "capacities": st.none() | st.dictionaries(workers, st.integers(0, 40), max_size=6),
        "book": st.booleans(),
        "explain": st.booleans(),
    }
).map(lambda d: ("select", d))
steps = st.one_of(
    select_steps,
    select_steps,
    st.tuples(st.just("store"), workers, st.sampled_from(list(StorageTier)), paths),
    st.tuples(st.just("book"), workers, paths, st.integers(0, 40), st.integers(0, 8)),
    st.tuples(st.just("mark"), st.integers(0, 30)),
    st.tuples(st.just("free"), st.integers(0, 30)),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 30.0, 61.0, 150.0, 299.0, 300.0])),
    st.tuples(st.just("untrust"), st.lists(workers, max_size=4)),
)


def store(index: RadixIndex | Engine, worker: WorkerKey, tier: StorageTier, path: Sequence[int]) -> None:
    local = block_hashes(prompt_tokens(path, 0), B)
    if not local:
        return
    seq = sequence_hashes(local)
    blocks = tuple(StoredBlock(EngineHash(s), LocalHash(h)) for s, h in zip(seq, local, strict=True))
    index.apply_event(worker[0], Stored(worker[0], None, blocks, tier=tier, dp_rank=worker[1]))


def assert_same(fast: Selection, oracle: Selection) -> None:
    assert fast.worker == oracle.worker
    assert fast.overlap_blocks == oracle.overlap_blocks
    assert fast.predicted_blocks == oracle.predicted_blocks
    assert fast.isl_tokens == oracle.isl_tokens
    assert_close(fast.cost, oracle.cost)
    if oracle.explanation is None:
        assert fast.explanation is None
        return
    assert fast.explanation is not None
    assert len(fast.explanation) == len(oracle.explanation)
    for mine, theirs in zip(fast.explanation, oracle.explanation, strict=True):
        assert (mine.worker, mine.overlap, mine.selected, mine.busy) == (
            theirs.worker,
            theirs.overlap,
            theirs.selected,
            theirs.busy,
        )
        assert math.isclose(mine.probability, theirs.probability, rel_tol=TOL, abs_tol=TOL)
        assert_close(mine.cost, theirs.cost)


def assert_close(mine: Any, theirs: Any) -> None:
    for spec in fields(theirs):
        a, b = getattr(mine, spec.name), getattr(theirs, spec.name)
        assert math.isclose(a, b, rel_tol=TOL, abs_tol=TOL), (spec.name, a, b)


def decide(router: Router | ReferenceRouter, index: Any, step: dict[str, Any], *, fast: bool, rid: str) -> Any:
    """The selection, or the exception class raised."""
    tokens = prompt_tokens(step["path"], step["tail"])
    candidates = [(w, r) for w, r in step["candidates"]]
    kwargs: dict[str, Any] = {
        "isl_tokens": step["isl"],
        "capacities": step["capacities"],
        "request_id": rid if step["book"] else None,
        "explain": step["explain"],
    }
    form = step["form"] if fast else ("local" if step["form"].startswith("local") else "tokens")
    if form == "tokens":
        kwargs["tokens"] = tokens
    elif form == "tokens_array":
        kwargs["tokens"] = array("I", tokens)
    elif form == "tokens_numpy":
        kwargs["tokens"] = np.array(tokens, dtype=np.uint32)
    elif form == "tokens_int64":
        kwargs["tokens"] = np.array(tokens, dtype=np.int64)
    elif form == "local":
        kwargs["local_hashes"] = block_hashes(tokens, B)
    else:
        kwargs["local_hashes"] = np.array(block_hashes(tokens, B), dtype=np.uint64)
    workers: Any = tuple(candidates) if step["as_tuple"] else candidates
    try:
        return router.select(index, workers, **kwargs)
    except KvRouterError as exc:
        return type(exc)


def assert_same_loads(fast: SlotManager, oracle: ReferenceSlotManager) -> None:
    assert fast.workers() == oracle.workers()
    for worker in itertools.product(WORKER_IDS, RANKS):
        assert fast.active_prefill_tokens(worker) == oracle.active_prefill_tokens(worker)
        assert fast.active_blocks(worker) == oracle.active_blocks(worker)
        assert fast.active_requests(worker) == oracle.active_requests(worker)


def run_stream(
    config: RouterConfig,
    seed: int,
    shared_slots: tuple[bool, bool, bool] | None,
    stream: list[tuple[Any, ...]],
    *,
    fast_index: Any = None,
) -> None:
    clock = FakeClock()
    fast_slots: SlotManager | None = None
    oracle_slots: ReferenceSlotManager | None = None
    if shared_slots is not None:
        blocks, prefill, reuse = shared_slots
        fast_slots = SlotManager(
            block_size=B, clock=clock, track_active_blocks=blocks, track_prefill_tokens=prefill, assume_kv_reuse=reuse
        )
        oracle_slots = ReferenceSlotManager(
            block_size=B, clock=clock, track_active_blocks=blocks, track_prefill_tokens=prefill, assume_kv_reuse=reuse
        )
    fast = Router(config, block_size=B, seed=seed, clock=clock, slots=fast_slots)
    oracle = ReferenceRouter(config, block_size=B, seed=seed, clock=clock, slots=oracle_slots)
    assert isinstance(oracle.slots, ReferenceSlotManager)
    oracle_index: RadixIndex | ApproxIndex
    if config.use_kv_events:
        oracle_index = RadixIndex()
        fast_index = oracle_index if fast_index is None else fast_index
    else:
        oracle_index = ApproxIndex(ttl=config.router_ttl_secs, clock=clock)
        fast_index = ApproxIndex(ttl=config.router_ttl_secs, clock=clock)
    booked: list[str] = []
    for n, step in enumerate(stream):
        kind = step[0]
        if kind == "select":
            rid = f"r{n}"
            mine = decide(fast, fast_index, step[1], fast=True, rid=rid)
            theirs = decide(oracle, oracle_index, step[1], fast=False, rid=rid)
            if isinstance(theirs, type):
                assert mine is theirs
            else:
                assert isinstance(mine, Selection)
                assert_same(mine, theirs)
                if step[1]["book"]:
                    booked.append(rid)
            assert fast.rng.getstate() == oracle.rng.getstate()
        elif kind == "store":
            if isinstance(oracle_index, RadixIndex):  # approximate mode has no events
                store(oracle_index, step[1], step[2], step[3])
                if fast_index is not oracle_index:
                    store(fast_index, step[1], step[2], step[3])
                    fast_index.flush()
        elif kind == "book":
            _, worker, path, isl, overlap = step
            seq = sequence_hashes(block_hashes(prompt_tokens(path, 0), B))
            fast.slots.add_request(f"b{n}", worker, seq, isl, overlap)
            oracle.slots.add_request(f"b{n}", worker, seq, isl, overlap)
            booked.append(f"b{n}")
        elif kind in ("mark", "free") and booked:
            rid = booked[step[1] % len(booked)]
            getattr(fast.slots, "mark_prefill_completed" if kind == "mark" else "free")(rid)
            getattr(oracle.slots, "mark_prefill_completed" if kind == "mark" else "free")(rid)
        elif kind == "advance":
            clock.now += step[1]
        elif kind == "untrust":  # the service marks the workers whose trust state is not exact
            fast.set_untrusted(step[1])
            oracle.set_untrusted(step[1])
        assert isinstance(oracle.slots, ReferenceSlotManager)
        assert_same_loads(fast.slots, oracle.slots)


slot_switches = st.none() | st.tuples(st.booleans(), st.booleans(), st.booleans())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), seed=st.integers(0, 2**32), shared=slot_switches, stream=st.lists(steps, max_size=40))
def test_the_fast_router_decides_as_the_oracle(
    config: RouterConfig, seed: int, shared: tuple[bool, bool, bool] | None, stream: list[tuple[Any, ...]]
) -> None:
    run_stream(config, seed, shared, stream)


burst_selects = st.fixed_dictionaries(
    {
        "path": st.sampled_from([[0, 1, 2], [0, 1, 2, 1], [0, 1, 2, 2, 0], [1, 0], [1, 0, 0, 2]]),
        "tail": st.integers(0, B - 1),
        "candidates": st.lists(workers, min_size=1, max_size=8),
        "as_tuple": st.booleans(),
        "form": st.sampled_from(["tokens", "local_numpy"]),
        "isl": st.none(),
        "capacities": st.none(),
        "book": st.just(True) | st.booleans(),
        "explain": st.booleans(),
    }
).map(lambda d: ("select", d))
burst_steps = st.one_of(burst_selects, burst_selects, burst_selects, steps)
"""Requests sharing a few prefixes, mostly booked: the predicted tier has in-flight blocks to credit."""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs(),
    weight=st.sampled_from([2.0, 1.0, 0.5, 3.0, 24.0]),
    seed=st.integers(0, 2**32),
    stream=st.lists(burst_steps, min_size=2, max_size=40),
)
def test_the_predicted_tier_decides_as_the_oracle(
    config: RouterConfig, weight: float, seed: int, stream: list[tuple[Any, ...]]
) -> None:
    """Bursts on shared prefixes with the predicted tier on: the same picks, predicted blocks and terms."""
    tiered = replace(config, predicted_credit=weight, router_track_active_blocks=True, router_assume_kv_reuse=True)
    run_stream(tiered, seed, None, stream)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), stream=st.lists(steps, max_size=40))
def test_ties_and_sampling_draw_as_the_oracle(seed: int, stream: list[tuple[Any, ...]]) -> None:
    """No load term at all (credit and tracking off): every candidate ties, the reservoir decides."""
    for temperature in (0.0, 0.7):
        config = RouterConfig(
            overlap_score_credit=0.0,
            router_temperature=temperature,
            router_track_active_blocks=False,
            router_track_prefill_tokens=False,
            host_cache_hit_weight=0.0,
            disk_cache_hit_weight=0.0,
        )
        run_stream(config, seed, None, stream)


def test_a_large_fleet_decides_as_the_oracle() -> None:
    """Thousands of candidates, a few holding the prompt, a few loaded: the same pick and draws. The
    candidates come as the whole fleet, a run of slots from the middle of it, a run with a gap and a
    shuffle: the decision kernel costs a run of slots in a vectorised loop and anything else one
    candidate at a time, and both must agree with the oracle under every term (the credit's decay, the
    recent work, a busy threshold, untrusted workers)."""
    index = RadixIndex()
    fleet = tuple((w, 0) for w in range(2000))
    shuffled = list(fleet)
    random.Random(7).shuffle(shuffled)
    candidate_sets = (fleet, fleet[500:1500], fleet[:700] + fleet[701:1200], tuple(shuffled))
    for w in range(0, 2000, 125):
        store(index, (w, 0), StorageTier.DEVICE, [1, 2, 0, 1][: 1 + w % 4])
    decaying = RouterConfig(
        overlap_score_credit_decay=3.0, active_prefill_tokens_threshold=40, untrusted_overlap_weight=0.5
    )
    for config in (RouterConfig(), RouterConfig(router_temperature=0.5), decaying, KVROUTER_CONFIG):
        clock = FakeClock()  # the recent-work term decays with time: both read one clock
        fast = Router(config, block_size=B, seed=3, clock=clock)
        oracle = ReferenceRouter(config, block_size=B, seed=3, clock=clock)
        fast.slots.numbering.slots(list(fleet))  # slots 0.. in fleet order, before the bookings number theirs
        for router in (fast, oracle):
            router.set_untrusted(fleet[250:2000:250])
            for w in range(375, 2000, 500):  # 4-block holders, 2 tokens queued: decayed, 2 blocks on an idle one win
                router.slots.add_request(f"w{w}", (w, 0), sequence_hashes([w]), 2, 0)
        for n in range(40):
            path = [1, 2, 0, 1, n % 3]
            candidates = candidate_sets[n % len(candidate_sets)]
            kwargs: dict[str, Any] = {"tokens": prompt_tokens(path, 1), "request_id": f"r{n}", "explain": n % 7 == 0}
            assert_same(fast.select(index, candidates, **kwargs), oracle.select(index, candidates, **kwargs))
            assert fast.rng.getstate() == oracle.rng.getstate()


# -- the shared-memory engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(shards=1) as running:
        yield running


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=configs(), seed=st.integers(0, 2**32), stream=st.lists(steps, max_size=25))
def test_the_fast_router_on_the_engine_decides_as_the_oracle(
    engine: Engine, config: RouterConfig, seed: int, stream: list[tuple[Any, ...]]
) -> None:
    if not config.use_kv_events:
        config = RouterConfig(**{f.name: getattr(config, f.name) for f in fields(config)} | {"use_kv_events": True})
    for worker_id in WORKER_IDS:
        engine.remove_worker(worker_id)
    engine.flush()  # each example starts from an empty index
    run_stream(config, seed, None, stream, fast_index=engine)


def test_each_decision_on_the_engine_sees_its_own_prompts_overlaps_only(engine: Engine) -> None:
    """The decision kernel keeps the last answer in its overlaps array and zeroes only the columns it wrote:
    a worker that held the last prompt and holds none of this one must count 0 again."""
    for worker_id in WORKER_IDS:
        engine.remove_worker(worker_id)
    held = {(1, 0): [0, 0, 0, 0], (2, 0): [1, 1, 1], (3, 1): [2, 2]}
    for worker, path in held.items():
        store(engine, worker, StorageTier.DEVICE, path)
    store(engine, (3, 1), StorageTier.HOST, [2, 2, 2, 2])
    engine.flush()
    fleet = (*held, (4, 0))
    router = Router(block_size=B, seed=1)
    for path in ([0, 0, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2], [0, 0, 0, 0], [4, 4], [2, 2, 0, 0]):
        selection = router.select(engine, fleet, tokens=prompt_tokens(path, 0), explain=True)
        assert selection.explanation is not None
        seen = {row.worker: (row.overlap.device, row.overlap.host) for row in selection.explanation}
        expected = {
            worker: (_leading(held.get(worker, []), path), _leading([2, 2, 2, 2] if worker == (3, 1) else [], path))
            for worker in fleet
        }
        assert seen == {w: (d, max(d, h)) for w, (d, h) in expected.items()}, path


def test_routers_with_their_own_numberings_take_turns_on_one_engine(engine: Engine) -> None:
    """The router walks the reader's context only while the reader's bit -> slot maps follow its own
    numbering: two routers numbering the fleet in opposite orders, deciding in turn, each see every
    worker's own overlap (read by the other's slots, the holder's overlap lands on another worker)."""
    for worker_id in WORKER_IDS:
        engine.remove_worker(worker_id)
    held = {(1, 0): [0, 0, 0, 0], (2, 0): [1, 1], (3, 1): [2]}
    for worker, path in held.items():
        store(engine, worker, StorageTier.DEVICE, path)
    engine.flush()
    fleet = (*held, (4, 0))
    routers = [(Router(block_size=B, seed=1), fleet), (Router(block_size=B, seed=1), fleet[::-1])]
    for turn, path in enumerate(([0, 0, 0, 0], [1, 1, 0, 0], [2, 0], [0, 0, 0, 0], [1, 1, 1])):
        for router, candidates in routers if turn % 2 else routers[::-1]:
            selection = router.select(engine, candidates, tokens=prompt_tokens(path, 0), explain=True)
            assert selection.explanation is not None
            seen = {row.worker: row.overlap.device for row in selection.explanation}
            assert seen == {w: _leading(held.get(w, []), path) for w in fleet}, (path, candidates)


def _leading(held: Sequence[int], path: Sequence[int]) -> int:
    n = 0
    while n < min(len(held), len(path)) and held[n] == path[n]:
        n += 1
    return n


def test_a_large_fleet_on_the_engine_decides_as_the_oracle(engine: Engine) -> None:
    """Hundreds of candidates on the engine, a few holding the prompt in the index and a few others only in
    booked requests (leading active blocks without any overlap; prefilled, so those blocks alone set them
    apart): the same picks, terms and draws as the oracle on a ``RadixIndex`` fed the same events."""
    for worker_id in WORKER_IDS:
        engine.remove_worker(worker_id)
    oracle_index = RadixIndex()
    fleet = tuple((w, 0) for w in range(300))
    for w in range(0, 300, 25):
        for index in (engine, oracle_index):
            store(index, (w, 0), StorageTier.DEVICE, [1, 2, 0, 1][: 1 + w % 4])
    engine.flush()
    try:
        for config in (RouterConfig(), KVROUTER_CONFIG):
            clock = FakeClock()  # the recent-work term decays with time: both read one clock
            fast = Router(config, block_size=B, seed=5, clock=clock)
            oracle = ReferenceRouter(config, block_size=B, seed=5, clock=clock)
            for w in range(3, 300, 41):  # held only in flight: leading blocks without overlap
                seq = sequence_hashes(block_hashes(prompt_tokens([1, 2, 0, 1], 0), B))
                for router in (fast, oracle):  # prefilled: only the active blocks set them apart
                    router.slots.add_request(f"w{w}", (w, 0), seq, 16, 0)
                    router.slots.mark_prefill_completed(f"w{w}")
            for n in range(40):
                path = [1, 2, 0, 1, n % 3][: 2 + n % 4]
                tokens = prompt_tokens(path, 1)
                mine = fast.select(engine, fleet, tokens=tokens, request_id=f"r{n}", explain=n % 9 == 0)
                theirs = oracle.select(oracle_index, fleet, tokens=tokens, request_id=f"r{n}", explain=n % 9 == 0)
                assert_same(mine, theirs)
                assert fast.rng.getstate() == oracle.rng.getstate()
    finally:
        for w in range(0, 300, 25):
            engine.remove_worker(w)
        engine.flush()
