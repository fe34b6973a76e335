"""Issue 10, finding 4: token budgets and TPM cannot be dodged. A stream the client drops is charged
for what was relayed; concurrent requests see each other's reservations."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.harness import Gateway, GatewayFactory, Upstream, model_config, require_fake
from tests.support.sse import sse_lines

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def gateway(gateways: GatewayFactory, upstreams: list[Upstream]) -> Iterator[Gateway]:
    require_fake()
    for upstream in upstreams:
        upstream.reset()
    yield gateways.start({"models": [model_config("tiny", upstreams)], "cache": {"enabled": False}},
                         name="tokens")
    for upstream in upstreams:
        upstream.reset()


def chat(content: str, **extra: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


def usage_rows(gateway: Gateway, key_id: str) -> list[dict]:
    with gateway.admin() as admin:
        return admin.get("/admin/usage", params={"key_id": key_id, "group_by": "key,status"}).json()["data"]


def read_then_drop(gateway: Gateway, key: str, events: int) -> tuple[int, int]:
    """Open a stream, read `events` content events, then leave. Returns (status, events read)."""
    read = 0
    with gateway.client(key) as client, client.stream(
            "POST", "/v1/chat/completions", json=chat("count to fifty", max_tokens=50, stream=True)) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, 0
        for line in sse_lines(response):
            if line.startswith("data: ") and '"content"' in line:
                read += 1
                if read == events:
                    break
    return 200, read


def test_dropping_streams_does_not_dodge_the_token_budget(gateway: Gateway, upstreams: list[Upstream]) -> None:
    for upstream in upstreams:
        upstream.control(chunk_delay_s=0.05)
    with gateway.admin() as admin:
        key = admin.post("/admin/keys", json={"name": "dropper", "token_budget": 100}).json()
    outcomes = [read_then_drop(gateway, key["key"], events=3) for _ in range(12)]
    statuses = [status for status, _ in outcomes]
    admitted = statuses.count(200)
    # Each dropped stream is charged its prompt (estimated from above) and the tokens relayed, so
    # the budget runs out after a few streams instead of never.
    assert 1 <= admitted <= 3, statuses
    assert statuses[admitted:] == [429] * (12 - admitted)
    rows = {row["status"]: row for row in usage_rows(gateway, key["id"])}
    dropped = rows[499]
    assert dropped["requests"] == admitted
    assert dropped["completion_tokens"] >= sum(read for _, read in outcomes)
    assert dropped["total_tokens"] >= 100 - 50  # what is left cannot cover another max_tokens of 50


def test_thirty_concurrent_requests_do_not_all_pass_a_tpm_of_200(gateway: Gateway,
                                                                 upstreams: list[Upstream]) -> None:
    for upstream in upstreams:
        upstream.reset()
        upstream.control(delay_s=0.5)  # all thirty are in flight together
    with gateway.admin() as admin:
        key = admin.post("/admin/keys", json={"name": "burst", "tpm": 200}).json()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30,
                                     headers={"Authorization": f"Bearer {key['key']}"}) as client:
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(f"word {i}", max_tokens=30))
                                          for i in range(30)))

    statuses = [r.status_code for r in asyncio.run(burst())]
    for upstream in upstreams:
        upstream.reset()
    # Each reserves its prompt (6 bytes + 16 template tokens) + 30: 52, so three fit in 200; the fake
    # then reports 2 + 30 = 32 each.
    assert statuses.count(200) == 3 and statuses.count(429) == 27, statuses
    rows = {row["status"]: row for row in usage_rows(gateway, key["id"])}
    assert rows[200]["total_tokens"] == 3 * 32 <= 200
