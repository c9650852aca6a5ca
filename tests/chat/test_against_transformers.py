"""Rendering and tokenizing as Hugging Face's ``apply_chat_template`` does, token for token.

``transformers`` is a test-only dependency (the ``dev`` extra): the engines render through it, so it is the
oracle. Each template of ``test_chat.py`` (ChatML, Llama 3 with its date and tools, Mistral) is installed in
a model directory beside the demo tokenizer; the same conversations go through ``ChatModel.prompt_ids`` and
through ``transformers``' tokenizer loaded from that directory, offline.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvrouter.chat import DEMO_MODEL, ChatModel, checked_messages
from tests.chat.test_chat import CHATML, LLAMA3, MISTRAL

transformers = pytest.importorskip("transformers", reason="transformers is the dev extra's oracle")

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Which worker holds my prefix?\n"},
        {"role": "assistant", "content": "Worker 2 does."},
        {"role": "user", "content": [{"type": "text", "text": "And now?"}, {"type": "text", "text": "Really?"}]},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "où_est", "description": "Find a worker", "parameters": {}}}]


def model_directory(folder: Path, template: str) -> Path:
    folder.mkdir()
    shutil.copy(DEMO_MODEL / "tokenizer.json", folder / "tokenizer.json")
    config = {
        "chat_template": template,
        "bos_token": "<|endoftext|>",  # special tokens of the demo tokenizer, as a real model's are of its own
        "eos_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def oracle(folder: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # newer releases answer a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


@pytest.mark.parametrize(("name", "template"), [("chatml", CHATML), ("llama3", LLAMA3), ("mistral", MISTRAL)])
@pytest.mark.parametrize("which", range(len(CONVERSATIONS)))
def test_the_tokens_are_transformers_tokens(tmp_path: Path, name: str, template: str, which: int) -> None:
    folder = model_directory(tmp_path / name, template)
    model = ChatModel.from_directory(name, folder)
    messages = CONVERSATIONS[which]
    if name == "mistral":  # its template takes no system message: the user/assistant turns only
        messages = [m for m in messages if m["role"] != "system"]
    checked = checked_messages(messages)
    tools = TOOLS if name == "llama3" else None
    # the oracle gets the messages as the router passes them to the template (text parts joined)
    assert model.prompt_ids(checked, tools=tools).tolist() == oracle(folder, checked, tools)
