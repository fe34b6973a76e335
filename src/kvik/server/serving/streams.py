"""Streaming plumbing shared by the endpoints: merging engine streams, collecting a choice for a
non-streaming response, the SSE response that always releases its admission, failures in-band, and
client disconnects."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvik.core.errors import KvikError
from kvik.core.outputs import CompletionOutput, Logprob
from kvik.protocol.errors import error_body
from kvik.protocol.sse import sse_frame
from kvik.server.serving.tracking import Admission

T = TypeVar("T")


@dataclass(slots=True)
class ChoiceAccumulator:
    """Collects a choice's deltas for a non-streaming response."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive, tagged with their position."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()  # abort now, not when the generator is collected
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))
            return
        await queue.put((index, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        # Let each pump see its cancellation, so every engine stream runs its abort/release code.
        await asyncio.gather(*tasks, return_exceptions=True)


def failure_frame(exc: BaseException, admission: Admission) -> bytes:
    """The error event that ends a stream that failed after its first byte. The stream then closes
    WITHOUT `data: [DONE]`, so no client (or gateway) can take it for a complete answer."""
    if isinstance(exc, KvikError):
        status, body = exc.http_status, error_body(exc.message, exc.error_type, exc.param, exc.code)
    else:
        status, body = 500, error_body(f"generation failed: {type(exc).__name__}", "server_error")
    admission.fail(status, body["error"]["message"])
    return sse_frame(body)


class SSEResponse(StreamingResponse):
    """An event stream that runs `on_close` when the response ends in any way (finished, client
    gone, server shutting down), even if the body generator never started: admission slots are
    released here, not in the generator."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Any) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""

    http_status = 499  # nginx's "client closed request", for the request log


async def unless_disconnected(request: Request | None, work: Awaitable[T]) -> T:
    """Run `work`, but cancel it (aborting its engine requests) if the client disconnects. Without
    a client connection (a batch line) it simply runs `work`."""
    if request is None:
        return await work
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()
