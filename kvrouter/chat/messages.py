"""The messages of a chat request, checked before any template sees them.

A template that meets a message it does not expect fails in its own words, or worse, renders a prompt the
engine would refuse. So the router checks what every chat template assumes, and answers 400 naming the
field: the role is one of :data:`ROLES`; ``content`` is a string or a list of text parts, and a ``user``,
``system`` or ``developer`` message has one. A list of text parts reaches the template as one string, the
parts joined by newlines, as vLLM passes it to templates that take string content. Other fields
(``name``, ``tool_calls``, ``tool_call_id``...) go to the template untouched.

Rejected: passing parts lists through (most templates index ``message['content']`` as a string) and
accepting image or audio parts (the router cannot hash what the engine's encoder makes of them).
"""

from __future__ import annotations

from typing import Any, Final

from ..errors import BadRequest

__all__ = ["CONTENT_REQUIRED", "ROLES", "checked_messages"]

ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool"})
"""The roles OpenAI's chat API defines."""

CONTENT_REQUIRED: Final = frozenset({"system", "developer", "user"})
"""Roles whose messages must say something (an assistant turn may be tool calls only)."""


def checked_messages(value: object) -> list[dict[str, Any]]:
    """The messages as a template takes them: each a new dict, text parts joined into one string.

    Raises:
        BadRequest: not a non-empty list of objects, an unknown role, or content of another shape.
    """
    if not isinstance(value, list) or not value:
        raise BadRequest("messages: expected a non-empty list of message objects", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where}: expected an object, got {type(message).__name__}", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(
                f"{where}.role: expected one of {', '.join(sorted(ROLES))}, got {role!r}", param=f"{where}.role"
            )
        checked = dict(message)
        checked["content"] = _content(message.get("content"), f"{where}.content", required=role in CONTENT_REQUIRED)
        out.append(checked)
    return out


def _content(value: object, where: str, *, required: bool) -> str | None:
    if value is None:
        if required:
            raise BadRequest(f"{where}: required for this role", param=where)
        return None
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise BadRequest(f"{where}: expected a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(
                f'{where}[{j}]: expected a text part ({{"type": "text", "text": ...}}), got {kind!r}',
                param=f"{where}[{j}]",
            )
        texts.append(part["text"])
    return "\n".join(texts)
