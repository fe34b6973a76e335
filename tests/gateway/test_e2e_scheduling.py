"""Priority tiers and fair-share weights of keys: the gateway overwrites the scheduling fields of
every request from the caller's key (a client cannot raise its own priority or pose as another
tenant), and the Batch API through the gateway with keys, isolation and usage (real `kvik serve`)."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import time

import httpx
import openai
import pytest

from tests.gateway.harness import Gateway, GatewayFactory, KvikServe, Upstream, free_port, model_config, require_fake

pytestmark = pytest.mark.timeout(600)

SECRET = "scheduling-test-secret"


@pytest.fixture(scope="module")
def gateway(gateways: GatewayFactory, upstreams: list[Upstream]) -> Gateway:
    return gateways.start({"models": [model_config("tiny", upstreams[:1])],
                           "tenancy": {"cache_salt_secret": SECRET}}, name="scheduling")


def pseudonym(tenant: str) -> str:
    """What the replicas know a tenant by (an HMAC under the gateway's secret; never the key id)."""
    return "t-" + hmac.new(SECRET.encode(), f"fair-share\0{tenant}".encode(), hashlib.sha256).hexdigest()[:16]


def test_scheduling_fields_come_from_the_key_never_from_the_client(gateway: Gateway, upstreams) -> None:
    require_fake()
    upstream = upstreams[0]
    upstream.reset()
    batch_key, chat_key = gateway.create_key(name="nightly"), gateway.create_key(name="chat", team="acme")
    with gateway.admin() as admin:
        keys = {k["name"]: k["id"] for k in admin.get("/admin/keys").json()["data"]}
        response = admin.put(f"/admin/keys/{keys['nightly']}/scheduling", json={"tier": "background", "weight": 2})
        assert response.status_code == 200, response.text
        assert response.json() == {"tier": "background", "weight": 2.0, "priority": 10}
        assert admin.get(f"/admin/keys/{keys['chat']}/scheduling").json()["tier"] == "standard"
    for key in (batch_key, chat_key):
        with gateway.client(key) as client:
            response = client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "priority": -1000, "tenant": "someone-else", "tenant_weight": 999})
            assert response.status_code == 200, response.text
    sent = upstream.received()[-2:]
    # The tenant is the key's team when it has one (kvik.gateway.tenancy), else the key.
    assert [(b["priority"], b["tenant"], b["tenant_weight"]) for b in sent] == [
        (10, pseudonym(f"key:{keys['nightly']}"), 2.0), (0, pseudonym("team:acme"), 1.0)]


def test_scheduling_admin_routes_check_their_input(gateway: Gateway) -> None:
    key = gateway.create_key(name="plain")
    with gateway.admin() as admin:
        key_id = admin.get("/admin/keys").json()["data"][-1]["id"]
        assert admin.put(f"/admin/keys/{key_id}/scheduling", json={"tier": "gold"}).json()["error"]["param"] == "tier"
        assert admin.put(f"/admin/keys/{key_id}/scheduling",
                         json={"tier": "standard", "weight": 0}).json()["error"]["param"] == "weight"
        assert admin.put("/admin/keys/key_nope/scheduling", json={"tier": "standard"}).status_code == 404
    with gateway.client(key) as client:
        assert client.put(f"/admin/keys/{key_id}/scheduling", json={"tier": "interactive"}).status_code == 403


@pytest.mark.slow
def test_batches_through_the_gateway_per_key_with_usage(gateways: GatewayFactory, workdir, tiny_llama) -> None:
    server = KvikServe("batches", tiny_llama, free_port(), workdir)
    server.argv += ["--batch-db", str(workdir / "gateway-batches.db")]
    server.start(timeout=240)
    try:
        gateway = gateways.start({"models": [model_config("tiny", [server])],
                                  "batches": {"upstream": {"url": server.url}}}, name="batches")
        owner, stranger = gateway.create_key(name="owner"), gateway.create_key(name="stranger")
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=owner, max_retries=0)
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "tiny", "max_tokens": 3, "temperature": 0,
                           "messages": [{"role": "user", "content": f"hello {i}"}]}} for i in range(5)]
        content = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 300
        while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 5
        results = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in results) == [f"c{i}" for i in range(5)]
        other = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=stranger, max_retries=0)
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            other.files.retrieve(uploaded.id)
        client.batches.retrieve(batch.id)  # a second read charges nothing more
        with gateway.admin() as admin:
            time.sleep(1.5)  # the usage recorder flushes every 0.5 s
            keys = {k["name"]: k for k in admin.get("/admin/keys").json()["data"]}
            rows = admin.get("/admin/usage", params={"group_by": "key"}).json()["data"]
        raw = httpx.get(f"{gateway.url}/v1/batches/{batch.id}", headers={"Authorization": f"Bearer {owner}"}).json()
        assert keys["owner"]["tokens_used"] == raw["usage"]["total_tokens"] > 0
        assert keys["stranger"]["tokens_used"] == 0
        assert any(row.get("key_id") == keys["owner"]["id"] for row in rows)
        with httpx.Client(base_url=gateway.url) as anonymous:
            assert anonymous.get("/v1/batches").status_code == 401
    finally:
        server.stop()
