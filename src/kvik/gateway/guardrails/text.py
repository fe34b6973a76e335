"""The user-supplied text of a request, read and rewritten in one place for every guardrail.

The texts are, in order: chat message contents (strings and `text` parts), completions prompts (a
string or a list of strings; token-id prompts have no text), embeddings inputs (the same shapes),
and every string value inside `chat_template_kwargs` (a chat template may render any of them into
the prompt, so they are text the model sees, and a way around redaction if left out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def request_texts(body: dict[str, Any]) -> list[str]:
    """Every text a guardrail should see, in a fixed order (`map_request_texts` visits the same)."""
    texts: list[str] = []

    def collect(text: str) -> str:
        texts.append(text)
        return text

    map_request_texts(body, collect)
    return texts


def replace_request_texts(body: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    """A copy of `body` with the texts `request_texts` returned replaced, in order, by `texts`."""
    replacements = iter(texts)
    return map_request_texts(body, lambda _: next(replacements))


def map_request_texts(body: dict[str, Any], transform: Callable[[str], str]) -> dict[str, Any]:
    """A copy of `body` with `transform` applied to every text `request_texts` would return; parts it
    does not know (images, tool calls) are left alone."""
    out = dict(body)
    messages = body.get("messages")
    if isinstance(messages, list):
        out["messages"] = [_map_message(message, transform) for message in messages]
    for name in ("prompt", "input"):
        value = body.get(name)
        if isinstance(value, str):
            out[name] = transform(value)
        elif isinstance(value, list) and all(isinstance(p, str) for p in value):
            out[name] = [transform(p) for p in value]
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict):
        out["chat_template_kwargs"] = _map_values(kwargs, transform)
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


def _map_values(node: Any, transform: Callable[[str], str]) -> Any:
    """Every string value of a JSON tree (not the keys). Depth is bounded by the body parser."""
    if isinstance(node, str):
        return transform(node)
    if isinstance(node, dict):
        return {key: _map_values(value, transform) for key, value in node.items()}
    if isinstance(node, list):
        return [_map_values(item, transform) for item in node]
    return node
