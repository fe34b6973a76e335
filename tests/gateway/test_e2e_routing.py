"""Routing and load balancing through a real gateway process to two real upstream processes."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from tests.gateway.harness import FAKE, Gateway, GatewayFactory, Upstream, model_config, require_fake, wait_for
from tests.support.sse import sse_lines

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def gateway(gateways: GatewayFactory, upstreams: list[Upstream]) -> Gateway:
    a, b = upstreams
    return gateways.start({
        "auth": {"enabled": False, "admin_key": "env:KVIK_TEST_ADMIN_KEY"},
        "models": [
            model_config("tiny", upstreams, aliases=["tiny-latest"]),
            model_config("tiny-affine", upstreams, balancing="prefix_affinity"),
            {"name": "tiny-wrr", "upstream_model": "tiny", "balancing": "weighted_round_robin",
             "replicas": [{"url": a.url, "weight": 1}, {"url": b.url, "weight": 3}]},
        ],
    }, name="routing")


@pytest.fixture(autouse=True)
def fresh_upstreams(upstreams: list[Upstream]) -> None:
    for upstream in upstreams:
        upstream.reset()


def chat(model: str, content: str, **extra: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3, **extra}


async def send_many(url: str, bodies: list[dict], concurrency: int) -> list[httpx.Response]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async def one(body: dict) -> httpx.Response:
            async with limit:
                return await client.post("/v1/chat/completions", json=body)

        return await asyncio.gather(*(one(body) for body in bodies))


def test_least_outstanding_spreads_200_requests_evenly(gateway: Gateway, upstreams: list[Upstream]) -> None:
    if FAKE:
        # Like a model replica, each answer takes a while: replica speed is then set by that, not by
        # which process the busy 2-core test machine happens to schedule (least outstanding requests
        # rightly favours the replica that finishes faster).
        for upstream in upstreams:
            upstream.control(delay_s=0.02)
    responses = asyncio.run(send_many(gateway.url, [chat("tiny", f"spread {i}") for i in range(200)], 8))
    assert [r.status_code for r in responses] == [200] * 200
    # Counted where the requests landed, by the gateway (works with any upstream) ...
    with gateway.admin() as admin:
        rows = admin.get("/admin/usage", params={"group_by": "model,replica"}).json()["data"]
    per_replica = {row["replica"]: row["requests"] for row in rows if row["model"] == "tiny"}
    assert set(per_replica) == {u.url for u in upstreams}
    assert all(80 <= n <= 120 for n in per_replica.values()), per_replica  # within 20 % of 100
    if FAKE:  # ... and by the upstreams themselves.
        assert {u.url: len(u.received()) for u in upstreams} == per_replica


def test_prefix_affinity_keeps_a_conversation_on_one_replica(gateway: Gateway, upstreams: list[Upstream]) -> None:
    require_fake()  # the fake names itself in `system_fingerprint`
    homes: dict[int, set[str]] = {}
    with gateway.client() as client:
        for conversation in range(16):
            messages = [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": f"conversation {conversation}: hello"}]
            for turn in range(4):
                response = client.post("/v1/chat/completions", json={"model": "tiny-affine", "messages": messages})
                assert response.status_code == 200
                reply = response.json()
                homes.setdefault(conversation, set()).add(reply["system_fingerprint"])
                messages += [reply["choices"][0]["message"], {"role": "user", "content": f"turn {turn}"}]
    assert all(len(replicas) == 1 for replicas in homes.values()), homes
    assert Counter(next(iter(r)) for r in homes.values()).keys() == {"a", "b"}  # still spread over both


def test_prefix_affinity_falls_back_when_the_affine_replica_is_down(gateway: Gateway,
                                                                    upstreams: list[Upstream]) -> None:
    require_fake()
    body = {"model": "tiny-affine", "messages": [{"role": "user", "content": "sticky conversation"}]}
    with gateway.client() as client:
        home = client.post("/v1/chat/completions", json=body).json()["system_fingerprint"]
        home_upstream = next(u for u in upstreams if u.name == home)
        home_upstream.control(healthy=False)
        try:
            wait_for(lambda: not gateway.replicas("tiny-affine")[home_upstream.url]["healthy"])
            moved = client.post("/v1/chat/completions", json=body)
            assert moved.status_code == 200 and moved.json()["system_fingerprint"] != home
        finally:
            home_upstream.control(healthy=True)
        wait_for(lambda: gateway.replicas("tiny-affine")[home_upstream.url]["healthy"])
        assert client.post("/v1/chat/completions", json=body).json()["system_fingerprint"] == home


def test_weighted_round_robin_follows_weights(gateway: Gateway, upstreams: list[Upstream]) -> None:
    require_fake()
    with gateway.client() as client:
        for i in range(40):
            assert client.post("/v1/chat/completions", json=chat("tiny-wrr", f"w{i}")).status_code == 200
    a, b = upstreams
    assert (len(a.received()), len(b.received())) == (10, 30)


def test_streaming_is_relayed_chunk_by_chunk(gateway: Gateway, upstreams: list[Upstream]) -> None:
    require_fake()
    for upstream in upstreams:
        upstream.control(chunk_delay_s=0.25)
    arrivals: list[float] = []
    started = time.monotonic()
    with gateway.client() as client, client.stream(
            "POST", "/v1/chat/completions", json=chat("tiny", "stream please", stream=True, max_tokens=6)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in sse_lines(response):
            if line.startswith("data: "):
                arrivals.append(time.monotonic() - started)
                last = line
    assert last == "data: [DONE]"
    # 6 words at 0.25 s each: a buffering proxy would deliver everything at once after ~1.5 s.
    assert arrivals[0] < 0.6 and arrivals[-1] > 1.2, arrivals
    assert arrivals[3] - arrivals[0] > 0.5, arrivals
    # The gateway asked the upstream for usage (to count tokens) but the client did not get that chunk.
    sent = [b for u in upstreams for b in u.received()]
    assert sent[0]["stream_options"] == {"include_usage": True}


def test_client_leaving_mid_stream_releases_the_replica(gateway: Gateway, upstreams: list[Upstream]) -> None:
    require_fake()
    for upstream in upstreams:
        upstream.control(chunk_delay_s=0.2)
    with gateway.client() as client, client.stream(
            "POST", "/v1/chat/completions", json=chat("tiny", "leave early", stream=True, max_tokens=50)) as response:
        lines = sse_lines(response)  # held: dropping the iterator would close the connection
        assert next(lines).startswith("data: ")
        assert sum(r["outstanding"] for r in gateway.replicas().values()) == 1
    # Closing the connection must close the upstream stream and free the slot, long before the
    # upstream would have finished its 50 chunks (10 s).
    wait_for(lambda: sum(r["outstanding"] for r in gateway.replicas().values()) == 0, timeout=5)
    with gateway.admin() as admin:
        statuses = admin.get("/admin/usage", params={"group_by": "status"}).json()["data"]
    assert any(row["status"] == 499 for row in statuses)


def test_models_aliases_and_unknown_models(gateway: Gateway) -> None:
    with gateway.client() as client:
        listed = client.get("/v1/models").json()
        assert {m["id"] for m in listed["data"]} == {"tiny", "tiny-affine", "tiny-wrr"}
        assert next(m for m in listed["data"] if m["id"] == "tiny")["aliases"] == ["tiny-latest"]
        assert client.post("/v1/chat/completions", json=chat("tiny-latest", "alias")).status_code == 200
        missing = client.post("/v1/chat/completions", json=chat("gpt-9", "x"))
        assert missing.status_code == 404
        assert missing.json() == {"error": {"message": missing.json()["error"]["message"],
                                            "type": "invalid_request_error", "param": "model",
                                            "code": "model_not_found"}}
        bad = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        no_messages = client.post("/v1/chat/completions", json={"model": "tiny"})
        assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"
        assert client.get("/v1/nope").status_code == 404
        completion = client.post("/v1/completions", json={"model": "tiny", "prompt": "once upon", "max_tokens": 2})
        assert completion.status_code == 200 and completion.json()["object"] == "text_completion"

