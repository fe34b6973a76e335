"""The gateway's APIs behind the chat page and the console, over HTTP against a real `kvik gateway`:
the conversation store (per key, on SQLite and PostgreSQL), key updates, daily usage and cost, live
metrics, and the audit trail. Bad input is a 4xx naming the field, never a 500."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.harness import ADMIN_KEY, Gateway, GatewayFactory, PostgresCluster

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def ui_gateway(request: pytest.FixtureRequest, scripted, web_workdir) -> Iterator[Gateway]:
    config = {"models": [{"name": "scripted", "replicas": [{"url": scripted.url}],
                          "pricing": {"input_per_million": 1.0, "output_per_million": 2.0}}]}
    cluster = None
    if request.param == "postgresql":
        cluster = PostgresCluster()
        cluster.start()
        config["database_url"] = cluster.create_database("kvik_ui")
    factory = GatewayFactory(web_workdir)
    try:
        yield factory.start(config, name=f"ui-{request.param}")
    finally:
        factory.stop_all()
        if cluster is not None:
            cluster.stop()


def test_conversation_store(ui_gateway: Gateway) -> None:
    key = ui_gateway.create_key(name="conv-owner")
    with ui_gateway.client(key) as client:
        first = client.post("/ui/conversations", json={"title": "  Trip to Lyon ", "data": {"messages": {"a": {
            "content": "Which trains go to Lyon?"}}}})
        assert first.status_code == 201 and first.json()["title"] == "Trip to Lyon"
        second = client.post("/ui/conversations", json={"title": "Cooking", "data": {"note": "100% butter-ok"}})
        first_id, second_id = first.json()["id"], second.json()["id"]
        listed = [row["id"] for row in client.get("/ui/conversations").json()["data"]]
        assert listed == [second_id, first_id]  # newest first
        # Search: the title or any text inside, case-insensitive; % and _ are literal.
        assert [r["id"] for r in client.get("/ui/conversations", params={"q": "TRAINS"}).json()["data"]] == [first_id]
        assert [r["id"] for r in client.get("/ui/conversations", params={"q": "100%"}).json()["data"]] == [second_id]
        assert client.get("/ui/conversations", params={"q": "r_ok"}).json()["data"] == []
        assert client.get("/ui/conversations", params={"q": "lyon"}).json()["data"][0]["id"] == first_id
        # Rename and replace the document; the change moves it to the top.
        renamed = client.patch(f"/ui/conversations/{first_id}", json={"title": "Lyon by train"})
        assert renamed.status_code == 200 and renamed.json()["title"] == "Lyon by train"
        client.patch(f"/ui/conversations/{first_id}", json={"data": {"messages": {}, "current": None}})
        full = client.get(f"/ui/conversations/{first_id}").json()
        assert full["data"] == {"messages": {}, "current": None} and full["title"] == "Lyon by train"
        assert client.get("/ui/conversations").json()["data"][0]["id"] == first_id
        assert client.delete(f"/ui/conversations/{second_id}").json()["deleted"] is True
        assert client.get(f"/ui/conversations/{second_id}").status_code == 404
        # Bad input: 4xx with the field named.
        for method, path, body, status, param in (
                ("post", "/ui/conversations", {"title": "", "data": {}}, 400, "title"),
                ("post", "/ui/conversations", {"title": "x", "data": [1]}, 400, "data"),
                ("post", "/ui/conversations", {"title": "x", "data": {}, "owner": "someone"}, 400, "owner"),
                ("patch", f"/ui/conversations/{first_id}", {}, 400, "title"),
                ("patch", "/ui/conversations/conv_nope", {"title": "x"}, 404, "id"),
                ("post", "/ui/conversations", {"title": "x", "data": {"big": "x" * (5 * 2**20)}}, 413, None)):
            response = getattr(client, method)(path, json=body)
            assert response.status_code == status, (body if len(str(body)) < 200 else path, response.text[:200])
            assert response.json()["error"]["param"] == param
        assert client.post("/ui/conversations", content=b"{not json").status_code == 400
        assert client.get("/ui/conversations", params={"limit": "-1"}).status_code == 400
        assert client.get("/ui/conversations", params={"q": "x" * 500}).status_code == 400


def test_key_update_audit_usage_and_live_metrics(ui_gateway: Gateway) -> None:
    with ui_gateway.admin() as admin:
        created = admin.post("/admin/keys", json={"name": "metered", "models": ["scripted"]}).json()
        key_id, secret = created["id"], created["key"]
        # Update: limits and allow-list change; the role and secret cannot.
        updated = admin.patch(f"/admin/keys/{key_id}", json={"rpm": 2, "name": "metered-2"})
        assert updated.status_code == 200 and updated.json()["rpm"] == 2 and updated.json()["name"] == "metered-2"
        for body, param in (({"role": "admin"}, "role"), ({"rpm": 0}, "rpm"), ({"rpm": 1e30}, "rpm"),
                            ({"models": "scripted"}, "models"), ({"name": ""}, "name")):
            response = admin.patch(f"/admin/keys/{key_id}", json=body)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, (body, response.text)
        assert admin.patch("/admin/keys/key_nope", json={"rpm": 1}).status_code == 404
        assert admin.patch(f"/admin/keys/{key_id}", content=b"[]").status_code == 400

    # The new limit applies at once: rpm 2 -> the third request within the minute is a 429.
    with ui_gateway.client(secret) as client:
        body = {"model": "scripted", "messages": [{"role": "user", "content": "count me"}]}
        statuses = [client.post("/v1/chat/completions", json=body).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]

    with ui_gateway.admin() as admin:
        daily = admin.get("/admin/usage/daily", params={"key_id": key_id}).json()["data"]
        assert len(daily) == 1 and daily[0]["requests"] == 3 and daily[0]["errors"] == 1
        row = daily[0]
        assert row["cost_usd"] == pytest.approx((row["prompt_tokens"] * 1.0 + row["completion_tokens"] * 2.0) / 1e6)
        requests = admin.get("/admin/requests", params={"key_id": key_id}).json()["data"]
        assert [r["status"] for r in requests] == [429, 200, 200]  # newest first
        assert [r["status"] for r in admin.get("/admin/requests", params={"key_id": key_id, "status": "4xx"})
                .json()["data"]] == [429]
        assert admin.get("/admin/requests", params={"status": "abc"}).status_code == 400
        audit = admin.get("/admin/audit", params={"target": key_id}).json()["data"]
        assert [a["action"] for a in audit] == ["key.update", "key.create"]
        assert audit[0]["detail"] == {"rpm": 2, "name": "metered-2"} and audit[0]["actor_key_id"] == "bootstrap-admin"
        assert admin.get("/admin/audit", params={"action": "key.explode"}).status_code == 400
        assert admin.get("/admin/usage/daily", params={"since": "yesterday"}).status_code == 400
        live = admin.get("/admin/metrics/live").json()
        minute = live["windows"]["60"]
        assert live["totals"]["requests"] >= 3 and minute["latency_ms"]["p50"] is not None
        models = admin.get("/admin/models").json()["data"]
        assert models[0]["pricing"] == {"input_per_million": 1.0, "output_per_million": 2.0}

    # None of it is open to a user key.
    with ui_gateway.client(secret) as client:
        for path in ("/admin/usage/daily", "/admin/metrics/live", "/admin/audit", "/admin/requests", "/admin/models"):
            assert client.get(path).status_code == 403, path
    with ui_gateway.client(ADMIN_KEY) as admin:
        admin.delete(f"/admin/keys/{key_id}")
        assert admin.get("/admin/audit", params={"action": "key.revoke"}).json()["data"][0]["target"] == key_id
