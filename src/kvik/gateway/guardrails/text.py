"""The user-supplied text of a request, read and rewritten in one place for every guardrail."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def request_texts(body: dict[str, Any]) -> list[str]:
    """Every text a guardrail should see: chat message contents (strings and text parts) and
    completions prompts (a string or a list of strings; token-id prompts have no text)."""
    texts: list[str] = []

    def collect(text: str) -> str:
        texts.append(text)
        return text

    map_request_texts(body, collect)
    return texts


def map_request_texts(body: dict[str, Any], transform: Callable[[str], str]) -> dict[str, Any]:
    """A copy of `body` with `transform` applied to every text `request_texts` would return; parts it
    does not know (images, tool calls) are left alone."""
    out = dict(body)
    messages = body.get("messages")
    if isinstance(messages, list):
        out["messages"] = [_map_message(message, transform) for message in messages]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        out["prompt"] = transform(prompt)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        out["prompt"] = [transform(p) for p in prompt]
    return out


def _map_message(message: Any, transform: Callable[[str], str]) -> Any:
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": transform(content)}
    if isinstance(content, list):
        parts = [
            {**part, "text": transform(part["text"])}
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            else part
            for part in content
        ]
        return {**message, "content": parts}
    return message
