"""The user-supplied text of a request, read and rewritten in one place for every guardrail.

The texts are, in order: chat message contents (strings and `text` parts), completions prompts (a
string or a list of strings; token-id prompts have no text), embeddings inputs (the same shapes),
the Responses API's `instructions` and `input` (a string, or items: message contents as strings or
`input_text`/`output_text` parts, and `function_call_output` outputs), and every string value inside
`chat_template_kwargs` (a chat template may render any of them into the prompt, so they are text the
model sees, and a way around redaction if left out).
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
    instructions = body.get("instructions")  # the Responses API's system message
    if isinstance(instructions, str):
        out["instructions"] = transform(instructions)
    for name in ("prompt", "input"):
        value = body.get(name)
        if isinstance(value, str):
            out[name] = transform(value)
        elif isinstance(value, list) and all(isinstance(p, str) for p in value):
            out[name] = [transform(p) for p in value]
        elif name == "input" and isinstance(value, list):  # Responses API input items
            out[name] = [_map_item(item, transform) for item in value]
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict):
        out["chat_template_kwargs"] = _map_values(kwargs, transform)
    return out


# Content parts whose `text` the model reads: chat's `text`, the Responses API's input and output text.
# A tuple, not a set: a client's `type` may be any JSON value, a list included (unhashable).
_TEXT_PARTS = ("text", "input_text", "output_text")


def _map_message(message: Any, transform: Callable[[str], str]) -> Any:
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": transform(content)}
    if isinstance(content, list):
        parts = [
            {**part, "text": transform(part["text"])}
            if isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str)
            else part
            for part in content
        ]
        return {**message, "content": parts}
    return message


def _map_item(item: Any, transform: Callable[[str], str]) -> Any:
    """A Responses API input item: a message (the default type) or a tool's output; a model's own
    `function_call` is left alone, as chat's tool calls are."""
    if not isinstance(item, dict):
        return item
    kind = item.get("type", "message")
    if kind == "message":
        return _map_message(item, transform)
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, str):
            return {**item, "output": transform(output)}
        if isinstance(output, list):
            return {**item, "output": _map_message({"content": output}, transform)["content"]}
    return item


def _map_values(node: Any, transform: Callable[[str], str]) -> Any:
    """Every string value of a JSON tree (not the keys). Depth is bounded by the body parser."""
    if isinstance(node, str):
        return transform(node)
    if isinstance(node, dict):
        return {key: _map_values(value, transform) for key, value in node.items()}
    if isinstance(node, list):
        return [_map_values(item, transform) for item in node]
    return node
