"""``kvrouter.chat``: messages checked, templates in the conventions real models use (ChatML, Llama 3, Mistral;
written for these tests) rendered as the engines render them, a model directory read, the context limit."""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

import pytest

from kvrouter.chat import DEMO_MODEL, ChatModel, ChatTemplate, checked_messages
from kvrouter.errors import BadRequest, ConfigError

DEMO = DEMO_MODEL

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n\\n' }}
{%- if tools is not none %}
    {{- 'Tools: ' + (tools | tojson) + '\\n\\n' }}
{%- endif %}
{{- system + '<|eot_id|>' }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


def test_chatml_renders_each_message_and_the_generation_prompt():
    messages = checked_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    text = ChatTemplate(CHATML, {}, name="chatml").render(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert (
        not ChatTemplate(CHATML, {}, name="chatml")
        .render(messages, add_generation_prompt=False)
        .endswith("assistant\n")
    )


def test_llama3_gets_its_bos_the_date_the_tools_and_trimmed_content():
    messages = checked_messages([{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi\n"}])
    tools = [{"type": "function", "function": {"name": "où", "parameters": {}}}]
    text = ChatTemplate(LLAMA3, TOKENS, name="llama3").render(messages, tools=tools)
    today = datetime.datetime.now().strftime("%d %b %Y")
    assert text == (
        "<s><|start_header_id|>system<|end_header_id|>\n\n"
        f"Today Date: {today}\n\n"
        'Tools: [{"type": "function", "function": {"name": "où", "parameters": {}}}]\n\n'  # tojson: not ASCII-escaped
        "Be brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_mistral_alternates_and_its_own_refusal_is_a_400_naming_the_template():
    template = ChatTemplate(MISTRAL, TOKENS, name="mistral")
    ok = checked_messages(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    )
    assert template.render(ok) == "<s>[INST] a [/INST]b</s>[INST] c [/INST]"
    with pytest.raises(BadRequest, match="chat template mistral: Conversation roles must alternate") as caught:
        template.render(checked_messages([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]))
    assert caught.value.param == "messages"


def test_the_sandbox_keeps_a_template_inside_it():
    template = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", {}, name="escape")
    with pytest.raises(BadRequest, match="chat template escape"):
        template.render(checked_messages([{"role": "user", "content": "a"}]))


def test_a_template_that_does_not_compile_is_a_config_error():
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate("{% for %}", {}, name="broken")


@pytest.mark.parametrize(
    ("messages", "param", "message"),
    [
        ([], "messages", "non-empty list"),
        ("hi", "messages", "non-empty list"),
        (["hi"], "messages[0]", "expected an object"),
        ([{"role": "robot", "content": "x"}], "messages[0].role", "expected one of"),
        ([{"role": "user"}], "messages[0].content", "required for this role"),
        ([{"role": "system", "content": None}], "messages[0].content", "required for this role"),
        ([{"role": "user", "content": 3}], "messages[0].content", "a string or a list of text parts"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0]",
            "expected a text part",
        ),
    ],
)
def test_bad_messages_are_refused_naming_the_field(messages, param, message):
    with pytest.raises(BadRequest, match=message) as caught:
        checked_messages(messages)
    assert caught.value.param == param


def test_text_parts_reach_the_template_as_one_string_and_other_fields_pass_untouched():
    (assistant, user) = checked_messages(
        [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    assert assistant == {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}
    assert user["content"] == "a\nb"


def test_the_demo_model_renders_encodes_and_round_trips():
    model = ChatModel.from_directory("demo", DEMO)
    assert model.context_limit == 32768
    text = model.render(checked_messages([{"role": "user", "content": "Which worker holds my prefix?"}]))
    ids = model.encode(text)
    assert model.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert ids[0] == model.tokenizer.token_to_id("<|im_start|>")  # special tokens as the template wrote them


def test_a_model_directory_prefers_chat_template_jinja_and_reads_the_limit_from_config(tmp_path: Path):
    shutil.copy(DEMO / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "model_max_length": 1e30}
    config["chat_template"] = [
        {"name": "default", "template": "D{{ bos_token }}"},
        {"name": "tool_use", "template": "T"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 100}))
    model = ChatModel.from_directory("m", tmp_path)
    user = checked_messages([{"role": "user", "content": "x"}])
    assert model.render(user) == "D<s>"  # an added-token object's content
    assert model.render(user, tools=[{"type": "function"}]) == "T"  # tools: the tool_use template
    assert model.context_limit == 100
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert ChatModel.from_directory("m", tmp_path).render(user) == "J</s>"
    (tmp_path / "config.json").unlink()
    assert ChatModel.from_directory("m", tmp_path).context_limit is None  # 1e30: not a limit


def test_a_model_directory_without_what_chat_needs_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="not a directory"):
        ChatModel.from_directory("m", tmp_path / "missing")
    with pytest.raises(ConfigError, match="no chat template"):
        ChatModel.from_directory("m", tmp_path)
    (tmp_path / "chat_template.jinja").write_text("x")
    with pytest.raises(ConfigError, match=r"needs tokenizer\.json"):
        ChatModel.from_directory("m", tmp_path)


def test_tokenizer_and_template_files_take_special_tokens_from_a_config_beside_the_tokenizer(tmp_path: Path):
    shutil.copy(DEMO / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "model_max_length": 50}))
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}{{ eos_token }}")
    model = ChatModel.from_files("m", tmp_path / "tokenizer.json", template)
    assert model.render(checked_messages([{"role": "user", "content": "hi"}])) == "hi<|im_end|>"
    assert model.context_limit == 50


def test_the_context_limit_counts_the_prompt_and_the_completion():
    model = ChatModel.from_directory("demo", DEMO)
    model.check_length(32000, 768)
    with pytest.raises(BadRequest, match=r"maximum context length is 32768 tokens; the request wants 32769 \(32000"):
        model.check_length(32000, 769)
    with pytest.raises(BadRequest, match="maximum context length"):
        model.check_length(32768, None)
