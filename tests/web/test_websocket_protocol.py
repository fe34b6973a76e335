"""The WebSocket's own rules, on a real uvicorn server in this process whose streaming route the test
controls (chunk count and size), with short timers: server pings and the idle close, backpressure
down to the route, the send timeout for a client that stopped reading, the per-socket stream limit."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
import websockets
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvik.server.serving.streams import SSEResponse
from kvik.web import PageConfig, SocketOptions, install_web
from tests.gateway.harness import free_port

pytestmark = pytest.mark.timeout(120)
OPTIONS = SocketOptions(ping_interval_s=0.2, idle_timeout_s=1.0, send_timeout_s=1.5, max_streams=3)


class Route:
    """What the streaming route did: chunks produced, streams closed (finished or cancelled)."""

    def __init__(self) -> None:
        self.produced = 0
        self.closed = 0


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Route]]:
    route = Route()
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": []})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> SSEResponse:
        body = await request.json()
        count, size = int(body.get("chunks", 3)), int(body.get("size", 8))

        async def events() -> Any:
            try:
                for _ in range(count):
                    route.produced += 1
                    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "x" * size}}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    await asyncio.sleep(0)
                yield "data: [DONE]\n\n"
            finally:
                route.closed += 1

        # kvik's own event-stream response: it closes the generator when the client leaves (a plain
        # StreamingResponse leaves it suspended until the garbage collector finds it).
        return SSEResponse(events(), on_close=lambda: None)

    install_web(app, PageConfig(product="server", conversations="browser"), OPTIONS)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                        timeout_graceful_shutdown=1))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"ws://127.0.0.1:{port}/v1/chat/completions", route
    finally:
        uv.should_exit = True
        thread.join(3)  # a daemon thread: a socket still closing must not hold up the suite


def test_server_pings_and_closes_a_silent_client(server: tuple[str, Route]) -> None:
    url, _ = server

    async def run() -> None:
        async with websockets.connect(url) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            started = time.monotonic()
            pings = 0
            while time.monotonic() - started < 2.0:  # twice the idle timeout, answering every ping
                event = json.loads(await asyncio.wait_for(ws.recv(), 2))
                assert event["type"] == "ping"
                pings += 1
                await ws.send(json.dumps({"type": "pong", "ts": event["ts"]}))
            assert pings >= 5
            # Now silent: closed as gone away within the idle timeout plus one ping interval.
            silent = time.monotonic()
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    assert json.loads(await asyncio.wait_for(ws.recv(), 5))["type"] == "ping"
            assert closed.value.rcvd.code == 1001
            assert time.monotonic() - silent < OPTIONS.idle_timeout_s + 1.0

    asyncio.run(run())


def _tcp_buffer_max() -> int:
    """The largest receive plus send buffer Linux may give a TCP socket (bytes)."""
    try:
        return sum(int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2]) for name in ("tcp_rmem", "tcp_wmem"))
    except (OSError, ValueError, IndexError):
        return 0


def test_a_client_that_stops_reading_backpressures_the_route_then_is_closed(server: tuple[str, Route]) -> None:
    url, route = server
    before_closed = route.closed

    async def run() -> None:
        # max_queue=1: the client library stops reading the socket after one unread message.
        # compression=None: with permessage-deflate a chunk of 10,000 "x" is a few dozen bytes on the
        # wire, and the socket buffers would hold hundreds of megabytes of chunks.
        async with websockets.connect(url, max_queue=1, close_timeout=1, compression=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            # 200,000 chunks of 10 kB (2 GB) asked for; none read from now on.
            await ws.send(json.dumps({"type": "response.create", "stream_id": "big", "chunks": 200_000,
                                      "size": 10_000}))
            # The route produces until the socket buffers are full, then its writes block; the send
            # timeout then closes the socket, which cancels the route. The client keeps sending pongs,
            # so the idle timeout (1 s without a word from the client) cannot be what closes it. How
            # long the buffers take to fill depends on the machine's load, so the close is timed from
            # when production stopped (no chunk for 0.5 s), not from the request.
            last, last_at = route.produced, time.monotonic()
            started, blocked_at, blocked_count = last_at, None, None
            while route.closed == before_closed:
                assert time.monotonic() - started < 60, f"never closed; {route.produced} chunks produced"
                await ws.send(json.dumps({"type": "pong"}))
                await asyncio.sleep(0.05)
                now = time.monotonic()
                if route.produced != last:
                    last, last_at = route.produced, now
                elif blocked_at is None and now - last_at > 0.5:
                    blocked_at, blocked_count = last_at, last
            assert blocked_at is not None, "the route was cancelled before its writes ever blocked"
            closed_after = time.monotonic() - blocked_at
            # What the route could produce is what the socket buffers hold: megabytes, not gigabytes.
            # Linux autotunes loopback buffers up to tcp_rmem/tcp_wmem's maxima (32 MB + 4 MB on one
            # reference machine, where 4.7-5.4 MB got through), so the bound follows them.
            print(f"produced {blocked_count} chunks of 10 kB while unread; cancelled {closed_after:.2f} s after")
            assert blocked_count < max(5_000, 2 * _tcp_buffer_max() // 10_000), blocked_count
            # Blocked for the send timeout, then at most CLOSE_WAIT_S (2 s) for the close frame.
            assert OPTIONS.send_timeout_s - 0.5 < closed_after < OPTIONS.send_timeout_s + 2.0 + 3.0, closed_after
            # Cancelling empties the call's queue (at most 64 chunks): the route gets out a few more.
            assert route.produced - blocked_count < 100

    asyncio.run(run())


def test_stream_limit_per_socket(server: tuple[str, Route]) -> None:
    url, _ = server

    async def run() -> None:
        async with websockets.connect(url) as ws:
            await ws.recv()
            for i in range(4):
                await ws.send(json.dumps({"type": "response.create", "stream_id": f"s{i}", "chunks": 100_000}))
            refusal = None
            done = set()
            while len(done) < 4:
                event = json.loads(await asyncio.wait_for(ws.recv(), 10))
                if event["type"] == "error":
                    refusal = event
                    done.add(event["stream_id"])
                elif event["type"] == "chat.completion.chunk" and event["stream_id"] not in done:
                    await ws.send(json.dumps({"type": "response.cancel", "stream_id": event["stream_id"]}))
                    done.add(event["stream_id"])
            assert refusal is not None and refusal["status"] == 429
            assert refusal["error"]["code"] == "too_many_streams" and refusal["stream_id"] == "s3"

    asyncio.run(run())
