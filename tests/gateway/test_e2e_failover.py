"""Failover, retries and the circuit breaker, with a replica killed by SIGKILL mid-load."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.fake_upstream import RETRY_AFTER_S
from tests.gateway.harness import Gateway, GatewayFactory, Upstream, free_port, model_config, require_fake, wait_for
from tests.support.sse import sse_lines

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def replicas(workdir: Path) -> Iterator[list[Upstream]]:
    """Replicas of this module only: one of them gets killed."""
    pair = [Upstream(name, free_port(), workdir) for name in ("fa", "fb")]
    for upstream in pair:
        upstream.start()
    yield pair
    for upstream in pair:
        upstream.stop()


@pytest.fixture(scope="module")
def gateway(gateways: GatewayFactory, replicas: list[Upstream]) -> Gateway:
    return gateways.start({
        "auth": {"enabled": False, "admin_key": "env:KVIK_TEST_ADMIN_KEY"},
        "models": [model_config("tiny", replicas)],
        # The documented defaults, except a shorter sleep window to keep the test short.
        "breaker": {"volume_threshold": 20, "error_threshold_percent": 50, "sleep_window_s": 2.0},
        "retries": {"max_attempts": 3},
        # Probes far apart: on a busy machine the load below can take longer than two default probe
        # intervals, and a replica marked down by probes gets no traffic for its breaker to count.
        "health": {"interval_s": 60.0},
    }, name="failover")


def body(i: int, **extra: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"load {i}"}], "max_tokens": 2, **extra}


async def load(url: str, n: int, concurrency: int, after: int, action) -> list[httpx.Response]:  # noqa: ANN001
    """Send `n` requests, `concurrency` at a time; call `action()` once `after` of them finished."""
    limit = asyncio.Semaphore(concurrency)
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async def one(i: int) -> httpx.Response:
            nonlocal done
            async with limit:
                response = await client.post("/v1/chat/completions", json=body(i))
            done += 1
            if done == after:
                action()
            return response

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_kill9_during_load_loses_no_request_and_the_breaker_opens_then_closes(
        gateway: Gateway, replicas: list[Upstream]) -> None:
    alive, victim = replicas
    try:
        responses = asyncio.run(load(gateway.url, 100, 8, 25, victim.kill9))
    except httpx.HTTPError:
        exits = {p.url: p.process.poll() for p in (gateway, alive, victim) if p.process is not None}
        raise AssertionError(f"exit codes: {exits}\n{gateway.log_tail()}") from None
    statuses = [r.status_code for r in responses]
    assert statuses == [200] * 100, [(r.status_code, r.text) for r in responses if r.status_code != 200]

    # The dead replica's breaker opened (the transition is counted even if it is half-open by now).
    # Which requests reach the dead replica depends on timing; more traffic (all of it answered) makes
    # the breaker's volume threshold certain to be reached.
    def opened() -> bool:
        with gateway.client() as client:
            assert client.post("/v1/chat/completions", json=body(0)).status_code == 200
        return gateway.metric("kvik_gateway_breaker_transitions_total", replica=victim.url, state="open") >= 1

    try:
        wait_for(opened, timeout=20, interval=0.05)
    except AssertionError:
        raise AssertionError(f"no breaker opened: {gateway.replicas()}\n{gateway.log_tail()}") from None
    assert gateway.replicas()[victim.url]["breaker"] in ("open", "half_open")
    assert gateway.metric("kvik_gateway_retries_total", reason="connect_error") >= 1

    victim.start()  # same port, fresh process

    def closed_again() -> bool:
        with gateway.client() as client:
            assert client.post("/v1/chat/completions", json=body(0)).status_code == 200
        state = gateway.replicas()[victim.url]
        return state["healthy"] and state["breaker"] == "closed"

    wait_for(closed_again, timeout=30, interval=0.2)
    assert gateway.metric("kvik_gateway_breaker_state", replica=victim.url) == 0
    assert gateway.metric("kvik_gateway_breaker_transitions_total", replica=victim.url, state="closed") >= 1


def test_5xx_and_429_are_retried_on_the_other_replica(gateway: Gateway, replicas: list[Upstream]) -> None:
    require_fake()
    failing, _ = replicas
    for upstream in replicas:
        upstream.reset()
    wait_for(lambda: all(r["healthy"] and r["breaker"] == "closed" for r in gateway.replicas().values()))
    with gateway.client() as client:
        for status in (500, 503, 429):
            failing.control(fail_status=status, fail_count=None)
            before = gateway.metric("kvik_gateway_retries_total", reason=f"status_{status}")
            # Ties rotate, so one of two back-to-back requests tries the failing replica first; the
            # retry lands on the other one and the client never sees the failure.
            response = client.post("/v1/chat/completions", json=body(status))
            assert response.status_code == 200, response.text
            stream = client.post("/v1/chat/completions", json=body(status, stream=True))
            assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
            assert gateway.metric("kvik_gateway_retries_total", reason=f"status_{status}") > before
            failing.reset()


def test_when_every_replica_fails_the_client_gets_an_openai_error(gateway: Gateway,
                                                                  replicas: list[Upstream]) -> None:
    require_fake()
    for upstream in replicas:
        upstream.reset()
        upstream.control(fail_status=500, fail_count=None)
    try:
        with gateway.client() as client:
            response = client.post("/v1/chat/completions", json=body(1))
        assert response.status_code == 500
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    finally:
        for upstream in replicas:
            upstream.reset()


def test_when_every_replica_is_overloaded_the_client_gets_its_retry_after(gateway: Gateway,
                                                                         replicas: list[Upstream]) -> None:
    require_fake()
    for upstream in replicas:
        upstream.reset()
        upstream.control(fail_status=503, fail_count=2)  # each request tries both replicas
    with gateway.client() as client:
        response = client.post("/v1/chat/completions", json=body(2))
        streamed = client.post("/v1/chat/completions", json=body(3, stream=True))
    for answer in (response, streamed):  # the replicas' own answer and hint, not the gateway's
        assert answer.status_code == 503 and answer.headers["retry-after"] == str(RETRY_AFTER_S)
        assert answer.json()["error"]["message"].endswith("told to fail")
    for upstream in replicas:
        upstream.reset()

    def all_closed() -> bool:  # 503s count against the breakers; successes close them again
        with gateway.client() as client:
            assert client.post("/v1/chat/completions", json=body(4)).status_code == 200
        return all(r["breaker"] == "closed" for r in gateway.replicas().values())

    wait_for(all_closed, timeout=30, interval=0.2)


def test_replica_dying_mid_stream_ends_the_stream_with_an_error_event(gateway: Gateway,
                                                                      replicas: list[Upstream]) -> None:
    require_fake()
    for upstream in replicas:
        upstream.reset()
        upstream.control(chunk_delay_s=0.2)
    wait_for(lambda: all(r["healthy"] and r["breaker"] == "closed" for r in gateway.replicas().values()))
    with gateway.client() as client, client.stream(
            "POST", "/v1/chat/completions", json=body(0, stream=True, max_tokens=30)) as response:
        lines = sse_lines(response)
        first = next(lines)
        serving = next(u for u in replicas if f'"system_fingerprint": "{u.name}"' in first)
        serving.kill9()  # bytes already reached the client: no failover possible, but no hang either
        rest = [line for line in lines if line.startswith("data: ")]
    assert "data: [DONE]" not in rest  # a failed stream never looks finished
    error = json.loads(rest[-1][len("data: "):])["error"]
    assert error["code"] == "upstream_error" and error["type"] == "server_error"
    serving.start()
    wait_for(lambda: gateway.replicas()[serving.url]["outstanding"] == 0)
