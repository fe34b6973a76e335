"""Server-sent events as the OpenAI streaming API uses them: `data: {json}\\n\\n` per chunk, then
`data: [DONE]\\n\\n`. The relay cuts the upstream byte stream into whole events so it can read usage
and drop the usage chunk it asked for on the client's behalf; it never waits for more than one event."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

DONE = b"[DONE]"
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
        if not isinstance(usage, dict):
            return None
        return cls(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))


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
    usage: TokenUsage | None  # present on the final usage chunk when include_usage was asked
    usage_only: bool  # a chunk with no choices, only usage: dropped unless the client asked for it
    done: bool  # `data: [DONE]`
    error: bool  # an error object sent mid-stream by the upstream


def inspect_event(event: bytes) -> ChunkInfo:
    data = event_data(event)
    if data is None:
        return ChunkInfo(None, False, False, False)
    if data.strip() == DONE:
        return ChunkInfo(None, False, True, False)
    if b'"usage"' not in data and b'"error"' not in data:
        return ChunkInfo(None, False, False, False)  # the common case: skip JSON parsing
    try:
        chunk = json.loads(data)
    except ValueError:
        return ChunkInfo(None, False, False, False)
    if not isinstance(chunk, dict):
        return ChunkInfo(None, False, False, False)
    usage = TokenUsage.from_json(chunk.get("usage"))
    return ChunkInfo(usage, usage is not None and not chunk.get("choices"), False, "error" in chunk)


def error_event(body: dict[str, Any]) -> bytes:
    """An error reported after the stream started (headers already sent): one event, then [DONE]."""
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"
