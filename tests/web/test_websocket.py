"""The streaming WebSocket against real processes: `kvik serve` on the tiny Llama, and `kvik gateway`
in front of it. Every request on a socket runs through the app's own HTTP route, so these tests
compare the socket with HTTP itself."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
import websockets

from tests.gateway.harness import ADMIN_KEY, Gateway, KvikServe, scrape_metric

pytestmark = pytest.mark.timeout(300)
PROMPTS = [f"Tell me about the number {i} and the colour {c}" for i, c in
           zip(range(20), ["red", "green", "blue", "amber", "teal"] * 4)]


def ws_url(base: str, path: str = "/v1/chat/completions") -> str:
    return base.replace("http://", "ws://") + path


async def collect(ws: Any, expected: int) -> dict[str, dict[str, Any]]:
    """Read until `expected` streams are done: per stream id, its text, events and final status."""
    streams: dict[str, dict[str, Any]] = {}
    done = 0
    while done < expected:
        event = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if event["type"] == "ping":
            await ws.send(json.dumps({"type": "pong"}))
            continue
        stream = streams.setdefault(event.get("stream_id"), {"text": "", "events": [], "status": None, "usage": None})
        stream["events"].append(event)
        if event["type"] == "chat.completion.chunk":
            for choice in event["choices"]:
                stream["text"] += choice["delta"].get("content") or ""
            stream["usage"] = event.get("usage") or stream["usage"]
        elif event["type"] == "response.done":
            stream["status"] = event["status"]
            done += 1
    return streams


def chat_body(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 12,
            **extra}


def test_twenty_concurrent_streams_equal_http(kvik_server: KvikServe) -> None:
    async def over_socket() -> dict[str, dict[str, Any]]:
        async with websockets.connect(ws_url(kvik_server.url)) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"  # no key needed on this server
            for i, prompt in enumerate(PROMPTS):
                await ws.send(json.dumps({"type": "response.create", "stream_id": f"r{i}",
                                          **chat_body(prompt, stream_options={"include_usage": True})}))
            return await collect(ws, len(PROMPTS))

    streams = asyncio.run(over_socket())
    with httpx.Client(base_url=kvik_server.url, timeout=60) as client:
        for i, prompt in enumerate(PROMPTS):
            reference = client.post("/v1/chat/completions", json=chat_body(prompt)).json()
            stream = streams[f"r{i}"]
            assert stream["status"] == "completed"
            assert stream["text"] == reference["choices"][0]["message"]["content"], prompt
            assert stream["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]
            assert [e["type"] for e in stream["events"]][0] == "response.created"


def kv_state(server: KvikServe) -> tuple[float, float]:
    return (scrape_metric(server.url, "kvik:num_requests_running"),
            scrape_metric(server.url, "kvik:kv_cache_usage_perc"))


def test_cancel_frees_the_sequence_and_its_kv_blocks(kvik_server: KvikServe) -> None:
    async def run() -> None:
        async with websockets.connect(ws_url(kvik_server.url)) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "response.create", "stream_id": "long",
                                      **chat_body("a long story", max_tokens=400, ignore_eos=True)}))
            chunks = 0
            while chunks < 5:
                event = json.loads(await ws.recv())
                chunks += event["type"] == "chat.completion.chunk"
            # Cancel at once: scraping /metrics first gave a loaded machine time to finish all 400
            # tokens before the cancel arrived. Streaming chunks show the sequence was running.
            await ws.send(json.dumps({"type": "response.cancel", "stream_id": "long"}))
            while (event := json.loads(await ws.recv()))["type"] != "response.done":
                pass
            assert event == {"type": "response.done", "stream_id": "long", "status": "cancelled"}
            deadline = time.monotonic() + 10
            while kv_state(kvik_server) != (0.0, 0.0):
                assert time.monotonic() < deadline, kv_state(kvik_server)
                await asyncio.sleep(0.05)
            # The socket carries on: the same id can be used again.
            await ws.send(json.dumps({"type": "response.create", "stream_id": "long", **chat_body("again")}))
            assert (await collect(ws, 1))["long"]["status"] == "completed"

    asyncio.run(run())


def test_a_slow_reader_does_not_stall_other_sockets(kvik_server: KvikServe) -> None:
    async def run() -> None:
        async with websockets.connect(ws_url(kvik_server.url), max_queue=4) as slow, \
                websockets.connect(ws_url(kvik_server.url)) as fast:
            await slow.recv()
            await fast.recv()
            for i in range(6):
                await slow.send(json.dumps({"type": "response.create", "stream_id": f"s{i}",
                                            **chat_body(f"long {i}", max_tokens=300, ignore_eos=True)}))
            # `slow` reads nothing now; `fast` gets its answers all the same.
            started = time.monotonic()
            for i in range(4):
                await fast.send(json.dumps({"type": "response.create", "stream_id": f"f{i}",
                                            **chat_body(f"quick {i}", max_tokens=4)}))
                assert (await collect(fast, 1))[f"f{i}"]["status"] == "completed"
            fast_seconds = time.monotonic() - started
            # Generous: the four short answers need well under a second on an idle machine.
            assert fast_seconds < 30, fast_seconds
            # Nothing was dropped for the slow reader: each stream has all its 300 tokens.
            streams = await collect(slow, 6)
            for i in range(6):
                assert streams[f"s{i}"]["status"] == "completed"
                pieces = sum(1 for e in streams[f"s{i}"]["events"] if e["type"] == "chat.completion.chunk"
                             and e["choices"] and e["choices"][0].get("finish_reason") is None) - 1
                assert pieces <= 300 and streams[f"s{i}"]["events"][-1]["status"] == "completed"

    asyncio.run(run())


def test_gateway_socket_shares_auth_limits_and_usage(gateway: Gateway) -> None:
    key = gateway.create_key(name="ws-user", models=["tiny"])
    url = ws_url(gateway.url)

    async def run() -> None:
        # A key on the handshake, as API clients send it.
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "response.create", "stream_id": "a",
                                      **chat_body("through the gateway", stream_options={"include_usage": True})}))
            await ws.send(json.dumps({"type": "response.create", "stream_id": "b",
                                      **chat_body("forbidden model", model="scripted")}))
            streams = await collect(ws, 2)
            assert streams["a"]["status"] == "completed" and streams["a"]["usage"]["completion_tokens"] > 0
            assert streams["a"]["events"][0]["request_id"].startswith("req_")
            error = next(e for e in streams["b"]["events"] if e["type"] == "error")
            assert error["status"] == 403 and error["error"]["code"] == "model_not_allowed"
        # The key as the first message, as browsers send it.
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            assert json.loads(await ws.recv())["type"] == "session.created"
        # A wrong key is refused at once, and the socket closed.
        for headers, first in (({"Authorization": "Bearer kvik-wrong"}, None),
                               ({}, {"type": "auth", "api_key": "kvik-wrong"}),
                               ({}, {"type": "response.create", **chat_body("no key")})):
            async with websockets.connect(url, additional_headers=headers) as ws:
                if first is not None:
                    await ws.send(json.dumps(first))
                refused = json.loads(await ws.recv())
                assert refused["type"] == "error" and refused["status"] == 401
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await ws.recv()
                assert closed.value.rcvd.code == 1008

    asyncio.run(run())
    with gateway.client(ADMIN_KEY) as admin:
        key_id = next(k["id"] for k in admin.get("/admin/keys").json()["data"] if k["name"] == "ws-user")
        rows = admin.get("/admin/requests", params={"key_id": key_id}).json()["data"]
    assert sorted(r["status"] for r in rows) == [200, 403]
    ok = next(r for r in rows if r["status"] == 200)
    assert ok["stream"] and ok["completion_tokens"] > 0 and ok["model"] == "tiny"


def test_protocol_errors_keep_the_socket(kvik_server: KvikServe) -> None:
    async def run() -> None:
        async with websockets.connect(ws_url(kvik_server.url)) as ws:
            await ws.recv()
            # A lone surrogate escape: JSON to json.loads, but no text to encode for the route.
            surrogate = '{"type": "response.create", "stream_id": "s", "model": "tiny", ' \
                        '"messages": [{"role": "user", "content": "\\ud800"}]}'
            for message, param, status in (("not json", None, 400), (surrogate, None, 400),
                                           (json.dumps([1]), "type", 400),
                                           (json.dumps({"type": "nope"}), "type", 400),
                                           (json.dumps({"type": "response.create", **chat_body("x"), "stream": False}),
                                            "stream", 400),
                                           (json.dumps({"type": "response.cancel", "stream_id": "ghost"}),
                                            "stream_id", 404),
                                           (json.dumps({"type": "response.create", "stream_id": 5}), "stream_id", 400)):
                await ws.send(message)
                error = json.loads(await ws.recv())
                assert error["type"] == "error" and error["status"] == status, (message, error)
                assert error["error"]["param"] == param
            await ws.send(json.dumps({"type": "response.create", "stream_id": "dup",
                                      **chat_body("one", max_tokens=200, ignore_eos=True)}))
            await ws.send(json.dumps({"type": "response.create", "stream_id": "dup", **chat_body("two")}))
            streams = await collect(ws, 1)
            codes = [e["error"]["code"] for e in streams["dup"]["events"] if e["type"] == "error"]
            assert codes == ["stream_id_in_use"] and streams["dup"]["status"] == "completed"
            # Validation is the route's own: the same 400 as over HTTP.
            await ws.send(json.dumps({"type": "response.create", "stream_id": "bad", "model": "tiny",
                                      "messages": [{"role": "user", "content": "x"}], "temperature": -1}))
            error = next(e for e in (await collect(ws, 1))["bad"]["events"] if e["type"] == "error")
            http_error = httpx.post(kvik_server.url + "/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1}).json()
            assert error["status"] == 400 and error["error"] == http_error["error"]

    asyncio.run(run())


def test_cross_site_pages_cannot_open_the_socket(kvik_server: KvikServe) -> None:
    async def run() -> None:
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(ws_url(kvik_server.url), origin="http://evil.example"):
                pass
        assert refused.value.response.status_code == 403
        same = "http://" + kvik_server.url.split("://", 1)[1]
        async with websockets.connect(ws_url(kvik_server.url), origin=same) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"

    asyncio.run(run())
