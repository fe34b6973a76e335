"""Server-sent events as the OpenAI streaming API uses them: `data: {json}\\n\\n` per chunk, then
`data: [DONE]\\n\\n`. The relay cuts the upstream byte stream into whole events so it can read usage
and drop the usage chunk it asked for on the client's behalf; it never waits for more than one event."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

DONE = b"[DONE]"
# A non-empty text in a choice delta (chat `content`, `reasoning_content`, tool-call `arguments`,
# completions `text`). Inside a JSON string these quotes would be escaped, so the pattern only ever
# matches members: one match per choice delta the replica produced text for.
_CONTENT_DELTA = re.compile(rb'(?<!\\)"(?:content|reasoning_content|arguments|text)"\s*:\s*"(?!")')
# A `"usage": null` member with its separating comma. With include_usage on, upstreams such as
# kvik serve and vLLM put it on every chunk; inside a JSON string the quotes would be escaped, so
# these patterns only ever match the object's own members.
_NULL_USAGE = re.compile(rb'\s*,\s*"usage"\s*:\s*null(?=\s*[,}])|"usage"\s*:\s*null\s*,\s*')


@dataclass(slots=True, frozen=True)
class TokenUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_json(cls, usage: Any) -> TokenUsage | None:
        """Chat and completions name the counts prompt/completion tokens, the Responses API
        input/output tokens."""
        if not isinstance(usage, dict):
            return None
        if "input_tokens" in usage and "prompt_tokens" not in usage:
            return cls(_count(usage.get("input_tokens")), _count(usage.get("output_tokens")))
        return cls(_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")))


class EventSplitter:
    """Feeds on arbitrary byte chunks, returns complete events (each with its blank-line ending)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")  # both line endings are legal SSE
        self._buffer += data
        events: list[bytes] = []
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                return events
            events.append(self._buffer[: end + 2])
            self._buffer = self._buffer[end + 2:]

    def remainder(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest


def drop_null_usage(event: bytes) -> bytes:
    """The event without `"usage": null` members: the relay removes what an upstream added only
    because the gateway, not the client, asked for the usage chunk."""
    if b'"usage"' not in event:
        return event
    return _NULL_USAGE.sub(b"", event)


def event_data(event: bytes) -> bytes | None:
    """The payload of an event's `data:` lines, or None for comments and other fields."""
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


@dataclass(slots=True, frozen=True)
class ChunkInfo:
    usage: TokenUsage | None = None  # present on the final usage chunk when include_usage was asked
    usage_only: bool = False  # a chunk with no choices, only usage: dropped unless the client asked for it
    done: bool = False  # `data: [DONE]`
    # The error object an upstream sent mid-stream: `data: {"error": {...}}` (OpenAI, kvik serve) or
    # `data: {"object": "error", ...}` (older vLLM).
    error: dict[str, Any] | None = None
    content_deltas: int = 0  # choice deltas carrying text
    response_id: str | None = None  # a Responses stream's id, from its `response.*` events


_NOTHING = ChunkInfo()
_DONE_INFO = ChunkInfo(done=True)


def inspect_event(event: bytes) -> ChunkInfo:
    data = event_data(event)
    if data is None:
        return _NOTHING
    if data.strip() == DONE:
        return _DONE_INFO
    deltas = len(_CONTENT_DELTA.findall(data))
    if b'"usage"' not in data and b'"error"' not in data:
        return ChunkInfo(content_deltas=deltas)  # the common case: skip JSON parsing
    try:
        chunk = json.loads(data)
    except ValueError:
        return ChunkInfo(content_deltas=deltas)
    if not isinstance(chunk, dict):
        return ChunkInfo(content_deltas=deltas)
    error = chunk.get("error")
    if error is not None:
        error = error if isinstance(error, dict) else {"message": str(error)}
    elif chunk.get("object") == "error":
        error = chunk
    usage = TokenUsage.from_json(chunk.get("usage"))
    return ChunkInfo(usage, usage is not None and not chunk.get("choices"), False, error, deltas)


# Responses API events that carry generated text, and those that end a stream successfully. A
# `response.failed` event, or an `error` event, ends it with an error.
_RESPONSE_DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta",
                    "response.reasoning_text.delta", "response.refusal.delta")
_RESPONSE_FINISHED = ("response.completed", "response.incomplete")


def inspect_response_event(event: bytes) -> ChunkInfo:
    """`inspect_event` for the Responses API's typed events (`event: response.…` + `data: {…}`).

    There is no `[DONE]`: `response.completed` (or `response.incomplete`, when the output budget ran
    out) ends a stream that succeeded and carries its usage; `response.failed` carries the error in
    `response.error`. Every event is parsed: a stream has one per text delta, each a small object."""
    data = event_data(event)
    if data is None:
        return _NOTHING
    try:
        payload = json.loads(data)
    except ValueError:
        return _NOTHING
    if not isinstance(payload, dict):
        return _NOTHING
    kind = payload.get("type")
    if kind in _RESPONSE_DELTAS:
        return ChunkInfo(content_deltas=1 if payload.get("delta") else 0)
    response = payload.get("response")
    response = response if isinstance(response, dict) else {}
    response_id = response.get("id") if isinstance(response.get("id"), str) else None
    usage = TokenUsage.from_json(response.get("usage"))
    if kind in _RESPONSE_FINISHED:
        return ChunkInfo(usage=usage, done=True, response_id=response_id)
    error = None
    if kind == "response.failed":
        error = response.get("error")
        error = error if isinstance(error, dict) else {"message": "the response failed"}
    elif kind == "error":  # {"type": "error", "code", "message", "param"}: the event's own type is not the error's
        error = {name: value for name, value in payload.items() if name not in ("type", "sequence_number")}
    elif payload.get("error") is not None:  # an error frame in chat's shape (the gateway's own)
        error = payload["error"] if isinstance(payload["error"], dict) else {"message": str(payload["error"])}
    return ChunkInfo(usage=usage, error=error, response_id=response_id)


def error_event(body: dict[str, Any]) -> bytes:
    """An error reported after the stream started (headers already sent): one event and no
    `[DONE]`, which is how OpenAI clients tell a failed stream from a finished one."""
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _count(value: Any) -> int:
    """A token count from an upstream's usage object; anything but a non-negative integer is 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
