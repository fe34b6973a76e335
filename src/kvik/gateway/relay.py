"""Relaying a streaming answer to the client chunk by chunk.

Each upstream read is cut into whole SSE events and sent on at once, never held back for the next
read: a token the replica produced is on its way to the client within one event-loop turn. On the
way the relay reads the usage chunk, counts the content deltas it relayed (what a client that leaves
early is charged for), notes `[DONE]`, and keeps a copy for the cache when asked. When the gateway
(not the client) asked for the usage chunk, the relay drops it, and the `"usage": null` members
upstreams then add to every chunk, so the client gets the stream it asked for.

A Responses API stream is relayed the same way, read by `inspect_response_event`: its typed events
pass untouched, and its `response.completed` (or `response.incomplete`) event stands for `[DONE]`.

Only a stream that ends with `data: [DONE]` and carries no error succeeded. A replica's error event
is relayed and ends the stream for the client: nothing after it (no usage chunk, no `[DONE]`) goes
out, so an OpenAI client raises instead of taking a truncated answer for a whole one. A stream that
breaks, stalls past `timeouts.read_s`, or ends without `[DONE]` gets the gateway's own error event
and no `[DONE]` either.
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
from kvik.gateway.sse import ChunkInfo, EventSplitter, TokenUsage, drop_null_usage, error_event, inspect_event
from kvik.protocol.errors import error_from_exception

CLIENT_LEFT = 499  # the nginx convention, in usage rows and metrics
UPSTREAM_FAILED = 502


class StreamRelay:
    def __init__(self, answer: UpstreamAnswer, *, keep_usage_chunk: bool, record: bool,
                 on_first_chunk: Callable[[], None], inspect: Callable[[bytes], ChunkInfo] = inspect_event,
                 on_done: Callable[[StreamRelay], Awaitable[None]] | None = None) -> None:
        self._answer = answer
        self._keep_usage_chunk = keep_usage_chunk  # False when the gateway, not the client, asked for it
        self._on_first_chunk = on_first_chunk
        self._inspect = inspect
        # Awaited once, when the end-of-stream event arrives and before it is relayed: what the
        # client may act on as soon as it reads that event (a stored response's route) is in place.
        self._on_done = on_done
        self.response_id: str | None = None  # a Responses stream's id
        self._splitter = EventSplitter()
        self.recorded: list[bytes] | None = [] if record else None
        self.usage: TokenUsage | None = None
        self.saw_done = False
        self.content_deltas = 0  # choice deltas with text relayed to the client
        self.error: dict[str, Any] | None = None  # the replica's error event, if it sent one
        # NEUTRAL until the stream ends: stays so when the client leaves first.
        self.outcome = Outcome.NEUTRAL
        self.status = CLIENT_LEFT  # for usage rows and metrics

    async def events(self) -> AsyncIterator[bytes]:
        try:
            chunk = self._forward(self._answer.first_chunk)
            self._on_first_chunk()
            await self._when_done()
            if chunk:
                yield chunk
            assert self._answer.rest is not None
            async for raw in self._answer.rest:
                chunk = self._forward(raw)
                await self._when_done()
                if chunk:
                    yield chunk
            if self.error is not None:
                self._end_with_replica_error()
            elif not self.saw_done:
                yield self._fail("The replica ended the stream before finishing it.")
            else:
                self.outcome, self.status = Outcome.SUCCESS, 200
        except httpx.TransportError as exc:
            # Bytes already went out, so no failover: say so in-stream, in the OpenAI error shape.
            if self.error is not None:
                self._end_with_replica_error()
            else:
                stalled = isinstance(exc, httpx.ReadTimeout)
                yield self._fail("The replica stopped sending in the middle of the stream." if stalled
                                 else "The replica failed in the middle of the stream.")

    async def _when_done(self) -> None:
        if self.saw_done and self.error is None and self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            await on_done(self)

    def _fail(self, message: str) -> bytes:
        self.outcome, self.status = Outcome.FAILURE, UPSTREAM_FAILED
        _, body, _ = error_from_exception(UpstreamError(message))
        return error_event(body)

    def _end_with_replica_error(self) -> None:
        assert self.error is not None
        self.status, client_caused = classify_error(self.error)
        self.outcome = Outcome.NEUTRAL if client_caused else Outcome.FAILURE

    def _forward(self, raw: bytes) -> bytes:
        """The events of one upstream read that go to the client."""
        out = []
        for event in self._splitter.feed(raw):
            if not self._keep_usage_chunk:
                # The client did not ask for usage: no `"usage": null` on its chunks either (and
                # the common chunk then skips JSON parsing in `inspect_event`).
                event = drop_null_usage(event)
            info = self._inspect(event)
            if info.usage is not None:
                self.usage = info.usage
            self.response_id = info.response_id or self.response_id
            if self.error is not None:
                continue  # nothing after an error event reaches the client
            if info.error is not None:
                self.error = info.error
                out.append(event)
                continue
            self.saw_done = self.saw_done or info.done
            if info.usage_only and not self._keep_usage_chunk:
                continue
            self.content_deltas += info.content_deltas
            out.append(event)
        chunk = b"".join(out)
        if chunk and self.recorded is not None:
            self.recorded.append(chunk)
        return chunk


def classify_error(error: dict[str, Any]) -> tuple[int, bool]:
    """(status for usage rows and metrics, caused by the request?) of an error a replica streamed.
    vLLM puts the HTTP status in `code`; OpenAI and kvik serve name the kind in `type`."""
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code, code < 500
    kind = error.get("type") or code  # a Responses API error names its kind in `code`
    if kind in ("invalid_request_error", "BadRequestError", "NotFoundError"):
        return 400, True
    if kind in ("rate_limit_error", "RateLimitError"):
        return 429, True
    return UPSTREAM_FAILED, False


class RelayResponse(StreamingResponse):
    """A streaming response that always runs `on_close` once, however the stream ends: finished,
    failed, or the client gone (even before the first chunk, when the body iterator never ran)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        closed = False

        async def close_once() -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            with anyio.CancelScope(shield=True):  # cleanup must run even while being cancelled
                await self._content.aclose()  # type: ignore[attr-defined]
                await self._on_close()

        async def send_after_close(message: dict[str, Any]) -> None:
            # The response's last message goes out after on_close (the tokens settled): a client
            # that sends its next request the moment this one ends must not still find this one's
            # whole reservation held (it did, under load: 429s for a key well inside its limit).
            if message.get("type") == "http.response.body" and not message.get("more_body", False):
                await close_once()
            await send(message)

        try:
            await super().__call__(scope, receive, send_after_close)
        finally:
            await close_once()


async def replay(chunks: tuple[bytes, ...]) -> AsyncIterator[bytes]:
    """A cached stream, sent again event group by event group."""
    for chunk in chunks:
        yield chunk
