"""Chat: messages checked, a model's chat template rendered and its tokenizer applied, as the engines do.

Knows no transport: ``service/edges/chat.py`` serves ``/v1/chat/completions`` over it, and the mock
engines render with it too, so the router and its demo engines always agree on a prompt's tokens.
"""

from __future__ import annotations

from .messages import ROLES, checked_messages
from .model import DEMO_MODEL, ChatModel
from .template import ChatTemplate

__all__ = ["DEMO_MODEL", "ROLES", "ChatModel", "ChatTemplate", "checked_messages"]
