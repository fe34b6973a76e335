"""Streaming chat over one WebSocket: many requests at once, each on its own `stream_id`.

The message shapes follow OpenAI's WebSocket mode of the Responses API (`response.create` with the
HTTP body's fields at the top level, `stream_id` to multiplex, `error` events with a `status`), applied
to the endpoint the socket was opened on (`/v1/chat/completions` or `/v1/completions`); the full
protocol is in docs/websocket.md.

Every request runs through the app's own HTTP route in this process (`asgi_call.InProcessCall`), so
a request over the socket is authenticated, limited, validated and accounted exactly as over HTTP.
Each stream has a task; one lock orders the writes. When the client reads slowly the writes wait,
the per-stream queues fill and the routes' own streaming pauses: that is the backpressure. A client
that stops reading for `send_timeout_s`, or sends nothing (not even a pong) for `idle_timeout_s`, is
disconnected, which cancels its streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from kvik.core import client_json
from kvik.protocol.errors import error_body
from kvik.web.asgi_call import InProcessCall, http_scope_from

logger = logging.getLogger("kvik.web.websocket")

PROTOCOL = "kvik.ws.v1"
# Close codes (RFC 6455): policy violation for refused auth or origin, going away for idle clients.
CLOSE_POLICY = 1008
CLOSE_GOING_AWAY = 1001
CLOSE_TRY_AGAIN = 1013
MAX_ERROR_BODY_BYTES = 64 * 1024
CLOSE_WAIT_S = 2.0


@dataclass(slots=True, frozen=True)
class SocketOptions:
    ping_interval_s: float = 20.0  # the server sends {"type": "ping"} this often
    idle_timeout_s: float = 60.0  # nothing from the client (a pong counts) for this long: close
    send_timeout_s: float = 60.0  # one write blocked this long (the client stopped reading): close
    auth_timeout_s: float = 10.0  # a client without an Authorization header must send `auth` by then
    max_streams: int = 64  # concurrent requests per socket
    auth_probe_path: str = "/v1/models"  # an authenticated GET: 401/403 refuses the socket

    @classmethod
    def from_env(cls) -> SocketOptions:
        """Defaults, with KVIK_WS_PING_INTERVAL_S, KVIK_WS_IDLE_TIMEOUT_S, KVIK_WS_SEND_TIMEOUT_S and
        KVIK_WS_MAX_STREAMS applied when set."""
        def number(name: str, default: float) -> float:
            value = os.environ.get(name)
            return default if value is None else float(value)

        base = cls()
        return cls(ping_interval_s=number("KVIK_WS_PING_INTERVAL_S", base.ping_interval_s),
                   idle_timeout_s=number("KVIK_WS_IDLE_TIMEOUT_S", base.idle_timeout_s),
                   send_timeout_s=number("KVIK_WS_SEND_TIMEOUT_S", base.send_timeout_s),
                   max_streams=int(number("KVIK_WS_MAX_STREAMS", base.max_streams)))


class ProtocolError(Exception):
    """A client message the socket cannot act on; answered with an `error` event, socket kept."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, stream_id: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.stream_id = message, param, code, status, stream_id


class SseDataReader:
    """The `data:` payloads of an event stream, from byte chunks cut anywhere."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        payloads = []
        while (end := self._buffer.find(b"\n\n")) >= 0:
            event, self._buffer = self._buffer[:end], self._buffer[end + 2:]
            lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                payloads.append(b"\n".join(lines).decode("utf-8", errors="replace"))
        return payloads


def same_origin(websocket: WebSocket) -> bool:
    """Browsers send Origin on every WebSocket handshake and the page's own socket is same-origin; a
    page on another site must not drive this server with the visitor's network position (a bare
    `kvik serve` on localhost has no key). Clients that are not browsers send no Origin."""
    origin = websocket.headers.get("origin")
    if origin is None:
        return True
    host = websocket.headers.get("host", "")
    return urlsplit(origin).netloc.lower() == host.lower()


class StreamingSocket:
    """One accepted WebSocket and the streams running on it."""

    def __init__(self, websocket: WebSocket, endpoint_path: str, options: SocketOptions) -> None:
        self.ws = websocket
        self.endpoint_path = endpoint_path
        self.options = options
        self.app = websocket.scope["app"]
        self.authorization: str | None = websocket.headers.get("authorization")
        self.streams: dict[str, asyncio.Task[None]] = {}
        self._send_lock = asyncio.Lock()
        self._last_heard = time.monotonic()
        self._closed = False
        self._closing = asyncio.Event()  # set when the server closes; the read loop stops

    async def run(self) -> None:
        if not same_origin(self.ws):
            await self.ws.close(code=CLOSE_POLICY, reason="cross-origin WebSocket refused")
            return
        await self.ws.accept()
        pinger = asyncio.create_task(self._ping_loop(), name="kvik-ws-ping")
        try:
            first = await self._authenticate()
            if first is not False:
                if first is not None:
                    await self._handle(first)
                while True:
                    message = await self._receive()
                    if message is None:
                        break
                    await self._handle(message)
        except WebSocketDisconnect:
            pass
        finally:
            self._closed = True
            pinger.cancel()
            await self._cancel_all()

    # --- authentication ---------------------------------------------------------------------

    async def _authenticate(self) -> dict[str, Any] | None | bool:
        """Check the key before any work: the handshake's Authorization header, else (when the app
        wants a key) an `auth` message, which browsers send since they cannot set headers. Returns
        False when the socket was refused, else a first message still to handle (or None)."""
        status, body = await self._probe()
        first: dict[str, Any] | None = None
        if status in (401, 403) and self.authorization is None:
            try:
                first = await asyncio.wait_for(self._receive(), self.options.auth_timeout_s)
            except asyncio.TimeoutError:
                first = None
            if first is not None and first.get("type") == "auth":
                if not await self._take_key(first):
                    return False
                first = None
                status, body = await self._probe()
        if status in (401, 403):
            await self._refused(status, body)
            return False
        await self._send({"type": "session.created", "protocol": PROTOCOL, "endpoint": self.endpoint_path,
                          "max_streams": self.options.max_streams,
                          "ping_interval_s": self.options.ping_interval_s})
        return first

    async def _take_key(self, message: dict[str, Any]) -> bool:
        key = message.get("api_key")
        if key is not None and (not isinstance(key, str) or not key or len(key) > 4096):
            await self._refused(400, error_body("auth.api_key: give the API key as a string", "invalid_request_error",
                                                "api_key"))
            return False
        self.authorization = None if key is None else f"Bearer {key}"
        return True

    async def _reauthenticate(self, message: dict[str, Any]) -> None:
        """A later `auth` message switches the socket to another key (streams running keep theirs)."""
        if not await self._take_key(message):
            return
        status, body = await self._probe()
        if status in (401, 403):
            await self._refused(status, body)
            return
        await self._send({"type": "session.updated", "protocol": PROTOCOL})

    async def _refused(self, status: int, body: Any) -> None:
        if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
            body = error_body("Send a valid API key: an Authorization header on the handshake, or "
                              "{\"type\": \"auth\", \"api_key\": \"...\"} first.", "authentication_error")
        await self._send({"type": "error", "status": status, **body})
        await self._close(CLOSE_POLICY, "authentication failed")

    async def _probe(self) -> tuple[int, Any]:
        call = InProcessCall(self.app, http_scope_from(
            self.ws.scope, method="GET", path=self.options.auth_probe_path, headers=self._headers(b"")), b"")
        call.start()
        start = await call.response()
        raw = b"".join([chunk async for chunk in call.chunks()])
        try:
            return start.status, json.loads(raw)
        except ValueError:
            return start.status, None

    # --- client messages --------------------------------------------------------------------

    async def _receive(self) -> dict[str, Any] | None:
        """The next client message as a JSON object; None once the client has gone. Messages that
        are not JSON objects get an `error` event and are skipped."""
        while True:
            receiving = asyncio.ensure_future(self.ws.receive())
            closing = asyncio.ensure_future(self._closing.wait())
            await asyncio.wait({receiving, closing}, return_when=asyncio.FIRST_COMPLETED)
            closing.cancel()
            if not receiving.done():
                receiving.cancel()
                return None
            message = receiving.result()
            self._last_heard = time.monotonic()
            if message["type"] == "websocket.disconnect":
                return None
            text = message.get("text")
            if text is None:
                await self._error(ProtocolError("send text frames holding JSON objects, not binary"))
                continue
            try:
                value = client_json.loads(text)
            except ValueError as exc:
                await self._error(ProtocolError(f"the message is not valid JSON: {exc}"))
                continue
            if not isinstance(value, dict) or not isinstance(value.get("type"), str):
                await self._error(ProtocolError("each message must be a JSON object with a string `type`",
                                                param="type"))
                continue
            return value

    async def _handle(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        try:
            if kind == "response.create":
                self._create(message)
            elif kind == "response.cancel":
                await self._cancel(_stream_id(message))
            elif kind in ("pong", "ping"):
                if kind == "ping":
                    await self._send({"type": "pong", "ts": message.get("ts")})
            elif kind == "auth":
                await self._reauthenticate(message)
            else:
                raise ProtocolError(f"type: unknown message type {kind!r}; use response.create, "
                                    "response.cancel or pong", param="type")
        except ProtocolError as exc:
            await self._error(exc)

    def _create(self, message: dict[str, Any]) -> None:
        stream_id = _stream_id(message)
        if stream_id in self.streams:
            raise ProtocolError(f"stream_id: {stream_id!r} is still running; wait for its response.done "
                                "or use another id", param="stream_id", code="stream_id_in_use",
                                stream_id=stream_id)
        if len(self.streams) >= self.options.max_streams:
            raise ProtocolError(f"this socket already runs {len(self.streams)} streams, the limit; wait for "
                                "one to finish or open another socket", code="too_many_streams", status=429,
                                stream_id=stream_id)
        body = {k: v for k, v in message.items() if k not in ("type", "stream_id")}
        if body.get("stream", True) is not True:
            raise ProtocolError("stream: every response streams over a WebSocket; leave `stream` out",
                                param="stream", stream_id=stream_id)
        body["stream"] = True
        payload = json.dumps(body, ensure_ascii=False).encode()
        task = asyncio.create_task(self._run_stream(stream_id, payload), name=f"kvik-ws-stream {stream_id}")
        self.streams[stream_id] = task
        task.add_done_callback(lambda _: self.streams.pop(stream_id, None)
                               if self.streams.get(stream_id) is task else None)

    async def _cancel(self, stream_id: str) -> None:
        task = self.streams.get(stream_id)
        if task is None:
            raise ProtocolError(f"stream_id: no running stream {stream_id!r} (it may have finished)",
                                param="stream_id", code="stream_not_found", status=404, stream_id=stream_id)
        # Not awaited: the reader stays responsive; the stream's own task sends its response.done.
        task.cancel()

    async def _cancel_all(self) -> None:
        tasks = list(self.streams.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    # --- one stream -------------------------------------------------------------------------

    async def _run_stream(self, stream_id: str, payload: bytes) -> None:
        call = InProcessCall(self.app, http_scope_from(self.ws.scope, method="POST", path=self.endpoint_path,
                                                       headers=self._headers(payload)), payload)
        call.start()
        status = "failed"
        try:
            start = await call.response()
            if start.status != 200 or not start.headers.get("content-type", "").startswith("text/event-stream"):
                await self._relay_error(stream_id, start.status, start.headers, call)
                return
            await self._send({"type": "response.created", "stream_id": stream_id,
                              "request_id": start.headers.get("x-request-id")})
            status = await self._relay_events(stream_id, call)
        except asyncio.CancelledError:
            status = "cancelled"
            with contextlib.suppress(Exception):
                await asyncio.shield(call.cancel())
        except Exception:  # noqa: BLE001 - a bug here must end this stream, not the socket
            logger.exception("WebSocket stream %s failed", stream_id)
            await self._error(ProtocolError("internal error while streaming", status=500, stream_id=stream_id))
        finally:
            if status != "completed":
                with contextlib.suppress(Exception):
                    await asyncio.shield(call.cancel())
            with contextlib.suppress(Exception):
                await self._send({"type": "response.done", "stream_id": stream_id, "status": status})

    async def _relay_events(self, stream_id: str, call: InProcessCall) -> str:
        reader = SseDataReader()
        saw_done = failed = False
        async for chunk in call.chunks():
            for data in reader.feed(chunk):
                if data == "[DONE]":
                    saw_done = True
                    continue
                try:
                    event = json.loads(data)
                except ValueError:
                    continue
                if not isinstance(event, dict):
                    continue
                if "error" in event and "object" not in event:
                    failed = True  # an in-band failure after the stream started
                    await self._send({"type": "error", "stream_id": stream_id, "status": 500, "error": event["error"]})
                    continue
                await self._send({**event, "type": event.get("object", "chunk"), "stream_id": stream_id})
        return "completed" if saw_done and not failed else "failed"

    async def _relay_error(self, stream_id: str, status: int, headers: dict[str, str], call: InProcessCall) -> None:
        raw = bytearray()
        async for chunk in call.chunks():
            if len(raw) < MAX_ERROR_BODY_BYTES:
                raw += chunk
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
            body = error_body(f"the request failed with HTTP {status}", "server_error" if status >= 500
                              else "invalid_request_error")
        event: dict[str, Any] = {"type": "error", "stream_id": stream_id, "status": status, **body}
        retry_after = headers.get("retry-after")
        if retry_after is not None and retry_after.isdigit():
            event["retry_after_s"] = int(retry_after)
        await self._send(event)

    # --- writing ----------------------------------------------------------------------------

    def _headers(self, body: bytes) -> list[tuple[bytes, bytes]]:
        headers = [(b"host", self.ws.headers.get("host", "localhost").encode("latin-1")),
                   (b"content-type", b"application/json"), (b"accept", b"text/event-stream"),
                   (b"content-length", str(len(body)).encode())]
        agent = self.ws.headers.get("user-agent")
        if agent:
            headers.append((b"user-agent", agent.encode("latin-1", errors="replace")))
        if self.authorization:
            headers.append((b"authorization", self.authorization.encode("latin-1", errors="replace")))
        for name in (b"traceparent", b"tracestate"):  # W3C trace context: requests join the client's trace
            value = self.ws.headers.get(name.decode())
            if value:
                headers.append((name, value.encode("latin-1", errors="replace")))
        return headers

    async def _error(self, exc: ProtocolError) -> None:
        event: dict[str, Any] = {"type": "error", "status": exc.status,
                                 **error_body(exc.message, "invalid_request_error", exc.param, exc.code)}
        if exc.stream_id is not None:
            event["stream_id"] = exc.stream_id
        await self._send(event)

    async def _send(self, event: dict[str, Any]) -> None:
        """Write one event; all writers take turns. A write blocked past `send_timeout_s` means the
        client stopped reading: the socket is closed, which cancels every stream on it."""
        if self._closed or self.ws.client_state != WebSocketState.CONNECTED:
            return
        text = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        async with self._send_lock:
            try:
                await asyncio.wait_for(self.ws.send_text(text), self.options.send_timeout_s)
            except asyncio.TimeoutError:
                logger.warning("WebSocket client stopped reading for %.0f s; closing", self.options.send_timeout_s)
                self._closed = True
                await self._close(CLOSE_TRY_AGAIN, "client not reading")
            except (WebSocketDisconnect, RuntimeError, OSError):
                self._closed = True

    async def _close(self, code: int, reason: str) -> None:
        """Close from our side; the read loop then ends and cancels the streams. A client that reads
        nothing cannot take the close frame either, so it gets a bounded wait."""
        self._closed = True
        self._closing.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code=code, reason=reason), CLOSE_WAIT_S)

    async def _ping_loop(self) -> None:
        interval = self.options.ping_interval_s
        while not self._closed:
            await asyncio.sleep(interval)
            if time.monotonic() - self._last_heard > self.options.idle_timeout_s:
                await self._close(CLOSE_GOING_AWAY, "no pong from the client")
                return
            await self._send({"type": "ping", "ts": round(time.time(), 3)})


def _stream_id(message: dict[str, Any]) -> str:
    stream_id = message.get("stream_id", "default")
    if not isinstance(stream_id, str) or not 1 <= len(stream_id) <= 128:
        raise ProtocolError("stream_id: give a string of 1 to 128 characters", param="stream_id")
    return stream_id
