"""Two gateway processes sharing one real Redis enforce one set of limits and share one cache."""

from __future__ import annotations

import secrets

import pytest

from tests.gateway.harness import FAKE, Gateway, GatewayFactory, Upstream, model_config, require_fake

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pair(gateways: GatewayFactory, upstreams: list[Upstream], redis_server: str, workdir) -> list[Gateway]:  # noqa: ANN001
    shared = {
        "models": [model_config("tiny", upstreams)],
        "redis_url": redis_server,
        # Both instances also share the key database, as a deployment would (PostgreSQL or one file).
        "database_url": f"sqlite:///{workdir / 'redis-shared.db'}",
    }
    return [gateways.start(shared, name="redis-1"), gateways.start(shared, name="redis-2")]


def ask(gateway: Gateway, key: str, content: str = "hello there", **extra: object):  # noqa: ANN201
    with gateway.client(key) as client:
        return client.post("/v1/chat/completions",
                           json={"model": "tiny", "messages": [{"role": "user", "content": content}], **extra})


def test_two_gateways_enforce_one_shared_rpm_limit(pair: list[Gateway]) -> None:
    key = pair[0].create_key(name="shared-rpm", rpm=4)
    statuses = [ask(pair[i % 2], key).status_code for i in range(4)]  # alternating instances
    assert statuses == [200, 200, 200, 200]
    for gateway in pair:  # each instance alone saw only 2, yet both refuse now
        refused = ask(gateway, key)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"


def test_two_gateways_share_one_tpm_limit(pair: list[Gateway]) -> None:
    require_fake()  # counts on the fake's token arithmetic
    # Each request reserves 32 ("hello there": 11 bytes + 16 template tokens, + max_tokens 5) in
    # Redis and settles to the 7 the fake reports: 0+32, 7+32, 14+32 fit under 50, 21+32 does not.
    key = pair[0].create_key(name="shared-tpm", tpm=50)
    statuses = [ask(pair[i % 2], key, max_tokens=5).status_code for i in range(5)]
    assert statuses == [200, 200, 200, 429, 429]


def test_two_gateways_share_the_response_cache(pair: list[Gateway], upstreams: list[Upstream]) -> None:
    key = pair[0].create_key(name="shared-cache")
    marker = f"shared cache {secrets.token_hex(4)}"
    first = ask(pair[0], key, marker, temperature=0)
    second = ask(pair[1], key, marker, temperature=0)
    assert (first.headers["x-kvik-cache"], second.headers["x-kvik-cache"]) == ("miss", "hit")
    assert second.content == first.content
    if FAKE:
        seen = [b for u in upstreams for b in u.received() if marker in repr(b.get("messages"))]
        assert len(seen) == 1
