"""Relaying a streaming answer to the client chunk by chunk.

Each upstream read is cut into whole SSE events and sent on at once, never held back for the next
read: a token the replica produced is on its way to the client within one event-loop turn. On the
way the relay reads the usage chunk, notes `[DONE]`, and keeps a copy for the cache when asked.
When the gateway (not the client) asked for the usage chunk, the relay drops it, and the
`"usage": null` members upstreams then add to every chunk, so the client gets the stream it asked for.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx
from fastapi.responses import StreamingResponse

from kvik.core.errors import UpstreamError
from kvik.gateway.proxy import UpstreamAnswer
from kvik.gateway.replica import Outcome
from kvik.gateway.sse import EventSplitter, TokenUsage, drop_null_usage, error_event, inspect_event
from kvik.protocol.errors import error_from_exception


class StreamRelay:
    def __init__(self, answer: UpstreamAnswer, *, keep_usage_chunk: bool, record: bool,
                 on_first_chunk: Callable[[], None]) -> None:
        self._answer = answer
        self._keep_usage_chunk = keep_usage_chunk  # False when the gateway, not the client, asked for it
        self._on_first_chunk = on_first_chunk
        self._splitter = EventSplitter()
        self.recorded: list[bytes] | None = [] if record else None
        self.usage: TokenUsage | None = None
        self.saw_done = False
        # NEUTRAL until the stream ends: stays so when the client leaves first.
        self.outcome = Outcome.NEUTRAL

    @property
    def status(self) -> int:
        """For usage rows and metrics: 200, 502 when the replica failed mid-stream, 499 when the
        client went away first (the nginx convention)."""
        return {Outcome.SUCCESS: 200, Outcome.FAILURE: 502, Outcome.NEUTRAL: 499}[self.outcome]

    async def events(self) -> AsyncIterator[bytes]:
        try:
            chunk = self._forward(self._answer.first_chunk)
            self._on_first_chunk()
            if chunk:
                yield chunk
            assert self._answer.rest is not None
            async for raw in self._answer.rest:
                chunk = self._forward(raw)
                if chunk:
                    yield chunk
            rest = self._splitter.remainder()
            if rest:
                yield rest
            self.outcome = Outcome.SUCCESS
        except httpx.TransportError:
            # Bytes already went out, so no failover: say so in-stream, in the OpenAI error shape.
            self.outcome = Outcome.FAILURE
            _, body, _ = error_from_exception(UpstreamError("The replica failed in the middle of the stream."))
            yield error_event(body)

    def _forward(self, raw: bytes) -> bytes:
        """The events of one upstream read that go to the client."""
        out = []
        for event in self._splitter.feed(raw):
            if not self._keep_usage_chunk:
                # The client did not ask for usage: no `"usage": null` on its chunks either (and
                # the common chunk then skips JSON parsing in `inspect_event`).
                event = drop_null_usage(event)
            info = inspect_event(event)
            if info.usage is not None:
                self.usage = info.usage
            self.saw_done = self.saw_done or info.done
            if info.usage_only and not self._keep_usage_chunk:
                continue
            out.append(event)
        chunk = b"".join(out)
        if chunk and self.recorded is not None:
            self.recorded.append(chunk)
        return chunk


class RelayResponse(StreamingResponse):
    """A streaming response that always runs `on_close` once, however the stream ends: finished,
    failed, or the client gone (even before the first chunk, when the body iterator never ran)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # cleanup must run even while being cancelled
                await self._content.aclose()  # type: ignore[attr-defined]
                await self._on_close()


async def replay(chunks: tuple[bytes, ...]) -> AsyncIterator[bytes]:
    """A cached stream, sent again event group by event group."""
    for chunk in chunks:
        yield chunk
