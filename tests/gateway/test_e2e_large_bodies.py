"""Issue 10, finding 2 (gateway): a multi-megabyte chat body must not stall other tenants, and a body
over the limit is refused before it is read, whether its length is declared or chunked."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from tests.gateway.harness import Gateway, GatewayFactory, Upstream, model_config

pytestmark = pytest.mark.timeout(180)

LIMIT = 6 * 1024 * 1024  # the test gateway's max_body_bytes: a 5 MB body fits


@pytest.fixture(scope="module")
def gateway(gateways: GatewayFactory, upstreams: list[Upstream]) -> Gateway:
    for upstream in upstreams:
        upstream.reset()
    return gateways.start({
        "models": [model_config("tiny", upstreams)],
        "guardrails": {"pii": {"enabled": True}},  # seconds of regular expressions for 5 MB
        "cache": {"enabled": False},
        "limits": {"max_body_bytes": LIMIT},
    }, name="large-bodies")


def five_megabyte_chat() -> dict:
    # Prose with numbers in it, so every PII pattern has candidates to check.
    line = "order 12 345 shipped to room 7, call back at 555 0100 if anything goes wrong. "
    text = (line * (5_000_000 // len(line) + 1))[:5_000_000]
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 1}


def test_a_5mb_body_does_not_delay_another_tenants_small_request(gateway: Gateway) -> None:
    big_key, small_key = gateway.create_key(name="big-tenant"), gateway.create_key(name="small-tenant")
    timings: dict[str, float] = {}
    uploaded = threading.Event()
    body = json.dumps(five_megabyte_chat()).encode()

    def chunks():
        for start in range(0, len(body), 1 << 20):
            yield body[start:start + (1 << 20)]
        uploaded.set()  # the last byte is on its way: the gateway now parses and redacts 5 MB

    def big() -> None:
        started = time.monotonic()
        with gateway.client(big_key, timeout=120) as client:
            response = client.post("/v1/chat/completions", content=chunks(),
                                   headers={"content-type": "application/json"})
        assert response.status_code == 200, response.text
        timings["big_done"], timings["big_latency"] = time.monotonic(), time.monotonic() - started

    with gateway.client(small_key) as client:  # warm: the small tenant's key is cached
        assert client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
    thread = threading.Thread(target=big)
    thread.start()
    assert uploaded.wait(60)
    started = time.monotonic()
    with gateway.client(small_key) as client:
        small = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    timings["small_done"], small_latency = time.monotonic(), time.monotonic() - started
    thread.join(timeout=150)
    assert small.status_code == 200 and "big_latency" in timings
    print(f"\n5 MB request: {timings['big_latency']:.2f} s; the other tenant's 2-token request meanwhile: "
          f"{small_latency * 1000:.0f} ms")
    # Ratios, not times: the small request, sent once the 5 MB body was uploaded, finished while the
    # big one was still being processed (on the event loop it would wait for all of the parsing and
    # redaction, ~0.6 s of CPU for 5 MB) and took a small part of its time.
    assert timings["small_done"] < timings["big_done"]
    assert small_latency < 0.5 * timings["big_latency"]


def raw_request(port: int, head: bytes, chunks: list[bytes] = (), timeout: float = 20.0) -> bytes:
    """Send `head` and then `chunks` on a raw socket (stopping if the server closes), and return
    whatever the server answered. Without the gateway's lingering close, a server that answers early
    and closes would reset the connection and the answer could be lost."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: what it said is in the receive buffer
        answer = b""
        try:
            while part := sock.recv(65536):
                answer += part
        except ConnectionResetError:
            pass
    return answer


def test_declared_length_over_the_limit_is_413_before_the_body_is_sent(gateway: Gateway) -> None:
    key = gateway.create_key(name="declared")
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {100 * LIMIT}\r\n\r\n").encode()
    started = time.monotonic()
    answer = raw_request(gateway.port, head)  # no body at all: refused on the header alone
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"code":"request_too_large"' in answer.replace(b" ", b"")
    assert time.monotonic() - started < 10


def test_chunked_body_over_the_limit_is_413(gateway: Gateway) -> None:
    key = gateway.create_key(name="chunked")
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n").encode()
    megabyte = b"a" * (1024 * 1024)
    chunks = [b"%x\r\n%s\r\n" % (len(megabyte), megabyte)] * 40 + [b"0\r\n\r\n"]  # 40 MB
    answer = raw_request(gateway.port, head, chunks)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"connection: close" in answer.lower()  # the rest of the body is never parsed
    # The gateway is fine afterwards.
    assert httpx.get(gateway.url + "/health", timeout=5).status_code == 200


def test_oversized_uploads_get_their_413_rather_than_a_reset(gateway: Gateway) -> None:
    """Clients still uploading when the gateway answers must get the answer: a plain close with
    their data unread resets the connection, and (with a few uploads at once) the 413 is lost."""
    key = gateway.create_key(name="uploader")
    oversized = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"a" * (LIMIT + 65536) + b'"}]}'

    async def upload(client: httpx.AsyncClient) -> int | str:
        try:
            response = await client.post("/v1/chat/completions", content=oversized,
                                         headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            return repr(exc)
        return response.status_code

    async def uploads() -> list[int | str]:
        async with httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": f"Bearer {key}"},
                                     timeout=60) as client:
            return await asyncio.gather(*(upload(client) for _ in range(12)))

    assert asyncio.run(uploads()) == [413] * 12
