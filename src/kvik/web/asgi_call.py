"""Run one HTTP request through an ASGI app inside this process, streaming the response out.

The WebSocket endpoint sends every request it multiplexes through the app's own HTTP route this
way, so authentication, limits, validation, usage accounting and metrics are exactly those of HTTP,
with no second code path to keep in step. httpx's ASGITransport is not usable here: it collects
the whole response before returning, and a token stream must flow as it is produced.

Flow control: body chunks go into a bounded queue; when the reader falls behind, the app's `send`
waits, so a slow WebSocket client slows its own generation instead of growing a buffer here.
Cancelling is a client disconnect: `receive` returns `http.disconnect`, which the app's streaming
responses watch for (ASGI spec 2.3), and their clean-up (engine abort, upstream close) runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Scope

# Chunks buffered between the app and the reader: enough to absorb a burst, small enough that
# a stalled reader holds at most this many SSE events in memory.
QUEUE_CHUNKS = 64
# After a cancel the app gets this long to wind down before its task is cancelled outright.
CANCEL_GRACE_S = 5.0


@dataclass(slots=True)
class ResponseStart:
    status: int
    headers: dict[str, str]  # lower-cased names; repeated headers keep the last value


@dataclass(slots=True)
class _End:
    error: BaseException | None = None


class InProcessCall:
    """One request: `start()` it, read `response()`, then iterate `chunks()`; `cancel()` any time."""

    def __init__(self, app: ASGIApp, scope: Scope, body: bytes, *, queue_chunks: int = QUEUE_CHUNKS) -> None:
        self._app = app
        self._scope = scope
        self._body = body
        self._queue: asyncio.Queue[ResponseStart | bytes | _End] = asyncio.Queue(maxsize=queue_chunks)
        self._disconnected = asyncio.Event()
        self._body_sent = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kvik-ws-call {self._scope['path']}")

    async def response(self) -> ResponseStart:
        """The status and headers (waits for the app to start its answer)."""
        item = await self._queue.get()
        if isinstance(item, _End):
            raise RuntimeError("the app ended without a response") from item.error
        assert isinstance(item, ResponseStart)
        return item

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as the app sends it; ends when the app finishes."""
        while True:
            item = await self._queue.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            assert isinstance(item, bytes)
            if item:
                yield item

    async def cancel(self) -> None:
        """Tell the app its client left, give it time to clean up, then make sure it has stopped."""
        self._disconnected.set()
        task = self._task
        if task is None or task.done():
            return
        # Unblock a `send` waiting for queue space: nobody reads the rest.
        while not self._queue.empty():
            self._queue.get_nowait()
        done, _ = await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self) -> None:
        error: BaseException | None = None
        try:
            await self._app(self._scope, self._receive, self._send)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which reports it
            error = exc
        finally:
            if not self._disconnected.is_set():
                await self._put(_End(error))

    async def _receive(self) -> Message:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._disconnected.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        if self._disconnected.is_set():
            return  # ASGI 2.3: sending after a disconnect is a no-op
        if message["type"] == "http.response.start":
            headers = {name.decode("latin-1").lower(): value.decode("latin-1")
                       for name, value in message.get("headers", [])}
            await self._put(ResponseStart(int(message["status"]), headers))
        elif message["type"] == "http.response.body":
            await self._put(bytes(message.get("body", b"")))

    async def _put(self, item: ResponseStart | bytes | _End) -> None:
        """Queue an item, or drop it once the reader has cancelled (nobody will read it)."""
        if self._disconnected.is_set():
            return
        put = asyncio.ensure_future(self._queue.put(item))
        gone = asyncio.ensure_future(self._disconnected.wait())
        try:
            await asyncio.wait({put, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (put, gone):
                if not waiter.done():
                    waiter.cancel()


def http_scope_from(websocket_scope: Scope, *, method: str, path: str, headers: list[tuple[bytes, bytes]],
                    ) -> Scope:
    """An HTTP scope for a request made on behalf of a WebSocket client: same client address, server
    and root path; `headers` replace the handshake's (the caller chooses what to carry over)."""
    scheme = {"wss": "https", "ws": "http"}.get(websocket_scope.get("scheme", "ws"), "http")
    state: dict[str, Any] = dict(websocket_scope.get("state") or {})
    return {
        "type": "http",
        # 2.3: the app learns about a disconnect from `receive`, which is how a cancel reaches it.
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": scheme,
        "path": path,
        "raw_path": path.encode(),
        "root_path": websocket_scope.get("root_path", ""),
        "query_string": b"",
        "headers": headers,
        "client": websocket_scope.get("client"),
        "server": websocket_scope.get("server"),
        "state": state,
        "extensions": {},
    }
