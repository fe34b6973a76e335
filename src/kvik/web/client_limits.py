"""Limits on what a client may cost a server (the gateway or `kvik serve`) before its request is
even understood.

- Header timeout (slowloris): uvicorn has none, and an ASGI app is only called once the headers are
  complete, so it is enforced in the HTTP protocol: `guarded_h11_protocol` arms a timer when a
  connection opens or a new request's first byte arrives, and answers 408 and closes the connection
  when the request line and headers are not complete in time.
- Body size and body timeout: `ClientLimits`, an ASGI middleware in front of every route, answers
  413 at once for a declared `Content-Length` over the limit, counts chunked bodies as they arrive
  (413 when over), and gives the whole body `body_timeout_s` after the headers (408). A response
  sent before the body was read in full closes the connection, so the rest of an oversized or
  trickling body is never parsed.
- Lingering close (as nginx does): closing a socket with unread data makes the kernel send a reset,
  which can destroy the early answer in the client's receive buffer before it reads it (a client
  that is still uploading reads only afterwards). So a connection closed while the client is still
  sending is half-closed instead (the answer, then EOF), and what still arrives is read and dropped
  until the client stops, for at most `LINGER_S`.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvik.core.errors import KvikError, RequestTooLargeError
from kvik.protocol.errors import error_from_exception

Scope = dict[str, Any]
Message = dict[str, Any]


class RequestTimeoutError(KvikError):
    """The client took too long to send its request (HTTP 408)."""

    http_status = 408
    error_type = "invalid_request_error"
    code = "request_timeout"


def too_large(max_bytes: int, setting: str = "limits.max_body_bytes") -> RequestTooLargeError:
    return RequestTooLargeError(f"The request body is over the limit of {max_bytes} bytes ({setting}).")


class ClientLimits:
    """ASGI middleware: body size and body read time (see the module docstring). `size_setting` and
    `timeout_setting` name the operator's settings in the error messages."""

    def __init__(self, app: Any, *, max_body_bytes: int, body_timeout_s: float,
                 size_setting: str = "limits.max_body_bytes", timeout_setting: str = "limits.body_timeout_s") -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.size_setting = size_setting
        self.timeout_setting = timeout_setting

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await send_error(send, too_large(self.max_body_bytes, self.size_setting))
            return
        # No body at all (a GET) is a complete body; the protocol has already rejected a bad header.
        complete = declared in (None, b"0") and b"transfer-encoding" not in headers
        received = 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def guarded_receive() -> Message:
            nonlocal complete, received
            if complete:
                return await receive()  # the disconnect watch: no deadline
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeoutError(f"The request body did not arrive within {self.body_timeout_s:g} s "
                                          f"({self.timeout_setting}).") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise too_large(self.max_body_bytes, self.size_setting)
                complete = not message.get("more_body", False)
            return message

        async def guarded_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not complete:
                # The client may still be sending: do not read the rest, close after this answer.
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, guarded_receive, guarded_send)


async def send_error(send: Any, error: KvikError) -> None:
    """Answer with the error's OpenAI envelope, straight on the ASGI channel, and close."""
    status, body, headers = error_from_exception(error)
    payload = json.dumps(body).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close"), *((k.lower().encode(), v.encode()) for k, v in headers.items())]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})


LINGER_S = 10.0  # longest a half-closed connection keeps reading (and dropping) what the client sends
LINGER_IDLE_S = 2.0  # ... or until the client has been silent this long

_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: %d\r\n\r\n%s")


def guarded_h11_protocol(header_timeout_s: float, setting: str = "limits.header_timeout_s") -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header timeout (pass as `uvicorn.Config(http=...)`)."""
    _, body, _ = error_from_exception(RequestTimeoutError(
        f"The request headers did not arrive within {header_timeout_s:g} s ({setting})."))
    payload = json.dumps(body).encode()
    response = _TIMEOUT_RESPONSE % (len(payload), payload)

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _linger: _Lingering | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            _no_delay(transport)
            # uvicorn closes through `self.transport` (and hands it to each request cycle): the
            # wrapper turns a close while the client is still sending into a lingering close.
            super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
            self._watch_headers()

        def data_received(self, data: bytes) -> None:
            if self._linger is not None:
                self._linger.received()  # dropped: the answer is out, the connection is closing
                return
            super().data_received(data)
            self._watch_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_timer()
            if self._linger is not None:
                self._linger.cancel()
            super().connection_lost(exc)

        def close_transport(self, transport: asyncio.Transport) -> None:
            """Close, or linger first when the client is still sending a body nobody will read."""
            if self._linger is not None:
                return
            if self.conn.their_state is h11.SEND_BODY and transport.can_write_eof() and not transport.is_closing():
                self._stop_header_timer()
                self._linger = _Lingering(transport, self.loop)
            else:
                transport.close()

        def lingering(self) -> bool:
            return self._linger is not None

        def _watch_headers(self) -> None:
            # IDLE: the peer has not finished a request's headers. Between requests uvicorn's own
            # keep-alive timer covers the silence; the first byte of the next request cancels it
            # and arms this one.
            waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
            if waiting and self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._on_header_timeout)
            elif not waiting:
                self._stop_header_timer()

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            busy = self.cycle is not None and not self.cycle.response_complete
            if self.conn.their_state is h11.IDLE and not busy and not self.transport.is_closing():
                self.transport.write(response)
                self.transport.close()

    return HeaderTimeoutH11Protocol


def _no_delay(transport: asyncio.Transport) -> None:
    """Turn Nagle's algorithm off, as asyncio does for the sockets it creates itself. It skips
    sockets whose `proto` is 0, which is what uvicorn's `Config.bind_socket` (used for the gateway's
    listeners) makes; with Nagle on, an answer written in two parts waits for the client's delayed
    ACK: 40 ms a request."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Lingering:
    """A half-closed connection that drops what still arrives and closes when the client stops."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._deadline = loop.time() + LINGER_S
        transport.write_eof()  # the answer, then EOF: the client reads all of it
        transport.resume_reading()  # flow control may have paused it while the body piled up
        self._timer = loop.call_later(LINGER_IDLE_S, self._close)

    def received(self) -> None:
        self._timer.cancel()
        self._timer = self._loop.call_at(min(self._deadline, self._loop.time() + LINGER_IDLE_S), self._close)

    def cancel(self) -> None:
        self._timer.cancel()

    def _close(self) -> None:
        self._transport.close()


class _LingeringTransport:
    """The connection's transport, except that `close()` lingers while the client is still sending
    a body nobody will read (see the module docstring)."""

    def __init__(self, transport: asyncio.Transport, protocol: Any) -> None:
        self._transport = transport
        self._protocol = protocol
        # Bound once: a streamed response writes once per token, and forwarding through
        # __getattr__ (called after a failed lookup) was ~2 % of the API process's busy samples
        # while it streamed one response (py-spy).
        self.write = transport.write

    def close(self) -> None:
        self._protocol.close_transport(self._transport)

    def is_closing(self) -> bool:
        return self._protocol.lingering() or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
