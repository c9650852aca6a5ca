"""``kvrouter/chat/prefixes.py``: a conversation's earlier turns reused, and always what a full encode gives.

The property: over random conversations (text with spaces, newlines, unicode and the special tokens'
own strings), every turn's tokens through the cache equal a full encode of the same rendering. Then the
cases the cache must refuse: a template that does not split at special tokens, an earlier turn rendered
differently, tools or template variables that change, and the bound on what it keeps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hypothesis import given, settings, strategies as st

from kvrouter.chat import DEMO_MODEL, ChatModel, checked_messages
from kvrouter.chat.prefixes import PrefixCache

MODEL = ChatModel.from_directory("demo", DEMO_MODEL)

TEXT = st.lists(
    st.sampled_from([*"abc xyz\n\t\r é語Ġ", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "  ", "words "]),
    max_size=30,
).map("".join)
"""Text with what can go wrong at a split: spaces, newlines, unicode, the special tokens' own strings."""


def full(model: ChatModel, messages: list[dict[str, str]]) -> list[int]:
    return model.encode(model.render(messages))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=6), TEXT)
def test_every_turn_equals_a_full_encode(turns: list[tuple[str, str]], system: str) -> None:
    model = ChatModel.from_directory("demo", DEMO_MODEL)
    assert model.prefixes is not None
    messages = checked_messages([{"role": "system", "content": system or "s"}])
    for question, answer in turns:
        messages.append({"role": "user", "content": question or "q"})
        assert model.prompt_ids(messages).tolist() == full(model, messages)
        messages.append({"role": "assistant", "content": answer})


def test_a_growing_conversation_reuses_every_earlier_turn():
    model = ChatModel.from_directory("demo", DEMO_MODEL)
    assert model.prefixes is not None
    messages = checked_messages([{"role": "system", "content": "You route requests. " * 50}])
    for turn in range(10):
        messages.append({"role": "user", "content": f"question {turn} " * 20})
        assert model.prompt_ids(messages).tolist() == full(model, messages)
        messages.append({"role": "assistant", "content": f"answer {turn} " * 20})
    assert model.prefixes.hits == 9  # every turn but the first
    assert model.prefixes.reused_tokens > 0


def test_tools_and_template_variables_are_part_of_what_is_reused():
    model = ChatModel.from_directory("demo", DEMO_MODEL)
    assert model.prefixes is not None
    messages = checked_messages([{"role": "user", "content": "hi"}])
    model.prompt_ids(messages, tools=[{"type": "function", "function": {"name": "a"}}])
    messages.append({"role": "assistant", "content": "ok"})
    messages.append({"role": "user", "content": "again"})
    model.prompt_ids(messages)  # no tools this time: another conversation as far as reuse goes
    assert model.prefixes.hits == 0


def test_a_template_without_special_tokens_between_messages_gets_no_cache(tmp_path: Path):
    shutil.copy(DEMO_MODEL / "tokenizer.json", tmp_path / "tokenizer.json")
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}assistant:"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    model = ChatModel.from_directory("plain", tmp_path)
    assert model.prefixes is None  # a space or a word could merge across the split: whole encodes only
    messages = checked_messages([{"role": "user", "content": "hi"}])
    assert model.prompt_ids(messages).tolist() == full(model, messages)


def test_an_earlier_turn_rendered_differently_is_encoded_whole(tmp_path: Path):
    """A template that marks the last user message: the kept text is no prefix of the next prompt."""
    shutil.copy(DEMO_MODEL / "tokenizer.json", tmp_path / "tokenizer.json")
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if loop.last %} (latest){% endif %}\\n"
        "{{ m['content'] }}<|im_end|>\\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    model = ChatModel.from_directory("marks", tmp_path)
    messages = checked_messages([{"role": "user", "content": "one"}])
    if model.prefixes is None:  # refused at load: nothing more to check
        return
    model.prompt_ids(messages)
    messages += checked_messages([{"role": "assistant", "content": "a"}, {"role": "user", "content": "two"}])
    assert model.prompt_ids(messages).tolist() == full(model, messages)
    assert model.prefixes.hits == 0


def test_the_cache_keeps_at_most_its_bound_least_recently_used_first():
    cache = PrefixCache(MODEL.encode, ["<|im_start|>", "<|im_end|>"], "<|im_start|>assistant\n", max_tokens=60)
    for i in range(5):
        messages = checked_messages([{"role": "user", "content": f"conversation {i} " * 5}])
        text = MODEL.render(messages)
        assert cache.encode(messages, text, generation_prompt=True).tolist() == MODEL.encode(text)
        assert cache.kept_tokens <= 60
    assert 0 < len(cache._entries) < 5
