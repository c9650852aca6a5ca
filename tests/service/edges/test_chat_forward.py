"""``--forward-tokens``: a chat routed on its rendered tokens is sent as those tokens to the engine's
``/v1/completions``, and the answer comes back as chat objects, streamed or not. Its own module: one
service per process at a time, and ``test_chat.py``'s is another."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kvrouter.chat import DEMO_MODEL
from kvrouter.service import ServiceConfig
from tests.conftest import _wait_until
from tests.service.conftest import MockSpec, Running, serving
from tests.service.edges.test_chat import conversation, decision, post_chat
from tests.service.edges.test_proxy import booked, listening

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def forwarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """A service with ``--forward-tokens`` and one mock engine of ``m``."""
    tmp = tmp_path_factory.mktemp("forwarded")
    config = ServiceConfig(
        port=0,
        shards=1,
        health_interval_secs=60.0,
        drain_secs=2.0,
        model_paths=(f"m={DEMO_MODEL}",),
        forward_tokens=True,
    )
    with serving(config, tmp, fleet=[MockSpec(1, "m", speedup="10000")]) as run:
        _wait_until(lambda: listening(run.service, 1), what="the engine following the mock engine")
        yield run


def test_forward_tokens_sends_the_routed_tokens_to_completions_and_answers_as_chat(forwarded: Running):
    body = {"model": "m", "messages": conversation(1), "max_tokens": 3, "tools": [{"type": "function"}]}
    status, answer, headers = post_chat(forwarded, body)
    assert status == 200, answer
    assert answer["id"].startswith("cmpl-mock-")  # the engine's /v1/completions answered
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": ""}
    assert answer["usage"]["prompt_tokens"] == decision(forwarded, headers)["isl_tokens"]
    status, events, _ = post_chat(forwarded, {**body, "stream": True})
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the second time: cached
    assert booked(forwarded) == 0
