"""``POST /v1/chat/completions`` and ``GET /v1/models`` through a real service to real mock engines.

Three models, each with its own tokenizer files and template: ``m`` (the shipped demo model; workers 1 and
2, and worker 2 serves its LoRA adapter ``sql`` too), ``plain`` (the demo tokenizer under another template
and a 200-token context; worker 3, started with the same directory, as an engine serves its own model) and
``bare`` (worker 4, registered with no model directory here). The router renders and tokenizes each chat
with the model's files and routes on those tokens; the engine renders again. Every refusal is OpenAI's
error shape, and nothing stays booked.
"""

from __future__ import annotations

import http.client
import json
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrouter.chat import DEMO_MODEL, ChatModel, checked_messages
from kvrouter.routing.config import KVROUTER_CONFIG
from kvrouter.service import ServiceConfig
from tests.conftest import _wait_until
from tests.service.conftest import BLOCK, MockSpec, Running, serving
from tests.service.edges.test_proxy import booked, listening

pytestmark = pytest.mark.timeout(180)

PLAIN_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('the first message may not be the assistant') }}"
    "{% endif %}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
)
SYSTEM = "You are the router's assistant; you answer questions about workers, blocks and caches. " * 4


def plain_model(folder: Path) -> Path:
    folder.mkdir()
    shutil.copy(DEMO_MODEL / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": PLAIN_TEMPLATE}))
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 200}))
    return folder


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("chat")
    plain = plain_model(tmp / "plain")
    config = ServiceConfig(
        port=0,
        shards=1,
        health_interval_secs=60.0,
        drain_secs=2.0,
        router=KVROUTER_CONFIG,  # the service's default routing
        model_paths=(f"m={DEMO_MODEL}", f"plain={plain}"),
    )
    fleet = [
        MockSpec(1, "m", speedup="10000"),
        MockSpec(2, "m", ("--lora-adapter", "sql"), "10000", {"lora_adapters": ["sql"]}),
        MockSpec(3, "plain", ("--model-path", str(plain)), "10000"),
        MockSpec(4, "bare", speedup="10000"),
    ]
    with serving(config, tmp, fleet=fleet) as run:
        _wait_until(lambda: listening(run.service, 4), what="the engine following the four mock engines")
        yield run


def post_chat(
    run: Running, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    """One chat through the router: (status, parsed JSON or the SSE events' payloads, headers)."""
    parts = urllib.parse.urlsplit(run.url)
    assert parts.hostname is not None
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        sent = {"Content-Type": "application/json", **(headers or {})}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), sent)
        response = conn.getresponse()
        data = response.read()
        headers = dict(response.getheaders())
        if headers.get("Content-Type", "").startswith("text/event-stream"):
            events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
            return response.status, events, headers
        return response.status, json.loads(data), headers
    finally:
        conn.close()


def decision(run: Running, headers: dict[str, str]) -> dict[str, Any]:
    return run.ok("GET", f"/decisions/{headers['X-Kvrouter-Selection-Id']}")  # type: ignore[no-any-return]


def demo_tokens(messages: list[dict[str, str]]) -> list[int]:
    model = ChatModel.from_directory("m", DEMO_MODEL)
    return model.encode(model.render(checked_messages(messages)))


def matched(
    run: Running, messages: list[dict[str, str]], worker: str, lora: str | None = None, salt: str | None = None
) -> int:
    """The tokens of a chat of ``m`` (run with the adapter ``lora``, salted ``salt``) the index holds on ``worker``."""
    body = {"model_name": "m", "token_ids": demo_tokens(messages), "lora_name": lora, "cache_salt": salt}
    return int(run.ok("POST", "/query", body)["scores"].get(worker, {}).get("0", 0))


def wait_indexed(
    run: Running,
    messages: list[dict[str, str]],
    headers: dict[str, str],
    lora: str | None = None,
    salt: str | None = None,
) -> None:
    """Until the KV events of a chat answered with ``headers`` are in the index: its full blocks on its worker."""
    worker = headers["X-Kvrouter-Worker"].split(":")[0]
    full = len(demo_tokens(messages)) // BLOCK * BLOCK

    def indexed() -> bool:
        return matched(run, messages, worker, lora, salt) == full

    _wait_until(indexed, what="the chat's blocks in the index")


def reused_as_predicted(run: Running, answer: dict[str, Any], headers: dict[str, str]) -> None:
    """The engine reused some of the prompt, exactly what the router predicted (decision and header)."""
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert cached == decision(run, headers)["overlap_blocks"] * BLOCK == int(headers["X-Kvrouter-Overlap-Tokens"])


def finds_none_of_it(run: Running, body: dict[str, Any]) -> None:
    """The chat ``body`` finds no cached block, in the router's view and in the engine's."""
    status, answer, headers = post_chat(run, body)
    assert status == 200, answer
    assert decision(run, headers)["best_overlap_blocks"] == 0
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def conversation(turns: int, topic: str = "") -> list[dict[str, str]]:
    """A conversation's first ``turns`` user turns; ``topic`` opens the system prompt (one no other test sent)."""
    messages = [{"role": "system", "content": topic + SYSTEM}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: which worker holds the prefix of turn {turn}?"})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"Worker {turn % 2 + 1} holds it."})
    return messages


def test_models_lists_every_model_a_worker_serves(chat: Running):
    answer = chat.ok("GET", "/v1/models")
    assert answer == {
        "object": "list",
        "data": [
            *({"id": name, "object": "model", "owned_by": "kvrouter"} for name in ("bare", "m", "plain")),
            {"id": "sql", "object": "model", "owned_by": "kvrouter", "parent": "m"},
        ],
    }


def test_a_chat_is_routed_on_its_rendered_tokens_and_forwarded_unchanged(chat: Running):
    status, answer, headers = post_chat(chat, {"model": "m", "messages": conversation(1), "max_tokens": 3})
    assert status == 200, answer
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    worker = int(headers["X-Kvrouter-Worker"].split(":")[0])
    assert worker in (1, 2)
    made = decision(chat, headers)
    assert made["isl_tokens"] == answer["usage"]["prompt_tokens"]  # the router's tokens are the engine's
    assert booked(chat) == 0


def test_a_streamed_chat_passes_its_chunks_through_and_frees(chat: Running):
    body = {"model": "m", "messages": conversation(1), "max_tokens": 3, "stream": True}
    status, events, headers = post_chat(chat, body)
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[-1]["usage"]["prompt_tokens"] == decision(chat, headers)["isl_tokens"]
    assert booked(chat) == 0


def test_a_conversations_next_turn_goes_where_its_history_is_cached(chat: Running):
    """On this idle fleet too, where the other worker of ``m`` may have done no recent work at all (its work
    factor once priced it at 0, whatever the cache: ``routing/cost.py``)."""
    talk = conversation(2, topic="Follow-up questions. ")
    first = post_chat(chat, {"model": "m", "messages": talk[:2], "max_tokens": 2})
    assert first[0] == 200
    wait_indexed(chat, talk[:2], first[2])
    status, answer, headers = post_chat(chat, {"model": "m", "messages": talk, "max_tokens": 2})
    assert status == 200
    assert headers["X-Kvrouter-Worker"] == first[2]["X-Kvrouter-Worker"], json.dumps(decision(chat, headers))
    reused_as_predicted(chat, answer, headers)


def test_a_salted_conversation_reuses_its_own_blocks_and_no_one_elses(chat: Running):
    """``cache_salt`` is hashed into the blocks routed on, as the engine hashes it into the blocks it caches
    (and says so in its events): the salted conversation's next turn finds its history, with ``cached_tokens``
    equal to the prediction, and the same messages unsalted find none of it."""
    talk = conversation(2, topic="Salted questions. ")
    salted = {"model": "m", "max_tokens": 2, "cache_salt": "tenant-1"}
    first = post_chat(chat, {**salted, "messages": talk[:2]})
    assert first[0] == 200, first[1]
    wait_indexed(chat, talk[:2], first[2], salt="tenant-1")
    assert matched(chat, talk[:2], first[2]["X-Kvrouter-Worker"].split(":")[0]) == 0  # not the unsalted blocks

    status, answer, headers = post_chat(chat, {**salted, "messages": talk})
    assert status == 200
    assert headers["X-Kvrouter-Worker"] == first[2]["X-Kvrouter-Worker"]
    reused_as_predicted(chat, answer, headers)
    finds_none_of_it(chat, {"model": "m", "messages": talk, "max_tokens": 1})  # unsalted
    assert booked(chat) == 0


def test_an_adapters_chat_runs_where_it_is_served_on_blocks_of_its_own(chat: Running):
    """``model: sql`` is rendered with ``m``'s files and routed to worker 2, the one serving the adapter; the
    engine hashes the adapter's blocks with its name, so does the router, and the next turn's reuse is what the
    router predicted. The same messages for the base model find none of them."""
    talk = conversation(2, topic="Adapter questions. ")
    first = post_chat(chat, {"model": "sql", "messages": talk[:2], "max_tokens": 2})
    assert first[0] == 200, first[1]
    assert first[2]["X-Kvrouter-Worker"] == "2:0"
    wait_indexed(chat, talk[:2], first[2], lora="sql")
    assert matched(chat, talk[:2], "2") == 0  # not the base model's blocks

    status, answer, headers = post_chat(chat, {"model": "sql", "messages": talk, "max_tokens": 2, "stream": False})
    assert status == 200
    assert headers["X-Kvrouter-Worker"] == "2:0"
    reused_as_predicted(chat, answer, headers)
    finds_none_of_it(chat, {"model": "m", "messages": talk, "max_tokens": 1})  # the base model
    assert booked(chat) == 0


def test_an_adapters_completion_is_routed_where_it_is_served(chat: Running):
    for _ in range(4):
        prompt = demo_tokens(conversation(1, topic="Completions for the adapter. "))
        status, answer, headers = chat.call(
            "POST", "/v1/completions", {"model": "sql", "prompt": prompt, "max_tokens": 1}
        )
        assert status == 200, answer
        assert headers["X-Kvrouter-Worker"] == "2:0"
    assert booked(chat) == 0


def test_each_model_renders_with_its_own_template_and_tokenizer(chat: Running):
    messages = conversation(1)[1:]
    plain = post_chat(chat, {"model": "plain", "messages": messages, "max_tokens": 1})
    demo = post_chat(chat, {"model": "m", "messages": messages, "max_tokens": 1})
    assert plain[0] == demo[0] == 200
    assert plain[2]["X-Kvrouter-Worker"] == "3:0"
    for _status, answer, headers in (plain, demo):
        assert decision(chat, headers)["isl_tokens"] == answer["usage"]["prompt_tokens"]
    assert plain[1]["usage"]["prompt_tokens"] != demo[1]["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, "model", "no worker serves 'nope'"),
        ({"model": "bare", "messages": [{"role": "user", "content": "x"}]}, "model", "--model-path bare=DIR"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", "required for this role"),
        ({"model": "m", "messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "expected one of"),
        ({"model": "m", "messages": []}, "messages", "non-empty list"),
        ({"model": "m", "n": 2, "messages": [{"role": "user", "content": "x"}]}, "n", "send n=1"),
        ({"model": "m", "stream": "yes", "messages": [{"role": "user", "content": "x"}]}, "stream", "true or false"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model", "non-empty string"),
        (
            {"model": "plain", "messages": [{"role": "user", "content": "word " * 300}]},
            "messages",
            "maximum context length is 200 tokens",
        ),
        (
            {"model": "plain", "max_tokens": 150, "messages": [{"role": "user", "content": "word " * 40}]},
            "messages",
            "maximum context length is 200 tokens",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "cache_salt": 7},
            "cache_salt",
            "non-empty string",
        ),
    ],
)
def test_bad_chats_answer_400_in_openais_shape_and_book_nothing(chat: Running, body, param, message):
    status, answer, _ = post_chat(chat, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == 400
    assert message in error["message"]
    assert booked(chat) == 0


def test_a_template_that_raises_is_a_400_naming_the_template(chat: Running):
    messages = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}]
    status, answer, _ = post_chat(chat, {"model": "plain", "messages": messages})
    assert status == 400
    assert answer["error"]["param"] == "messages"
    assert "the first message may not be the assistant" in answer["error"]["message"]
    assert "chat template" in answer["error"]["message"]
    status, answer, _ = post_chat(chat, {"model": "m", "messages": messages[1:], "chat_template_kwargs": "no"})
    assert status == 400
    assert answer["error"]["param"] == "chat_template_kwargs"
    assert booked(chat) == 0


def test_other_routes_keep_their_own_error_shape(chat: Running):
    status, answer, _ = chat.call("POST", "/select", {"model_name": "nope", "token_ids": [1, 2, 3]})
    assert status == 404
    assert isinstance(answer["error"], str)
    status, answer, _ = chat.call("GET", "/v1/chat/completions")
    assert status == 405
    assert answer["error"]["type"] == "invalid_request_error"
