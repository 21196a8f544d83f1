"""Checking the input of task ``chat``: an OpenAI-style list of messages, shared by the engines that run it."""

from __future__ import annotations

from typing import Any


def require_messages(messages: Any, *, text_content: bool = False) -> list[dict[str, Any]]:
    """``messages`` itself, once it is a non-empty list of objects with a string ``role``.

    ``text_content`` also requires each ``content`` to be a string, for an engine that renders the chat
    template itself and so takes neither content parts (images, audio) nor a missing content.

    Raises ValueError naming the problem. The error names no position: a failing micro-batch is run again
    record by record, and the error a record ends up with comes from a batch of one.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of messages, not {type(messages).__name__}")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError("each message must be an object with a string 'role'")
        content = message.get("content")
        if text_content and not isinstance(content, str):
            raise ValueError(f"each message's 'content' must be a string, not {type(content).__name__}")
    return messages
