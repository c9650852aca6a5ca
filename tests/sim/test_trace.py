"""``kvrouter.sim.trace``: Mooncake lines become requests; bad lines are reported with their line number
and skipped; the packaged sample is intact."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from importlib import resources
from pathlib import Path

import pytest

from kvrouter.sim.trace import SAMPLE_NAME, SAMPLE_REQUESTS, load_sample, load_trace, parse_trace


def line(
    timestamp: object = 1500, input_length: object = 1100, output_length: object = 7, hash_ids: object = (5, 6, 7)
) -> str:
    return json.dumps(
        {"timestamp": timestamp, "input_length": input_length, "output_length": output_length, "hash_ids": hash_ids}
    )


def test_a_line_becomes_a_request():
    trace = parse_trace([line()], name="t", speedup=2.0)
    (request,) = trace.requests
    assert request.request_id == "r1"
    assert request.arrival == pytest.approx(0.75)  # 1500 ms / 1000 / 2
    assert (request.input_tokens, request.output_tokens) == (1100, 7)
    assert request.local_hashes == (5, 6)  # 1100 // 512 = 2 full blocks; the third is partial
    assert trace.skipped == ()


def test_blocks_are_full_blocks_only():
    exact = parse_trace([line(input_length=1024, hash_ids=(1, 2))], name="t").requests[0]
    short = parse_trace([line(input_length=511, hash_ids=(1,))], name="t").requests[0]
    assert exact.local_hashes == (1, 2)
    assert short.local_hashes == ()


BAD_LINES = {
    "not_json": ('{"timestamp": 1,', "not JSON"),
    "not_an_object": ("[1, 2]", "expected a JSON object"),
    "missing_field": ('{"timestamp": 1, "input_length": 3, "output_length": 1}', "missing field 'hash_ids'"),
    "string_length": (line(input_length="1100"), "'input_length' must be an integer"),
    "bool_length": (line(output_length=True), "'output_length' must be an integer"),
    "negative_timestamp": (line(timestamp=-1), "'timestamp' must be >= 0"),
    "negative_output": (line(output_length=-3), "'output_length' must be >= 0"),
    "hash_not_int": (line(hash_ids=(5, "6", 7)), "'hash_ids[1]' must be an integer"),
    "hash_negative": (line(hash_ids=(5, -6, 7)), "'hash_ids[1]' must be an integer >= 0"),
    "hash_ids_not_list": (line(hash_ids=5), "'hash_ids' must be a list"),
    "too_few_hash_ids": (line(input_length=2048, hash_ids=(1, 2, 3)), "spans 4 full blocks"),
}


@pytest.mark.parametrize("case", BAD_LINES, ids=list(BAD_LINES))
def test_a_bad_line_is_reported_with_its_number_and_skipped(case, tmp_path: Path, caplog):
    bad, reason = BAD_LINES[case]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join([line(timestamp=0), bad, line(timestamp=2000)]) + "\n")
    with caplog.at_level(logging.WARNING, logger="kvrouter.sim.trace"):
        trace = load_trace(path)
    assert [r.request_id for r in trace.requests] == ["r1", "r3"]
    assert len(trace.skipped) == 1
    number, message = trace.skipped[0]
    assert number == 2
    assert reason in message
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1
    assert re.search(r"trace=trace\.jsonl line=2 ", logged[0])


def test_blank_lines_are_not_errors():
    trace = parse_trace([line(), "", "   ", line()], name="t")
    assert [r.request_id for r in trace.requests] == ["r1", "r4"]
    assert trace.skipped == ()


def test_limit_counts_good_requests():
    trace = parse_trace([line(), "oops", line(), line()], name="t", limit=2)
    assert [r.request_id for r in trace.requests] == ["r1", "r3"]
    assert trace.skipped == ((2, trace.skipped[0][1]),)


@pytest.mark.parametrize(("kwargs", "match"), [({"speedup": 0.0}, "speedup"), ({"limit": -1}, "limit")])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        parse_trace([], name="t", **kwargs)


def _sample_readme_sha256() -> str:
    readme = resources.files("kvrouter.sim").joinpath("data").joinpath("README.md").read_text()
    found = re.search(r"^\| sha256 \| ([0-9a-f]{64}) \|$", readme, re.MULTILINE)
    assert found, "the sample README states the sample's sha256"
    return found.group(1)


def test_sample_matches_its_readme_sha256():
    data = resources.files("kvrouter.sim").joinpath("data").joinpath(SAMPLE_NAME).read_bytes()
    assert hashlib.sha256(data).hexdigest() == _sample_readme_sha256()


def test_sample_loads_every_request():
    trace = load_sample()
    assert len(trace) == SAMPLE_REQUESTS == 2000
    assert trace.skipped == ()
    assert trace.requests[0].request_id == "r1"
    assert trace.requests[-1].request_id == "r2000"
    assert all(r.local_hashes[0] == 0 for r in trace.requests if r.local_hashes)  # conversation: system block 0
    arrivals = [r.arrival for r in trace.requests]
    assert arrivals == sorted(arrivals)


def test_sample_speedup_and_limit():
    trace = load_sample(speedup=4.0, limit=10)
    assert len(trace) == 10
    assert trace.requests[-1].arrival == pytest.approx(load_sample(limit=10).requests[-1].arrival / 4)
