"""The workload generators: deterministic per seed, their shapes and parameters honoured, their hash ids chained
as Mooncake's are (a shared id means a shared prefix up to that block's end, and nothing else is shared)."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from kvrouter.sim.trace import TRACE_BLOCK_SIZE, load_trace
from kvrouter.sim.workloads import (
    WORKLOADS,
    ChatOptions,
    FanoutOptions,
    RagOptions,
    generate,
    parse_workload_options,
    trace_name,
    workload_records,
)

B = TRACE_BLOCK_SIZE


def _full(record: dict[str, Any]) -> list[int]:
    """The record's full blocks: what an engine caches and the router sees."""
    ids: list[int] = record["hash_ids"]
    return ids[: record["input_length"] // B]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_the_same_seed_gives_the_same_trace_and_another_seed_another(name: str):
    options = WORKLOADS[name].options
    first = workload_records(name, options(seed=5))
    assert workload_records(name, options(seed=5)) == first
    assert workload_records(name, options(seed=6)) != first


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_records_are_valid_trace_lines_in_arrival_order(name: str):
    records = workload_records(name, WORKLOADS[name].options())
    stamps = [record["timestamp"] for record in records]
    assert stamps == sorted(stamps)
    for record in records:
        assert len(record["hash_ids"]) == -(-record["input_length"] // B)  # the partial block has an id too
    trace = generate(name)
    assert trace.skipped == ()
    assert len(trace) == len(records)
    assert [r.local_hashes for r in trace.requests] == [tuple(_full(record)) for record in records]


def test_a_block_id_is_shared_exactly_when_the_prefix_up_to_its_end_is():
    records = workload_records("rag", RagOptions(requests=300, documents=20, system_tokens=700))
    by_id: dict[int, set[tuple[int, ...]]] = defaultdict(set)
    for record in records:
        ids = record["hash_ids"]
        for depth, block in enumerate(ids):
            by_id[block].add(tuple(ids[: depth + 1]))
    assert all(len(prefixes) == 1 for prefixes in by_id.values())  # one id, one chain
    # 700 system tokens: block 0 is all system prompt (shared by every request); block 1 straddles the
    # system prompt and the first document, so it is shared only by requests retrieving that document first.
    assert len({record["hash_ids"][0] for record in records}) == 1
    assert 1 < len({record["hash_ids"][1] for record in records}) <= 20


def _groups(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Fan-out groups, told apart by their shared context's first block."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(record["hash_ids"][0], []).append(record)
    return list(groups.values())


def test_fanout_groups_share_a_fresh_prefix_and_arrive_within_the_window():
    options = FanoutOptions(requests=400, group_min=3, group_max=9, prefix_min_tokens=2048, prefix_max_tokens=6000)
    records = workload_records("fanout", options)
    assert len(records) == 400
    groups = _groups(records)
    assert all(3 <= len(group) <= 9 for group in groups[:-1])  # the last group may be cut at `requests`
    seen: set[int] = set()
    starts = []
    for group in groups:
        shared = set.intersection(*(set(_full(record)) for record in group))
        prefix_blocks = len(shared)
        assert 2048 // B <= prefix_blocks <= 6000 // B
        assert not shared & seen, "a group's context is fresh: no earlier group has its blocks"
        seen |= {block for record in group for block in record["hash_ids"]}
        stamps = [record["timestamp"] for record in group]
        assert max(stamps) - min(stamps) <= options.window_ms
        starts.append(min(stamps))
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert min(gaps) >= options.gap_min_s * 1000 - options.window_ms
    assert max(gaps) <= options.gap_max_s * 1000 + options.window_ms


def test_fanout_defaults_are_the_issues_trace():
    records = workload_records("fanout", FanoutOptions())
    assert len(records) == 1536
    groups = _groups(records)
    assert all(4 <= len(group) <= 24 for group in groups[:-1])
    assert all(min(r["input_length"] for r in group) >= 4096 for group in groups)


def test_rag_draws_documents_by_zipf_popularity_after_one_system_prompt():
    options = RagOptions(requests=3000, documents=50, zipf_s=1.2, system_tokens=1024)
    records = workload_records("rag", options)
    assert len({tuple(record["hash_ids"][:2]) for record in records}) == 1  # 1024 tokens: 2 shared blocks
    third = Counter(record["hash_ids"][2] for record in records)  # the first document's first block
    counts = sorted(third.values(), reverse=True)
    assert len(counts) <= 50
    assert counts[0] > 8 * counts[min(9, len(counts) - 1)]  # rank 1 against rank 10: 10^1.2 ≈ 16
    gaps = [b["timestamp"] - a["timestamp"] for a, b in itertools.pairwise(records)]
    assert sum(gaps) / len(gaps) == pytest.approx(1000 / options.rate_per_s, rel=0.1)


def test_rag_with_no_skew_spreads_documents_evenly():
    records = workload_records("rag", RagOptions(requests=3000, documents=10, zipf_s=0.0, docs_max=1))
    counts = Counter(record["hash_ids"][2] for record in records).values()
    assert len(counts) == 10
    assert max(counts) < 1.3 * min(counts)


def test_chat_turns_extend_their_conversation_and_follow_the_answer_plus_think_time():
    # One-block system prompts and user turns of at least a block, so a conversation is named by block 1.
    options = ChatOptions(
        conversations=60,
        system_prompts=2,
        system_min_tokens=B,
        system_max_tokens=B,
        user_min_tokens=B,
        user_max_tokens=2 * B,
        wave_min=10,
        wave_max=10,
        wave_window_s=1.0,
        wave_gap_min_s=20.0,
        wave_gap_max_s=20.0,
    )
    records = workload_records("chat", options)
    assert len({record["hash_ids"][0] for record in records}) == 2
    conversations: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        conversations[record["hash_ids"][1]].append(record)
    assert len(conversations) == 60
    firsts = sorted(turns[0]["timestamp"] for turns in conversations.values())
    for wave in range(6):
        stamps = firsts[wave * 10 : wave * 10 + 10]
        assert wave * 20_000 <= stamps[0]
        assert stamps[-1] <= wave * 20_000 + 1000
    for turns in conversations.values():
        assert 2 <= len(turns) <= 8
        for earlier, later in itertools.pairwise(turns):
            assert later["hash_ids"][: len(_full(earlier))] == _full(earlier)  # the history is its prefix
            assert later["input_length"] >= earlier["input_length"] + earlier["output_length"] + B
            answer_ms = earlier["output_length"] * options.answer_ms_per_token
            gap = later["timestamp"] - earlier["timestamp"]
            assert answer_ms + 1000 - 2 <= gap <= answer_ms + 5000 + 2  # timestamps are rounded to the ms


def test_options_parse_from_key_value_pairs_with_their_types():
    options = parse_workload_options("rag", ["seed=3", " zipf_s = 0.8", "documents=10"])
    assert options == RagOptions(seed=3, zipf_s=0.8, documents=10)
    assert trace_name("rag", options) == "rag[seed=3,documents=10,zipf_s=0.8]"
    assert trace_name("rag", RagOptions()) == "rag"


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        (["colour=blue"], "unknown option 'colour' for workload 'fanout'; valid (with defaults): seed=0, requests="),
        (["requests"], "'requests' is not KEY=VALUE"),
        (["requests=many"], "'requests' takes int, got 'many'"),
        (["group_min=9", "group_max=3"], "group_max (3) must be >= group_min (9)"),
        (["requests=0"], "requests must be a number >= 1, got 0"),
        (["window_ms=nan"], "window_ms must be a number >= 0, got nan"),
        (["gap_min_s=nan"], "gap_min_s must be a number >= 0, got nan"),
        (["gap_max_s=nan"], "gap_max_s (nan) must be >= gap_min_s (1.5)"),
    ],
)
def test_bad_options_say_what_is_wrong(pairs: list[str], message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_workload_options("fanout", pairs)


def test_an_unknown_workload_names_the_choices():
    with pytest.raises(ValueError, match="unknown workload 'agents'; choose from: fanout, rag, chat"):
        generate("agents")


def test_a_written_trace_replays_as_the_generated_one(tmp_path: Path):
    path = tmp_path / "chat.jsonl"
    generated = generate("chat", ChatOptions(conversations=40), speedup=3.0, write_to=path)
    lines = path.read_text().splitlines()
    assert len(lines) == len(generated)
    assert all(set(json.loads(line)) == {"timestamp", "input_length", "output_length", "hash_ids"} for line in lines)
    assert load_trace(path, speedup=3.0).requests == generated.requests
