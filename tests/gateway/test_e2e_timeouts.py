"""Issue 10, findings 5 and 6: a hung replica (a real process, SIGSTOPped) does not hang its clients,
a stream that stalls after its first event ends with an error event, and a client that leaves a
non-streaming request makes the gateway close the upstream request."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import Gateway, GatewayFactory, Upstream, free_port, model_config, require_fake, wait_for
from tests.support.sse import sse_lines

pytestmark = pytest.mark.timeout(240)

CLIENT_TIMEOUT_S = 15.0  # far below read_s (30 s), the only bound the gateway had before


@pytest.fixture(scope="module")
def replicas(workdir: Path) -> Iterator[list[Upstream]]:
    """Replicas of this module only: they get stopped and continued."""
    require_fake()
    pair = [Upstream(name, free_port(), workdir) for name in ("ta", "tb")]
    for upstream in pair:
        upstream.start()
    yield pair
    for upstream in pair:
        resume(upstream)
        upstream.stop()


def stop(upstream: Upstream) -> None:
    assert upstream.process is not None
    os.kill(upstream.process.pid, signal.SIGSTOP)


def resume(upstream: Upstream) -> None:
    if upstream.process is not None and upstream.process.poll() is None:
        os.kill(upstream.process.pid, signal.SIGCONT)


def start(gateways: GatewayFactory, replicas: list[Upstream], name: str, **settings: object) -> Gateway:
    return gateways.start({"auth": {"enabled": False, "admin_key": "env:KVIK_TEST_ADMIN_KEY"},
                           "models": [model_config("tiny", replicas)], "cache": {"enabled": False},
                           **settings}, name=name)


def chat(content: str, **extra: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 3, **extra}


async def concurrently(url: str, bodies: list[dict]) -> list[tuple[int, str, float]]:
    """POST all bodies at once; (status, body text, seconds) each."""
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        async def one(body: dict) -> tuple[int, str, float]:
            started = time.monotonic()
            response = await client.post("/v1/chat/completions", json=body)
            return response.status_code, response.text, time.monotonic() - started

        return await asyncio.gather(*(one(body) for body in bodies))


def test_streams_fail_over_when_the_first_byte_is_late(gateways: GatewayFactory, replicas: list[Upstream]) -> None:
    # Probes effectively off: only the first-byte timeout can rescue these requests.
    gateway = start(gateways, replicas, "ttfb", timeouts={"first_byte_s": 1.0, "read_s": 30.0},
                    health={"interval_s": 60.0})
    hung, _ = replicas
    stop(hung)
    try:
        results = asyncio.run(concurrently(gateway.url, [chat(f"stream {i}", stream=True) for i in range(6)]))
    finally:
        resume(hung)
    for status, text, _ in results:
        assert status == 200 and text.rstrip().endswith("data: [DONE]"), text
    assert gateway.metric("kvik_gateway_retries_total", reason="first_byte_timeout") >= 1
    print(f"\nfirst-byte failover: slowest of 6 streams {max(s for _, _, s in results):.1f} s")


@pytest.fixture(scope="module")
def probing_gateway(gateways: GatewayFactory, replicas: list[Upstream]) -> Gateway:
    # Long timeouts: the health probes, which mark a stopped replica down in about a second, are
    # what moves its waiting requests (a non-streaming answer has no first-byte bound).
    return start(gateways, replicas, "probes", timeouts={"first_byte_s": 30.0, "read_s": 30.0},
                 health={"interval_s": 0.3, "timeout_s": 0.5, "unhealthy_after": 2})


def test_requests_on_a_replica_marked_down_fail_over(probing_gateway: Gateway, replicas: list[Upstream]) -> None:
    gateway = probing_gateway
    hung, _ = replicas
    wait_for(lambda: all(r["healthy"] for r in gateway.replicas().values()))
    stop(hung)
    try:
        bodies = [chat(f"plain {i}") for i in range(4)] + [chat(f"streamed {i}", stream=True) for i in range(2)]
        results = asyncio.run(concurrently(gateway.url, bodies))
    finally:
        resume(hung)
    assert [status for status, _, _ in results] == [200] * 6, results
    assert gateway.metric("kvik_gateway_retries_total", reason="replica_down") >= 1
    wait_for(lambda: gateway.replicas()[hung.url]["healthy"])


def test_a_stream_that_stalls_after_its_first_event_ends_with_an_error(gateways: GatewayFactory,
                                                                       replicas: list[Upstream]) -> None:
    gateway = start(gateways, replicas, "stall", timeouts={"first_byte_s": 30.0, "read_s": 2.0},
                    health={"interval_s": 60.0})
    for upstream in replicas:
        upstream.control(chunk_delay_s=0.3)
    try:
        with httpx.Client(base_url=gateway.url, timeout=CLIENT_TIMEOUT_S) as client, client.stream(
                "POST", "/v1/chat/completions", json=chat("stall", stream=True, max_tokens=40)) as response:
            lines = sse_lines(response)
            first = next(line for line in lines if line.startswith("data: "))
            serving = next(u for u in replicas if f'"system_fingerprint": "{u.name}"' in first)
            stop(serving)
            rest = [line for line in lines if line.startswith("data: ")]
    finally:
        for upstream in replicas:
            resume(upstream)
            upstream.reset()
    assert "data: [DONE]" not in rest
    error = json.loads(rest[-1][len("data: "):])["error"]
    assert error["code"] == "upstream_error" and "stopped sending" in error["message"]


def test_a_client_that_leaves_a_non_streaming_request_aborts_it_upstream(probing_gateway: Gateway,
                                                                         replicas: list[Upstream]) -> None:
    gateway = probing_gateway
    for upstream in replicas:
        upstream.reset()
        upstream.control(delay_s=20)  # a long generation
    try:
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=gateway.url, timeout=1.0) as client:
            client.post("/v1/chat/completions", json=chat("leave early"))
        # The replica sees its client (the gateway) go away within moments, not after 20 s.
        wait_for(lambda: sum(httpx.get(u.url + "/_received", timeout=5).json()["disconnects"] for u in replicas) == 1,
                 timeout=8)
    finally:
        for upstream in replicas:
            upstream.reset()
    wait_for(lambda: all(r["outstanding"] == 0 for r in gateway.replicas().values()))
