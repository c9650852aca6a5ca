"""``ChatAnswer``: an engine's ``/v1/completions`` answer turned into the ``/v1/chat/completions`` one.

With ``--forward-tokens`` the router sends a chat's rendered token ids to the engine's ``/v1/completions``
(the engine then prefills exactly the tokens the router routed on) and the client, who asked for a chat,
gets chat objects back:

- a ``text_completion`` becomes a ``chat.completion``: each choice's ``text`` the assistant message's
  ``content``; ``id``, ``created``, ``model``, ``usage`` and any other member kept;
- each streamed ``text_completion`` event becomes a ``chat.completion.chunk``: the text as the ``delta``'s
  ``content``, the first delta of each choice with ``"role": "assistant"``, ``finish_reason`` and
  ``usage`` kept;
- an error (its status, or an ``{"error": ...}`` event) and ``data: [DONE]`` pass unchanged, and so does a
  body that is not JSON (the client sees what the engine said).

Events are cut at their blank line, so an event split across reads is converted whole.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

__all__ = ["ChatAnswer"]

EVENT_END: Final = b"\n\n"
DATA: Final = b"data: "


class ChatAnswer:
    """One answer's conversion (a stream's state: which choices have had their first delta)."""

    def __init__(self) -> None:
        self._started: set[int] = set()
        self._pending = b""

    def whole(self, data: bytes) -> bytes:
        """A non-streamed answer."""
        answer = _json(data)
        if answer is None or "choices" not in answer:
            return data
        answer["object"] = "chat.completion"
        answer["choices"] = [
            {
                **{k: v for k, v in choice.items() if k != "text"},
                "message": {"role": "assistant", "content": choice.get("text", "")},
            }
            for choice in answer["choices"]
        ]
        return orjson.dumps(answer)

    def stream(self, chunk: bytes) -> bytes:
        """The complete events of ``chunk`` (and of what came before it) converted; the rest is kept."""
        data = self._pending + chunk
        cut = data.rfind(EVENT_END)
        if cut < 0:
            self._pending = data
            return b""
        self._pending = data[cut + len(EVENT_END) :]
        events = data[: cut + len(EVENT_END)].split(EVENT_END)
        return EVENT_END.join(self._event(event) for event in events)

    def end(self) -> bytes:
        """What is left when the stream ends (an unfinished event, passed as it came)."""
        rest, self._pending = self._pending, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(DATA):
            return event
        answer = _json(event[len(DATA) :])
        if answer is None or "choices" not in answer:
            return event  # [DONE], an error event, or something else: as it came
        answer["object"] = "chat.completion.chunk"
        choices = []
        for choice in answer["choices"]:
            index = choice.get("index", 0)
            delta: dict[str, Any] = {"content": choice.get("text", "")}
            if index not in self._started:
                self._started.add(index)
                delta = {"role": "assistant", **delta}
            choices.append({**{k: v for k, v in choice.items() if k != "text"}, "delta": delta})
        answer["choices"] = choices
        return DATA + orjson.dumps(answer)


def _json(data: bytes) -> dict[str, Any] | None:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
