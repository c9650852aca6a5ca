"""``ChatModel``: what the router needs of a model to route its chat: a template, a tokenizer, a context limit.

Read from a local directory as Hugging Face lays a model out (``--model-path [NAME=]DIR``), never from the
network (a router must start without it):

- ``tokenizer.json``: the tokenizer (the ``tokenizers`` package);
- the chat template: ``chat_template.jinja`` when present (newer layouts), else ``tokenizer_config.json``'s
  ``chat_template`` (a string, or a list of named templates: ``default``, and ``tool_use`` when a request
  has tools, as ``apply_chat_template`` picks);
- the special tokens the template sees: every ``*_token`` of ``tokenizer_config.json`` (a string, or an
  added-token object's ``content``);
- the context limit: ``config.json``'s ``max_position_embeddings`` (or ``n_positions``, ``max_seq_len``,
  ``seq_length``), else ``tokenizer_config.json``'s ``model_max_length`` when it is a real one (Hugging
  Face writes 1e30 for "none").

Or from two files (``--tokenizer FILE --chat-template FILE``), special tokens from a
``tokenizer_config.json`` beside the tokenizer when there is one. The rendered prompt is encoded without
adding special tokens, as vLLM and SGLang encode a chat prompt: the template writes them.

``generation_config.json`` is not read: it holds sampling defaults, which change nothing the router routes on.

:data:`DEMO_MODEL` is the small model the package ships for its demo (``tools/make_demo_model.py`` makes it
from the repository's own docs): the mock engines render and tokenize chat with it unless given
``--model-path``, and ``kvrouter up``'s demo router serves it, so both agree on every prompt's tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ..errors import BadRequest, ConfigError
from .prefixes import PrefixCache
from .template import ChatTemplate

__all__ = ["DEMO_MODEL", "ChatModel"]

DEMO_MODEL: Final = Path(__file__).resolve().with_name("demo_model")
"""The shipped demo model directory (``tokenizer.json``, ``tokenizer_config.json``, ``config.json``)."""

LIMIT_KEYS: Final = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
"""``config.json`` keys that give a model's context length, first found wins."""

NO_LIMIT: Final = 10**9
"""A ``model_max_length`` at or above this is Hugging Face's "not set" (it writes 1e30)."""


class ChatModel:
    """A model's template, tokenizer and context limit (see the module docstring).

    Args:
        name: the model name requests use.
        tokenizer: a ``tokenizers.Tokenizer``.
        templates: template name -> compiled template (``default`` at least).
        context_limit: tokens of prompt plus output; None: unknown, not checked.
        source: where it was read from, for messages.
    """

    def __init__(
        self,
        name: str,
        tokenizer: Any,
        templates: Mapping[str, ChatTemplate],
        context_limit: int | None,
        source: str,
    ) -> None:
        if "default" not in templates:
            raise ConfigError(f"model {name!r} ({source}): no default chat template")
        self.name = name
        self.tokenizer = tokenizer
        self.templates = dict(templates)
        self.context_limit = context_limit
        self.source = source
        self.prefixes = self._prefix_cache()
        """A conversation's earlier turns tokenized once (``prefixes.py``); None when the model's template or
        tokenizer does not split safely at messages, and every prompt is encoded whole."""

    def _prefix_cache(self) -> PrefixCache | None:
        specials = [token.content for token in self.tokenizer.get_added_tokens_decoder().values() if token.special]
        sample = [{"role": "user", "content": "x"}]
        try:
            bare, prompted = (self.render(sample, add_generation_prompt=flag) for flag in (False, True))
        except BadRequest:  # a template that refuses a lone user turn: no sample, no cache
            return None
        if not prompted.startswith(bare) or len(prompted) == len(bare):
            return None
        cache = PrefixCache(self.encode, specials, prompted[len(bare) :])

        def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
            return self.render(messages, add_generation_prompt=generation_prompt)

        try:
            return cache if cache.verified(render) else None
        except BadRequest:
            return None

    @classmethod
    def from_directory(cls, name: str, path: str | os.PathLike[str]) -> ChatModel:
        """Read a Hugging Face model directory (see the module docstring).

        Raises:
            ConfigError: no ``tokenizer.json`` or no chat template there, or a file that does not parse.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise ConfigError(f"--model-path {name}={folder}: not a directory")
        config = _json(folder / "tokenizer_config.json")
        tokens = _special_tokens(config)
        jinja = folder / "chat_template.jinja"
        raw = jinja.read_text() if jinja.is_file() else config.get("chat_template")
        if raw is None:
            raise ConfigError(
                f"--model-path {name}={folder}: no chat template (neither chat_template.jinja nor "
                "tokenizer_config.json's chat_template)"
            )
        limit = _limit(_json(folder / "config.json"), config)
        templates = _templates(raw, tokens, str(folder))
        return cls(name, _tokenizer(folder / "tokenizer.json"), templates, limit, str(folder))

    @classmethod
    def from_files(cls, name: str, tokenizer: str | os.PathLike[str], template: str | os.PathLike[str]) -> ChatModel:
        """``--tokenizer FILE --chat-template FILE``; a ``tokenizer_config.json`` beside the tokenizer gives the
        special tokens and the limit.

        Raises:
            ConfigError: a file missing or not parsing.
        """
        tokenizer_path, template_path = Path(tokenizer), Path(template)
        config = _json(tokenizer_path.parent / "tokenizer_config.json")
        try:
            source = template_path.read_text()
        except OSError as exc:
            raise ConfigError(f"--chat-template {template_path}: {exc}") from exc
        tokens = _special_tokens(config)
        templates = {"default": ChatTemplate(source, tokens, name=str(template_path))}
        limit = _limit(_json(tokenizer_path.parent / "config.json"), config)
        return cls(name, _tokenizer(tokenizer_path), templates, limit, f"{tokenizer_path} + {template_path}")

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text (the ``tool_use`` template when there are tools and the model has one).

        Raises:
            BadRequest: the template raised.
        """
        template = self.templates.get("tool_use") if tools else None
        template = template or self.templates["default"]
        return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, extra=extra)

    def encode(self, text: str) -> list[int]:
        """The prompt's token ids, no special tokens added (the template wrote them)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def prompt_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> npt.NDArray[np.uint32]:
        """The token ids of the rendered prompt, as the router hashes them: :meth:`render` then :meth:`encode`,
        reusing a conversation's earlier turns when the model allows it (``prefixes.py``); always what a full
        encode gives.

        Raises:
            BadRequest: the template raised.
        """
        text = self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, extra=extra)
        if self.prefixes is None:
            return np.asarray(self.encode(text), dtype=np.uint32)
        context = [tools, extra]
        return self.prefixes.encode(messages, text, generation_prompt=add_generation_prompt, context=context)

    def check_length(self, prompt_tokens: int, max_tokens: int | None) -> None:
        """Refuse a request that does not fit the context.

        Raises:
            BadRequest: prompt plus ``max_tokens`` (the prompt alone when None) over :attr:`context_limit`.
        """
        limit = self.context_limit
        if limit is None:
            return
        wanted = prompt_tokens + (max_tokens or 0)
        if prompt_tokens >= limit or wanted > limit:
            raise BadRequest(
                f"this model's maximum context length is {limit} tokens; the request wants {wanted} "
                f"({prompt_tokens} in the messages, {max_tokens or 0} in the completion)",
                param="messages",
            )


def _json(path: Path) -> dict[str, Any]:
    """A model file's JSON object; an empty one when the file is absent."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return value


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for key, value in config.items():
        if not key.endswith("_token"):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _templates(raw: object, tokens: Mapping[str, str], source: str) -> dict[str, ChatTemplate]:
    if isinstance(raw, str):
        return {"default": ChatTemplate(raw, tokens, name=source)}
    if isinstance(raw, list):
        named = {}
        for entry in raw:
            if not isinstance(entry, dict):
                continue
            name, text = entry.get("name"), entry.get("template")
            if isinstance(name, str) and isinstance(text, str):
                named[name] = ChatTemplate(text, tokens, name=f"{source} ({name})")
        if named:
            return named
    raise ConfigError(f"{source}: chat_template must be a string or a list of {{name, template}} objects")


def _limit(model_config: Mapping[str, Any], tokenizer_config: Mapping[str, Any]) -> int | None:
    for key in LIMIT_KEYS:
        value = model_config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    value = tokenizer_config.get("model_max_length")
    if isinstance(value, int | float) and 0 < value < NO_LIMIT:
        return int(value)
    return None


def _tokenizer(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (a model directory needs tokenizer.json)")
    from tokenizers import Tokenizer  # a heavy import, only where chat is served

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers package raises its own Exception subclass
        raise ConfigError(f"{path}: cannot load the tokenizer: {exc}") from exc
