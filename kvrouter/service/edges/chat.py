"""``POST /v1/chat/completions`` and ``GET /v1/models``: the front OpenAI's clients point at.

A chat request is routed on the token ids of its rendered prompt, then forwarded **unchanged** to the chosen
engine's ``/v1/chat/completions`` (both hops of a split request), through the proxy's path
(``proxy.py``: booking, prefill completion at the first chunk, freeing on every way out). The engine
renders it again, which keeps tools, response formats and everything else the router does not need to
understand; the router renders only to know the tokens, with the model's own template and tokenizer
(``kvrouter/chat``, one :class:`~kvrouter.chat.ChatModel` per ``--model-path``), so that what it routes on
is what the engine prefills.

What is refused, always before anything is booked, with OpenAI's error shape (``gate.openai_error``):

- a body that is not a chat request: messages that do not check (``chat/messages.py``), ``n`` above 1,
  ``stream`` not a boolean, ``tools`` not a list;
- a model no worker serves, or one served without a tokenizer here (400, naming ``--model-path``);
- a template that raises, and a prompt plus ``max_completion_tokens`` (or ``max_tokens``) over the
  model's context (400);
- while the index starts, 503 with ``Retry-After``, as every route that routes.

``/v1/models`` lists the models workers are registered for, in OpenAI's shape.

``--forward-tokens`` sends the router's token ids to the engine's ``/v1/completions`` instead (the chat-only
fields dropped) and turns the answer back into chat objects (``chat_answer.py``).

``cache_salt`` is routed as ``/select`` routes it: the prompt's blocks hashed with the salt (the reference's
``compute_salt_hash``); ``priority`` (or ``X-Kvrouter-Priority``) is the request's class in the router queue
(``core/queue.py``). A conversation's earlier turns are tokenized once (``ChatModel.prompt_ids``,
``chat/prefixes.py``); ``--otlp-endpoint`` traces it as any proxied request (``tracing.py``).

A ``model`` that names a LoRA adapter a worker registered (``lora_adapters``) is rendered and tokenized with
its base model's files (an adapter changes weights, not the tokenizer), routed in the base model's partition
among the workers serving the adapter, on blocks hashed with the adapter's name as the engine hashes them,
and forwarded with ``model`` unchanged, so that the engine applies the adapter. ``/v1/models`` lists adapters
with their base model as ``parent``, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import orjson
from aiohttp import web

from ...chat import ChatModel, checked_messages
from ...errors import BadRequest
from ..core.config import ServiceConfig
from ..core.requests import parse_body
from ..core.state import Core
from .gate import CHAT_ROUTE, MODELS_ROUTE
from .proxy import COMPLETIONS_ROUTE, CompletionsProxy, cache_salt, priority

__all__ = ["ChatRoutes", "load_chat_models"]

OWNED_BY: Final = "kvrouter"


def load_chat_models(config: ServiceConfig) -> dict[str, ChatModel]:
    """Every model ``config`` serves chat for, read from disk now (a bad directory stops the start).

    Raises:
        ConfigError: a model's files are missing or do not parse.
    """
    models = {}
    for name, path in config.chat_models():
        if path is None:
            assert config.tokenizer is not None  # a chat template needs a tokenizer: checked by the config
            assert config.chat_template is not None
            models[name] = ChatModel.from_files(name, config.tokenizer, config.chat_template)
        else:
            models[name] = ChatModel.from_directory(name, path)
    return models


class ChatRoutes:
    """The chat and models routes of one service over its proxy: :meth:`add_to` adds them to the app.

    Args:
        models: model name -> what renders and tokenizes its chats.
    """

    def __init__(self, core: Core, proxy: CompletionsProxy, models: Mapping[str, ChatModel]) -> None:
        self.core = core
        self.proxy = proxy
        self.models = dict(models)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post(CHAT_ROUTE, self.handle)
        app.router.add_get(MODELS_ROUTE, self.list_models)

    def _served(self) -> set[str]:
        """The models some worker is registered for."""
        return {model for model, _group in self.core.registry.partitions}

    async def list_models(self, _request: web.Request) -> web.Response:
        models: list[dict[str, Any]] = [
            {"id": name, "object": "model", "owned_by": OWNED_BY} for name in sorted(self._served())
        ]
        for adapter, base in sorted(self.core.registry.adapter_bases.items()):
            models.append({"id": adapter, "object": "model", "owned_by": OWNED_BY, "parent": base})
        return web.json_response({"object": "list", "data": models})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.core.lifecycle.require_index()
        body = parse_body(raw)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("model: expected a non-empty string", param="model")
        _check_request(body)
        base, adapter = self.core.registry.served_as(model)
        chat = self._model(base)
        messages = checked_messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools: expected a list of tool objects", param="tools")
        extra = body.get("chat_template_kwargs")
        if extra is not None and not isinstance(extra, dict):
            raise BadRequest("chat_template_kwargs: expected an object", param="chat_template_kwargs")
        generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(generation_prompt, bool):
            raise BadRequest("add_generation_prompt: expected true or false", param="add_generation_prompt")
        tokens = chat.prompt_ids(messages, tools=tools, add_generation_prompt=generation_prompt, extra=extra)
        if not len(tokens):
            raise BadRequest("messages: the rendered prompt is empty", param="messages")
        chat.check_length(len(tokens), _max_tokens(body))
        salt, klass = cache_salt(body), priority(request, body)
        if self.core.config.forward_tokens:
            forward = orjson.dumps(_as_completion(body, tokens), option=orjson.OPT_SERIALIZE_NUMPY)
            route = COMPLETIONS_ROUTE
            return await self.proxy.forward(
                request, base, tokens, forward, route, salt, klass, lora=adapter, as_chat=True
            )
        return await self.proxy.forward(request, base, tokens, raw, CHAT_ROUTE, salt, klass, lora=adapter)

    def _model(self, name: str) -> ChatModel:
        """The chat model of ``name``, served by some worker.

        Raises:
            BadRequest: no worker serves it, or no tokenizer is loaded for it here.
        """
        served = self._served()
        if name not in served:
            known = ", ".join(sorted(served | self.core.registry.adapter_bases.keys())) or "none yet"
            raise BadRequest(f"model: no worker serves {name!r} (models served: {known})", param="model")
        chat = self.models.get(name)
        if chat is None:
            raise BadRequest(
                f"model: {name!r} has no tokenizer and chat template here; start kvrouter up with "
                f"--model-path {name}=DIR (a local model directory) to serve its chats",
                param="model",
            )
        return chat


def _check_request(body: Mapping[str, Any]) -> None:
    """The fields the router must understand to route a chat the way the engine will serve it."""
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise BadRequest(f"n: expected an integer >= 1, got {n!r}", param="n")
    if n not in (None, 1):
        raise BadRequest(f"n: {n} choices per request are not routed; send n=1 (or {n} requests)", param="n")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"stream: expected true or false, got {stream!r}", param="stream")


CHAT_ONLY: Final = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "functions",
        "function_call",
    }
)
"""Fields of a chat request that a completions request does not take (``--forward-tokens`` drops them: the
prompt's tokens already hold what rendering made of them; chat's logprobs are a flag, completions' a count)."""


def _as_completion(body: Mapping[str, Any], ids: npt.NDArray[np.uint32]) -> dict[str, Any]:
    """The ``/v1/completions`` body of a chat (``--forward-tokens``): its tokens as the prompt, the rest of
    its fields as they came."""
    out = {key: value for key, value in body.items() if key not in CHAT_ONLY}
    out["prompt"] = ids
    limit = _max_tokens(body)
    if limit is not None:
        out["max_tokens"] = limit
    return out


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"{name}: expected an integer >= 1, got {value!r}", param=name)
        return value
    return None
