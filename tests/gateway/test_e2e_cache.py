"""The response cache through a real gateway: deterministic requests hit, sampled ones never do."""

from __future__ import annotations

import secrets

import pytest

from tests.gateway.harness import Gateway, Upstream, require_fake

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def key(standard_gateway: Gateway) -> str:
    return standard_gateway.create_key(name="cache-tests")


def ask(gateway: Gateway, key: str, content: str, headers: dict | None = None, **extra: object):  # noqa: ANN201
    with gateway.client(key) as client:
        return client.post("/v1/chat/completions", headers=headers or {},
                           json={"model": "tiny", "messages": [{"role": "user", "content": content}], **extra})


def times_seen(upstreams: list[Upstream], content: str) -> int:
    return sum(1 for u in upstreams for b in u.received() if b.get("messages", [{}])[0].get("content") == content)


def test_repeated_deterministic_request_is_served_from_cache(standard_gateway: Gateway, key: str,
                                                             upstreams: list[Upstream]) -> None:
    require_fake()
    marker = f"greedy {secrets.token_hex(4)}"
    first = ask(standard_gateway, key, marker, temperature=0)
    second = ask(standard_gateway, key, marker, temperature=0)
    via_alias = ask(standard_gateway, key, marker, temperature=0, model="tiny-latest")
    assert [r.headers["x-kvik-cache"] for r in (first, second, via_alias)] == ["miss", "hit", "hit"]
    assert second.content == first.content and second.status_code == 200
    assert times_seen(upstreams, marker) == 1
    assert standard_gateway.metric("kvik_gateway_cache_lookups_total", result="hit") >= 2


def test_fixed_seed_is_cached_even_when_sampling(standard_gateway: Gateway, key: str,
                                                 upstreams: list[Upstream]) -> None:
    require_fake()
    marker = f"seeded {secrets.token_hex(4)}"
    responses = [ask(standard_gateway, key, marker, temperature=0.9, seed=11) for _ in range(2)]
    assert [r.headers["x-kvik-cache"] for r in responses] == ["miss", "hit"]
    assert times_seen(upstreams, marker) == 1


def test_sampled_request_without_seed_is_never_cached(standard_gateway: Gateway, key: str,
                                                      upstreams: list[Upstream]) -> None:
    require_fake()
    marker = f"sampled {secrets.token_hex(4)}"
    for extra in ({}, {"temperature": 0.7}, {}):
        response = ask(standard_gateway, key, marker, **extra)
        assert response.status_code == 200 and response.headers["x-kvik-cache"] == "bypass"
    assert times_seen(upstreams, marker) == 3


def test_clients_can_opt_out(standard_gateway: Gateway, key: str, upstreams: list[Upstream]) -> None:
    require_fake()
    marker = f"opt-out {secrets.token_hex(4)}"
    ask(standard_gateway, key, marker, temperature=0)
    assert ask(standard_gateway, key, marker, {"x-kvik-cache": "no-store"}, temperature=0).headers[
        "x-kvik-cache"] == "bypass"
    assert ask(standard_gateway, key, marker, {"cache-control": "no-cache"}, temperature=0).headers[
        "x-kvik-cache"] == "miss"
    assert times_seen(upstreams, marker) == 3


def test_streamed_deterministic_request_replays_the_same_events(standard_gateway: Gateway, key: str,
                                                                upstreams: list[Upstream]) -> None:
    require_fake()
    marker = f"stream {secrets.token_hex(4)}"
    first = ask(standard_gateway, key, marker, temperature=0, stream=True)
    second = ask(standard_gateway, key, marker, temperature=0, stream=True)
    assert (first.headers["x-kvik-cache"], second.headers["x-kvik-cache"]) == ("miss", "hit")
    assert second.text == first.text and first.text.rstrip().endswith("data: [DONE]")
    assert second.headers["content-type"].startswith("text/event-stream")
    assert '"usage"' not in first.text  # the usage chunk the gateway asked for is not passed on
    assert times_seen(upstreams, marker) == 1
