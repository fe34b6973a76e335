"""Issue 10, finding 3: one tenant cannot open every circuit breaker. A request that makes every
replica fail is the request's fault, not the replicas'; 4xx are never retried; and the breakers of a
pool never eject all of it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.harness import Gateway, GatewayFactory, Upstream, model_config, require_fake, wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def gateway(gateways: GatewayFactory, upstreams: list[Upstream]) -> Iterator[Gateway]:
    require_fake()
    for upstream in upstreams:
        upstream.reset()
    # Three failures in a row open a breaker, and it stays open for the whole module.
    yield gateways.start({
        "auth": {"enabled": False, "admin_key": "env:KVIK_TEST_ADMIN_KEY"},
        "models": [model_config("tiny", upstreams)],
        "breaker": {"consecutive_failures": 3, "sleep_window_s": 60},
        "timeouts": {"first_byte_s": 0.5},
        "cache": {"enabled": False},
    }, name="breaker")
    for upstream in upstreams:
        upstream.reset()


def chat(content: str, **extra: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def breakers(gateway: Gateway) -> dict[str, str]:
    return {url: state["breaker"] for url, state in gateway.replicas().items()}


def test_a_request_every_replica_fails_on_opens_no_breaker(gateway: Gateway, upstreams: list[Upstream]) -> None:
    for upstream in upstreams:
        upstream.control(fail_when_contains="POISON", fail_status=500)
    with gateway.client() as client:
        poisoned = [client.post("/v1/chat/completions", json=chat(f"POISON {i}")) for i in range(10)]
        # The replicas' own answer reaches the client; each replica saw each request at most once.
        assert [r.status_code for r in poisoned] == [500] * 10
        assert all("cannot handle this request" in r.json()["error"]["message"] for r in poisoned)
        assert sum(1 for u in upstreams for b in u.received() if "POISON" in repr(b)) == 20
        assert breakers(gateway) == {u.url: "closed" for u in upstreams}
        assert gateway.metric("kvik_gateway_breaker_transitions_total", state="open") == 0
        good = [client.post("/v1/chat/completions", json=chat(f"fine {i}")) for i in range(6)]
    assert [r.status_code for r in good] == [200] * 6
    assert {r.json()["system_fingerprint"] for r in good} == {u.name for u in upstreams}  # both still serve


def test_a_client_error_is_answered_at_once_and_never_retried(gateway: Gateway,
                                                              upstreams: list[Upstream]) -> None:
    for upstream in upstreams:
        upstream.reset()
    retries = gateway.metric("kvik_gateway_retries_total")
    with gateway.client() as client:
        bad = client.post("/v1/chat/completions", json=chat("bad temperature", temperature=-1))
    assert bad.status_code == 400
    assert sum(1 for u in upstreams for b in u.received() if "bad temperature" in repr(b)) == 1
    assert gateway.metric("kvik_gateway_retries_total") == retries
    assert breakers(gateway) == {u.url: "closed" for u in upstreams}


def test_a_broken_replica_is_ejected_but_never_the_last_one(gateway: Gateway, upstreams: list[Upstream]) -> None:
    broken, healthy = upstreams
    for upstream in upstreams:
        upstream.reset()
    # A 5xx that the other replica does not reproduce is the replica's fault.
    broken.control(fail_status=500, fail_count=None)
    with gateway.client() as client:
        answers = [client.post("/v1/chat/completions", json=chat(f"failover {i}")) for i in range(8)]
    assert [r.status_code for r in answers] == [200] * 8
    assert breakers(gateway) == {broken.url: "open", healthy.url: "closed"}

    # Now the survivor hangs too (every stream times out before its first byte): it counts failures
    # but is not ejected, since it is the last replica standing.
    healthy.control(delay_s=5)
    with gateway.client() as client:
        timed_out = [client.post("/v1/chat/completions", json=chat(f"hang {i}", stream=True)) for i in range(5)]
    assert [r.status_code for r in timed_out] == [502] * 5, [r.text for r in timed_out]
    assert breakers(gateway) == {broken.url: "open", healthy.url: "closed"}
    healthy.reset()
    broken.reset()
    with gateway.client() as client:
        assert client.post("/v1/chat/completions", json=chat("back")).status_code == 200
    wait_for(lambda: gateway.replicas()[healthy.url]["outstanding"] == 0)
