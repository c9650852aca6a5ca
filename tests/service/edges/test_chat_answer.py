"""``ChatAnswer`` (``--forward-tokens``): an engine's completions answer and events as chat's."""

from __future__ import annotations

import json

from kvrouter.service.edges.chat_answer import ChatAnswer

COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 7,
    "model": "m",
    "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}},
}


def events(data: bytes) -> list[str]:
    return [part[6:] for part in data.decode().split("\n\n") if part.startswith("data: ")]


def test_a_whole_completion_becomes_a_chat_completion_keeping_everything_else():
    answer = json.loads(ChatAnswer().whole(json.dumps(COMPLETION).encode()))
    assert answer["object"] == "chat.completion"
    assert answer["choices"] == [
        {"index": 0, "logprobs": None, "finish_reason": "length", "message": {"role": "assistant", "content": "Hello"}}
    ]
    assert (answer["id"], answer["created"], answer["usage"]) == ("cmpl-1", 7, COMPLETION["usage"])


def test_stream_events_become_chunks_with_the_role_first_even_when_split_across_reads():
    first = {**COMPLETION, "choices": [{"index": 0, "text": "He", "finish_reason": None}]}
    second = {**COMPLETION, "choices": [{"index": 0, "text": "llo", "finish_reason": "length"}]}
    raw = b"data: " + json.dumps(first).encode() + b"\n\ndata: " + json.dumps(second).encode() + b"\n\ndata: [DONE]\n\n"
    convert = ChatAnswer()
    out = b"".join(convert.stream(raw[i : i + 7]) for i in range(0, len(raw), 7)) + convert.end()
    parsed = events(out)
    assert parsed[-1] == "[DONE]"
    chunks = [json.loads(p) for p in parsed[:-1]]
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 2
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert chunks[1]["choices"][0]["delta"] == {"content": "llo"}
    assert chunks[1]["choices"][0]["finish_reason"] == "length"
    assert chunks[1]["usage"] == COMPLETION["usage"]


def test_errors_and_what_is_not_json_pass_as_they_came():
    error = b'{"error": {"message": "boom", "code": 502}}'
    assert ChatAnswer().whole(error) == error
    assert ChatAnswer().whole(b"not json") == b"not json"
    convert = ChatAnswer()
    assert convert.stream(b"data: " + error + b"\n\n") == b"data: " + error + b"\n\n"
    assert convert.stream(b"data: half") == b""
    assert convert.end() == b"data: half"
