"""``ChatTemplate``: a model's Jinja2 chat template, rendered as the engines render it.

Rules, each what Hugging Face's ``apply_chat_template`` does (vLLM and SGLang render through it, so a
router that renders otherwise routes on another prompt than the engine prefills):

- **A sandbox.** ``jinja2.sandbox.ImmutableSandboxedEnvironment``: a template comes with a model, from
  whoever published it; it may not reach attributes that escape the sandbox or change its inputs.
- **Whitespace.** ``trim_blocks`` and ``lstrip_blocks`` on, and the ``loopcontrols`` extension
  (``{% break %}``), which templates in the wild use.
- **Variables.** ``messages``, ``add_generation_prompt``, ``tools`` (None without), the tokenizer's special
  tokens by name (``bos_token``, ``eos_token``...), and whatever extra keyword a request passes
  (``chat_template_kwargs``).
- **Helpers.** ``raise_exception(message)`` (a template refusing its input) and ``strftime_now(format)``
  (Llama 3's date line); the ``tojson`` filter with ``ensure_ascii`` off, as the engines have it.

Any error a template raises, at compile or render time, is a :class:`~kvrouter.errors.BadRequest` naming
the template: the request (or the model's files) is at fault, never the router.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from ..errors import BadRequest, ConfigError

__all__ = ["ChatTemplate"]


class ChatTemplate:
    """One compiled chat template.

    Args:
        source: the Jinja2 text.
        special_tokens: name -> token text (``bos_token``...), passed to the template as variables.
        name: where the template came from, for error messages.

    Raises:
        ConfigError: the template does not compile.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str], *, name: str) -> None:
        import jinja2  # only where chat is served: a router without it never loads jinja2
        import jinja2.ext
        import jinja2.sandbox

        self.name = name
        self.special_tokens = dict(special_tokens)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self._errors: tuple[type[BaseException], ...] = (jinja2.TemplateError,)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"chat template {name}: does not compile: {exc}") from exc

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of ``messages``.

        Raises:
            BadRequest: the template raised (``raise_exception``, or an error of its own).
        """
        variables = {
            **self.special_tokens,
            **(extra or {}),
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**variables)
        except self._errors as exc:
            raise BadRequest(f"chat template {self.name}: {exc}", param="messages") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise BadRequest(f"chat template {self.name}: {type(exc).__name__}: {exc}", param="messages") from exc


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> NoReturn:
    import jinja2

    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)
