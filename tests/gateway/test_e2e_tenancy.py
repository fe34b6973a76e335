"""Issue 10, finding 7: tenants do not share response-cache entries unless the operator opts in, and
each tenant's requests carry its own `cache_salt` upstream (prefix-cache isolation)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

import pytest

from tests.gateway.harness import Gateway, GatewayFactory, Upstream, model_config, require_fake

pytestmark = pytest.mark.timeout(180)

SALT_SECRET = "test-salt-secret"


@pytest.fixture(scope="module")
def gateway(gateways: GatewayFactory, upstreams: list[Upstream]) -> Gateway:
    return gateways.start({"models": [model_config("tiny", upstreams)],
                           "tenancy": {"cache_salt_secret": SALT_SECRET}}, name="tenancy")


def key(gateway: Gateway, name: str, **spec: object) -> dict:
    with gateway.admin() as admin:
        response = admin.post("/admin/keys", json={"name": name, **spec})
    assert response.status_code == 201, response.text
    return response.json()


def ask(gateway: Gateway, secret: str, content: str, **extra: object):  # noqa: ANN201
    with gateway.client(secret) as client:
        return client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0,
            **extra})


def expected_salt(tenant: str) -> str:
    return hmac.new(SALT_SECRET.encode(), tenant.encode(), hashlib.sha256).hexdigest()


def upstream_bodies(upstreams: list[Upstream], marker: str) -> list[dict]:
    return [b for u in upstreams for b in u.received() if marker in repr(b.get("messages"))]


def test_the_response_cache_is_scoped_to_the_tenant(gateway: Gateway) -> None:
    alice, bob = key(gateway, "alice"), key(gateway, "bob")
    carol, dave = key(gateway, "carol", team="acme"), key(gateway, "dave", team="acme")
    question = f"what did alice ask? {secrets.token_hex(4)}"
    cache = [ask(gateway, k["key"], question).headers["x-kvik-cache"] for k in (alice, alice, bob, carol, dave)]
    # Alice's second ask is her own hit; Bob learns nothing from her entry; a team shares its own.
    assert cache == ["miss", "hit", "miss", "miss", "hit"]


def test_each_tenant_gets_its_own_cache_salt_upstream(gateway: Gateway, upstreams: list[Upstream]) -> None:
    require_fake()
    alice, bob = key(gateway, "alice-salt"), key(gateway, "bob-salt")
    carol, dave = key(gateway, "carol-salt", team="blue"), key(gateway, "dave-salt", team="blue")
    marker = secrets.token_hex(4)
    for index, tenant in enumerate((alice, bob, carol, dave)):
        assert ask(gateway, tenant["key"], f"{marker} {index}", temperature=0.7).status_code == 200
    # A client's own salt cannot pick another tenant's prefix cache: the gateway's replaces it.
    forged = expected_salt(f"key:{alice['id']}")
    assert ask(gateway, bob["key"], f"{marker} forged", temperature=0.7, cache_salt=forged).status_code == 200
    salts = {b["messages"][0]["content"].split()[1]: b["cache_salt"] for b in upstream_bodies(upstreams, marker)}
    assert salts["0"] == expected_salt(f"key:{alice['id']}")
    assert salts["1"] == salts["forged"] == expected_salt(f"key:{bob['id']}")
    assert salts["2"] == salts["3"] == expected_salt("team:blue")
    assert len({salts["0"], salts["1"], salts["2"]}) == 3


def test_sharing_across_tenants_and_no_salt_are_explicit_options(gateways: GatewayFactory,
                                                                 upstreams: list[Upstream]) -> None:
    shared = gateways.start({"models": [model_config("tiny", upstreams)],
                             "cache": {"share_across_tenants": True}, "tenancy": {"cache_salt": False}},
                            name="tenancy-shared")
    alice, bob = key(shared, "alice"), key(shared, "bob")
    question = f"shared {secrets.token_hex(4)}"
    assert [ask(shared, k["key"], question).headers["x-kvik-cache"] for k in (alice, bob)] == ["miss", "hit"]
    require_fake()
    marker = secrets.token_hex(4)
    ask(shared, alice["key"], f"{marker} own salt", temperature=0.7, cache_salt="client-chosen")
    ask(shared, alice["key"], f"{marker} no salt", temperature=0.7)
    bodies = {b["messages"][0]["content"]: b for b in upstream_bodies(upstreams, marker)}
    assert bodies[f"{marker} own salt"]["cache_salt"] == "client-chosen"
    assert "cache_salt" not in bodies[f"{marker} no salt"]
