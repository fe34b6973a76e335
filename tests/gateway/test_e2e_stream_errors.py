"""Issue 10, finding 8 (gateway): an upstream stream that carries an error event, or that ends without
`data: [DONE]`, is a failure: the client sees an error event and no `[DONE]` (the official SDK
raises), nothing is cached, the breaker counts it, and the usage row says 502."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import openai
import pytest

from kvik.bench.load import SSE_LINE_END
from tests.gateway.harness import Gateway, GatewayFactory, Upstream, model_config, require_fake

pytestmark = pytest.mark.timeout(180)

# The shapes a failed upstream stream takes: kvik serve before issue 10 (an error event, then usage
# and [DONE]), the fixed server (an error event, then the connection closes), and a stream that just
# stops (no error, no [DONE]).
MODES = ("error_then_done", "error_then_close", "close")


@pytest.fixture(scope="module")
def gateway(gateways: GatewayFactory, upstreams: list[Upstream]) -> Iterator[Gateway]:
    require_fake()
    for upstream in upstreams:
        upstream.reset()
    yield gateways.start({"models": [model_config("tiny", upstreams)],
                          "breaker": {"consecutive_failures": 2, "sleep_window_s": 60}}, name="stream-errors")
    for upstream in upstreams:
        upstream.reset()


def data_lines(text: str) -> list[str]:
    # SSE lines end at CR, LF or CRLF only (str.splitlines() also splits at U+2028 inside JSON).
    return [line[len("data: "):] for line in SSE_LINE_END.split(text) if line.startswith("data: ")]


@pytest.mark.parametrize("mode", MODES)
def test_a_broken_upstream_stream_is_a_failure_everywhere(gateway: Gateway, upstreams: list[Upstream],
                                                          mode: str) -> None:
    for upstream in upstreams:
        upstream.reset()
        upstream.control(stream_fail_after=2, stream_fail_mode=mode)
    with gateway.admin() as admin:
        key = admin.post("/admin/keys", json={"name": f"broken-{mode}"}).json()
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"greedy {secrets.token_hex(4)}"}],
            "max_tokens": 6, "temperature": 0, "stream": True}
    with gateway.client(key["key"]) as client:
        answers = [client.post("/v1/chat/completions", json=body) for _ in range(2)]
    for answer in answers:
        assert answer.status_code == 200  # the headers went out before the failure
        events = data_lines(answer.text)
        assert "[DONE]" not in events, events
        assert sum('"content"' in e for e in events) == 2  # what the replica produced, then the error
        assert "error" in json.loads(events[-1])
    # Not cached: the second identical greedy request went upstream again.
    assert [a.headers["x-kvik-cache"] for a in answers] == ["miss", "miss"]
    with gateway.admin() as admin:
        rows = admin.get("/admin/usage", params={"key_id": key["id"], "group_by": "key,status"}).json()["data"]
    assert [(r["status"], r["requests"], r["completion_tokens"]) for r in rows] == [(502, 2, 4)]

    # The official SDK raises instead of returning a truncated answer.
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key["key"], max_retries=0, timeout=30)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(**{**body, "temperature": 0.5}):
            pass


def test_broken_streams_count_against_the_breaker(gateway: Gateway, upstreams: list[Upstream]) -> None:
    # The module's failed streams (two failures in a row trip a breaker) ejected one replica; the
    # pool's cap keeps the other.
    assert gateway.metric("kvik_gateway_breaker_transitions_total", state="open") >= 1
    assert sorted(r["breaker"] for r in gateway.replicas().values()) in (["closed", "open"],
                                                                         ["closed", "half_open"])
