"""``kvrouter.worker.scheduler``: chunked prefill, prefix reuse, LRU eviction, block growth, preemption,
fast-forwarding, and KV events that keep an index equal to what the engine caches."""

from __future__ import annotations

import itertools
import random

import pytest

from kvrouter.events.model import Removed, StorageTier, Stored
from kvrouter.index import RadixIndex
from kvrouter.worker import GENERATED_ID_BASE, Iteration, WorkerConfig, WorkerModel, generated_block_id
from kvrouter.worker.timing import decode_ms, prefill_ms

BS = 512


def ids(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def drain(model: WorkerModel) -> list[tuple[float, Iteration]]:
    """Step until idle; each iteration with the simulated time at its end."""
    out: list[tuple[float, Iteration]] = []
    clock = 0.0
    while model.has_work():
        iteration = model.step()
        clock += iteration.duration_ms
        out.append((clock, iteration))
    return out


Shape = tuple[str, int | None, list[int]]
"""An event as (kind, parent, block ids)."""


def shape(event) -> Shape:
    if isinstance(event, Stored):
        return ("stored", event.parent, [block.engine_hash for block in event.blocks])
    assert isinstance(event, Removed)
    return ("removed", None, list(event.engine_hashes))


@pytest.mark.parametrize(
    ("isl", "ttft_ms"), [(512, 24.39), (1024, 32.49), (4096, 85.76), (8192, 169.14), (16384, 338.27)]
)
def test_a_lone_request_ttft_is_the_prefill_formula(isl, ttft_ms):
    model = WorkerModel(0)
    model.add_request("r", isl, 5, ids(0, isl // BS))
    clock = 0.0
    while True:
        iteration = model.step()
        clock += iteration.duration_ms
        if iteration.first_tokens:
            break
    assert iteration.first_tokens == ["r"]
    assert clock == pytest.approx(ttft_ms, abs=0.005)


def test_a_long_prompt_is_prefilled_in_chunks_with_its_blocks():
    model = WorkerModel(0)
    model.add_request("r", 2 * 8192 + 100, 1, ids(0, 32))
    first, second, third = (model.step() for _ in range(3))
    assert [it.prefill_tokens for it in (first, second, third)] == [8192, 8192, 100]
    assert (first.first_tokens, second.first_tokens, third.first_tokens) == ([], [], ["r"])
    assert [shape(event) for event in first.events] == [("stored", None, ids(0, 16))]
    assert [shape(event) for event in second.events] == [("stored", 15, ids(16, 16))]
    assert third.events == []  # the tail is a partial block: private, never stored
    assert third.finished == ["r"]
    assert not model.has_work()


def test_each_decoding_sequence_takes_one_token_of_budget():
    model = WorkerModel(0)
    model.add_request("d", 600, 50, [1])
    model.step()
    assert model.num_decoding == 1
    model.add_request("p", 20000, 1, ids(100, 39))
    iteration = model.step()
    assert iteration.prefill_tokens == 8191
    assert iteration.decode_tokens == 1
    assert iteration.duration_ms == pytest.approx(prefill_ms(8191) + decode_ms(model.kv_usage), rel=1e-2)


def test_admission_reuses_the_longest_cached_prefix():
    model = WorkerModel(0)
    model.add_request("a", 4 * BS + 100, 1, [1, 2, 3, 4])
    drain(model)
    model.add_request("b", 5 * BS + 7, 1, [1, 2, 3, 9, 10])
    iteration = model.step()
    assert iteration.admitted == [("b", 3 * BS)]
    assert iteration.prefill_tokens == 2 * BS + 7
    assert [shape(event) for event in iteration.events] == [("stored", 3, [9, 10])]


def test_a_fully_cached_prompt_prefills_nothing():
    model = WorkerModel(0)
    model.add_request("a", 2 * BS, 1, [1, 2])
    drain(model)
    model.add_request("b", 2 * BS, 3, [1, 2])
    iteration = model.step()
    assert iteration.admitted == [("b", 2 * BS)]
    assert (iteration.prefill_tokens, iteration.duration_ms, iteration.first_tokens) == (0, 0.0, ["b"])


def test_finished_sequences_are_evicted_least_recent_first_leaf_first():
    model = WorkerModel(0, WorkerConfig(num_blocks=8))
    for name, blocks in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        model.add_request(name, 3 * BS + 10, 1, blocks)
        drain(model)
    assert model.kv.inactive_order() == [3, 2, 1, 6, 5, 4]  # partial tails were freed, not cached
    model.add_request("c", 4 * BS + 10, 1, [7, 8, 9, 10])
    iteration = model.step()
    assert [shape(event) for event in iteration.events] == [
        ("removed", None, [3, 2]),
        ("stored", None, [7, 8, 9, 10]),
        ("removed", None, [1]),  # the partial tail's slot
    ]


def test_generated_tokens_fill_blocks_that_are_registered_once_full():
    model = WorkerModel(0, WorkerConfig(block_size=4, num_blocks=64))
    model.add_request("r", 6, 8, [5])  # one full block and a partial one holding 2 tokens
    runs = drain(model)
    events = [shape(event) for _, iteration in runs for event in iteration.events]
    g1, g2 = generated_block_id(0, 0, 1), generated_block_id(0, 0, 2)
    assert events == [("stored", None, [5]), ("stored", 5, [g1]), ("stored", g1, [g2])]
    assert min(g1, g2) >= GENERATED_ID_BASE
    assert model.kv.cached_ids() == {5, g1, g2}  # the last partial block (2 tokens) was freed
    assert sum(iteration.decode_tokens for _, iteration in runs) == 7  # the first token is the prefill's


def test_generated_block_ids_differ_between_requests_and_workers():
    made = {generated_block_id(w, s, j) for w, s, j in itertools.product(range(3), range(3), range(3))}
    assert len(made) == 27


def test_running_out_of_blocks_preempts_the_last_admitted_and_it_recomputes():
    model = WorkerModel(0, WorkerConfig(block_size=4, num_blocks=6))
    model.add_request("a", 8, 12, [1, 2])
    model.add_request("b", 8, 12, [3, 4])
    runs = drain(model)
    preempted = [name for _, iteration in runs for name in iteration.preempted]
    assert preempted[0] == "b"
    assert [name for _, iteration in runs for name in iteration.first_tokens] == ["a", "b"]
    assert sorted(name for _, iteration in runs for name in iteration.finished) == ["a", "b"]
    assert model.preemptions == len(preempted)
    assert model.kv.active_blocks == 0


def test_decode_steps_between_events_can_be_skipped_exactly():
    def load(model: WorkerModel) -> None:
        for n, (isl, osl) in enumerate([(700, 900), (1500, 40), (9000, 1300), (512, 513), (3000, 2)]):
            model.add_request(f"r{n}", isl, osl, ids(1000 * n, isl // BS))

    def trace(model: WorkerModel, skip: bool) -> list[tuple[float, list[str], list[str], list[Shape]]]:
        out, clock = [], 0.0
        while model.has_work():
            if skip and model.decode_only() and model.next_event_steps() > 1:
                clock += model.fast_forward(model.next_event_steps() - 1)
                continue
            iteration = model.step()
            clock += iteration.duration_ms
            if iteration.first_tokens or iteration.finished or iteration.events:
                out.append((clock, iteration.first_tokens, iteration.finished, [shape(e) for e in iteration.events]))
        return out

    stepped, skipped = WorkerModel(0), WorkerModel(0)
    load(stepped)
    load(skipped)
    expected, got = trace(stepped, skip=False), trace(skipped, skip=True)
    assert [row[1:] for row in got] == [row[1:] for row in expected]
    assert [row[0] for row in got] == pytest.approx([row[0] for row in expected], rel=1e-9)


def test_fast_forward_refuses_to_cross_an_event():
    model = WorkerModel(0)
    model.add_request("r", 600, 10, [1])
    with pytest.raises(ValueError, match="decode-only"):
        model.fast_forward(1)
    model.step()
    assert model.decode_only()
    assert model.next_event_steps() == 9
    with pytest.raises(ValueError, match="next event"):
        model.fast_forward(9)
    assert model.fast_forward(8) == pytest.approx(8 * model.decode_step_ms())
    assert model.generated_tokens("r") == 9
    assert model.step().finished == ["r"]


def random_workload(rng: random.Random, count: int, block_size: int) -> list[tuple[str, int, int, list[int]]]:
    """Requests whose block ids are chained (an id names one whole prefix), sharing prefixes at random."""
    fresh = itertools.count(1)
    made: list[list[int]] = []
    out = []
    for n in range(count):
        prefix = rng.choice(made)[: rng.randint(0, 6)] if made and rng.random() < 0.7 else []
        blocks = prefix + [next(fresh) for _ in range(rng.randint(0, 5))]
        made.append(blocks)
        isl = len(blocks) * block_size + rng.randint(0, block_size - 1) or 1
        out.append((f"r{n}", isl, rng.randint(1, 3 * block_size), blocks))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_events_keep_an_index_equal_to_the_cache(seed):
    rng = random.Random(seed)
    model = WorkerModel(7, WorkerConfig(block_size=4, num_blocks=48, max_num_batched_tokens=16, max_num_seqs=5))
    index = RadixIndex()
    mirror: set[int] = set()
    pending = random_workload(rng, 60, 4)
    while pending or model.has_work():
        for _ in range(rng.randint(0, 2)):
            if pending:
                model.add_request(*pending.pop(0))
        if not model.has_work():
            continue
        iteration = model.step()
        for event in iteration.events:
            index.apply_event(7, event)
            if isinstance(event, Stored):
                new = [block.engine_hash for block in event.blocks]
                assert mirror.isdisjoint(new), "stored a block the engine already cached"
                assert event.parent is None or event.parent in mirror
                mirror.update(new)
            else:
                assert isinstance(event, Removed)
                assert mirror.issuperset(event.engine_hashes), "removed a block the engine never stored"
                mirror.difference_update(event.engine_hashes)
        assert mirror == model.kv.cached_ids()
        held = index.holdings().get(((7, 0), StorageTier.DEVICE), {})
        assert set(held) == mirror
        assert all(int(path[-1]) == int(block) for block, path in held.items())
    assert model.kv.active_blocks == 0


def test_requests_are_checked():
    model = WorkerModel(0)
    with pytest.raises(ValueError, match="expected 2 full"):
        model.add_request("r", 1100, 1, [1])
    with pytest.raises(ValueError, match="output_tokens"):
        model.add_request("r", 10, 0, [])
    with pytest.raises(ValueError, match="block ids"):
        model.add_request("r", 512, 1, [GENERATED_ID_BASE])
    with pytest.raises(ValueError, match="more than the pool"):
        model.add_request("r", 2049 * BS, 1, ids(0, 2049))
    model.add_request("r", 10, 1, [])
    with pytest.raises(ValueError, match="already"):
        model.add_request("r", 10, 1, [])


def test_an_empty_worker_has_no_work():
    model = WorkerModel(0)
    assert not model.has_work()
    assert not model.decode_only()
    assert model.step().duration_ms == 0.0


@pytest.mark.parametrize(("sharing", "beside", "after_a_chunk"), [("scheduled", 4, 25), ("computed", 0, 20)])
def test_a_follower_reuses_a_running_prefills_blocks_as_the_engine_does(sharing: str, beside: int, after_a_chunk: int):
    """Followers on a prefix being prefilled. vLLM (``scheduled``) shares every block already scheduled, the
    chunk of this iteration included; SGLang (``computed``) only the chunks that have run."""
    config = WorkerConfig(max_num_batched_tokens=20 * BS, prefix_sharing=sharing)  # type: ignore[arg-type]
    model = WorkerModel(0, config)
    model.add_request("leader", 8 * BS, 1, ids(1, 8))
    model.add_request("beside", 4 * BS + 10, 1, ids(1, 4))  # admitted in the leader's one iteration
    assert model.step().admitted == [("leader", 0), ("beside", beside * BS)]

    model = WorkerModel(1, config)
    model.add_request("leader", 30 * BS, 1, ids(100, 30))
    assert model.step().prefill_tokens == 20 * BS  # the first chunk: 20 blocks
    model.add_request("late", 25 * BS + 10, 1, ids(100, 25))  # with the second chunk (10 more blocks)
    assert model.step().admitted == [("late", after_a_chunk * BS)]


def test_prefix_sharing_takes_only_the_two_engines_behaviours():
    with pytest.raises(ValueError, match="prefix_sharing must be 'scheduled' or 'computed'"):
        WorkerConfig(prefix_sharing="eventually")  # type: ignore[arg-type]


def test_a_received_prompt_prefills_nothing_and_its_first_token_takes_one_decode_step():
    """A decode hop whose KV was pulled whole (the partial block too): no prefill time, one decode step for its
    first token, and the reused tokens reported are the cached full blocks'."""
    model = WorkerModel(0, WorkerConfig(num_blocks=64))
    assert [shape(event) for event in model.receive(ids(1, 4))] == [("stored", None, ids(1, 4))]
    model.add_request("r", 4 * BS + 100, 3, ids(1, 4), received=True)
    first = model.step()
    assert first.prefill_tokens == 0
    assert first.first_tokens == ["r"]
    assert first.admitted == [("r", 4 * BS)]
    assert first.duration_ms == pytest.approx(decode_ms(5 / 64))  # 4 full blocks and the partial one, held


def test_a_received_prompt_missing_a_pulled_block_prefills_from_there_as_any_request():
    model = WorkerModel(0, WorkerConfig(num_blocks=64))
    model.receive(ids(1, 2))  # blocks 3 and 4 gone (evicted between the landing and the admission)
    model.add_request("r", 4 * BS + 100, 3, ids(1, 4), received=True)
    first = model.step()
    assert first.prefill_tokens == 2 * BS + 100
    assert first.duration_ms == pytest.approx(prefill_ms(2 * BS + 100))
    assert first.admitted == [("r", 2 * BS)]


def test_a_request_not_received_prefills_its_uncached_tail():
    model = WorkerModel(0, WorkerConfig(num_blocks=64))
    model.receive(ids(1, 4))
    model.add_request("r", 4 * BS + 100, 3, ids(1, 4))
    first = model.step()
    assert first.prefill_tokens == 100
    assert first.duration_ms == pytest.approx(prefill_ms(100))
