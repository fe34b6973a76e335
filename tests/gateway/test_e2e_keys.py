"""Keys, roles, model allow-lists, RPM/TPM limits and budgets, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import json
import secrets
import subprocess
import time

import pytest

from tests.gateway.harness import FAKE, KVIK, REPO, Gateway, GatewayFactory, Upstream, model_config, require_fake

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def gateway(request: pytest.FixtureRequest, gateways: GatewayFactory, upstreams: list[Upstream]) -> Gateway:
    config = {"models": [model_config("tiny", upstreams, aliases=["tiny-latest"]), model_config("other", upstreams)]}
    if request.param == "postgresql":
        cluster = request.getfixturevalue("postgres_server")
        config["database_url"] = cluster.create_database(f"kvik_keys_{secrets.token_hex(4)}")
    return gateways.start(config, name=f"keys-{request.param}")


def ask(gateway: Gateway, key: str | None, model: str = "tiny", content: str = "one two", **extra: object):  # noqa: ANN201
    with gateway.client(key) as client:
        return client.post("/v1/chat/completions",
                           json={"model": model, "messages": [{"role": "user", "content": content}], **extra})


def assert_openai_error(response, status: int, error_type: str, code: str | None = None) -> None:  # noqa: ANN001
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == error_type
    if code is not None:
        assert error["code"] == code


def test_wrong_or_missing_key_is_401(gateway: Gateway) -> None:
    assert_openai_error(ask(gateway, "kvik-not-a-real-key"), 401, "invalid_request_error", "invalid_api_key")
    assert_openai_error(ask(gateway, None), 401, "invalid_request_error")


def test_key_not_allowed_the_model_is_403(gateway: Gateway) -> None:
    key = gateway.create_key(name="only-other", models=["other"])
    assert ask(gateway, key, "other").status_code == 200
    assert_openai_error(ask(gateway, key, "tiny"), 403, "permission_error")
    assert_openai_error(ask(gateway, key, "tiny-latest"), 403, "permission_error")  # aliases resolve first
    with gateway.client(key) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["other"]


def test_rpm_limit_gives_429_with_retry_after(gateway: Gateway) -> None:
    key = gateway.create_key(name="rpm", rpm=3)
    assert [ask(gateway, key).status_code for _ in range(3)] == [200, 200, 200]
    refused = ask(gateway, key)
    assert_openai_error(refused, 429, "rate_limit_error", "rate_limit_exceeded")
    # The sliding-window estimate can ask for up to W * (1 + 1/rpm) = 80 s here: the exact wait after
    # which the limiter admits the next request, not a guess.
    assert 1 <= int(refused.headers["retry-after"]) <= 80
    assert gateway.metric("kvik_gateway_rate_limited_total", limit="rpm") >= 1


def test_tpm_reserves_prompt_and_max_tokens_and_settles_to_usage(gateway: Gateway) -> None:
    # Each request reserves its estimate: "one two" is 7 bytes + 8 template tokens per message (and
    # the generation prompt) = 23, plus max_tokens 5 = 28. The fake upstream then reports prompt words
    # + max_tokens = 2 + 5 = 7, and the settlement gives the other 21 back. Under tpm 50:
    # 0+28, 7+28, 14+28, 21+28 fit; 28+28 does not.
    require_fake()
    key = gateway.create_key(name="tpm", tpm=50)
    assert [ask(gateway, key, max_tokens=5).status_code for _ in range(5)] == [200, 200, 200, 200, 429]
    refused = ask(gateway, key, max_tokens=5)
    assert_openai_error(refused, 429, "rate_limit_error")
    assert "tokens per minute" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1
    # A request that may generate more than the limit can never fit: refused at once, saying why.
    too_large = ask(gateway, gateway.create_key(name="tpm-small", tpm=50), max_tokens=60)
    assert_openai_error(too_large, 429, "rate_limit_error")
    assert "lower max_tokens" in too_large.json()["error"]["message"]
    # Streamed tokens count too: the gateway asks the upstream for the usage chunk.
    streamer = gateway.create_key(name="tpm-stream", tpm=50)
    statuses = [ask(gateway, streamer, max_tokens=5, stream=True).status_code for _ in range(5)]
    assert statuses == [200, 200, 200, 200, 429]


def test_token_budget_is_reserved_and_enforced(gateway: Gateway) -> None:
    require_fake()
    key = gateway.create_key(name="budget", token_budget=30)
    assert ask(gateway, key, max_tokens=20).status_code == 200  # 2 + 20 = 22 of 30 used
    refused = ask(gateway, key, max_tokens=20)  # 8 left cannot cover 20 completion tokens
    assert_openai_error(refused, 429, "insufficient_quota", "insufficient_quota")
    assert "8 tokens" in refused.json()["error"]["message"] and "lower max_tokens" in refused.json()["error"]["message"]
    assert "retry-after" not in refused.headers  # waiting does not help
    assert ask(gateway, key, max_tokens=5).status_code == 200  # 29 used
    assert_openai_error(ask(gateway, key, max_tokens=5), 429, "insufficient_quota")
    assert gateway.metric("kvik_gateway_rate_limited_total", limit="budget") >= 1


def test_admin_api_manages_keys_and_reports_usage(gateway: Gateway) -> None:
    user_key = gateway.create_key(name="plain-user")
    with gateway.client(user_key) as client:
        assert_openai_error(client.get("/admin/keys"), 403, "permission_error")
    with gateway.client("kvik-wrong") as client:
        assert_openai_error(client.get("/admin/keys"), 401, "invalid_request_error")

    with gateway.admin() as admin:
        created = admin.post("/admin/keys", json={"name": "carol", "models": ["tiny"], "rpm": 100, "tpm": 10000})
        assert created.status_code == 201
        secret, key_id = created.json()["key"], created.json()["id"]
        assert secret.startswith("kvik-")
        listed = admin.get("/admin/keys").json()["data"]
        assert any(k["id"] == key_id and "key" not in k for k in listed)
        assert admin.get(f"/admin/keys/{key_id}").json()["models"] == ["tiny"]
        assert_openai_error(admin.post("/admin/keys", json={"name": "x", "role": "root"}), 400,
                            "invalid_request_error")
        assert_openai_error(admin.post("/admin/keys", json={"nme": "typo"}), 400, "invalid_request_error")

        for _ in range(2):
            assert ask(gateway, secret, max_tokens=4).status_code == 200
        usage = admin.get("/admin/usage", params={"key_id": key_id}).json()["data"]
        assert usage[0]["requests"] == 2 and usage[0]["total_tokens"] > 0
        assert not FAKE or usage == [{"key_id": key_id, "model": "tiny", "requests": 2, "errors": 0, "cached": 0,
                          "prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12,
                          "avg_latency_ms": usage[0]["avg_latency_ms"], "max_latency_ms": usage[0]["max_latency_ms"]}]

        revoked = admin.delete(f"/admin/keys/{key_id}")
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
        assert_openai_error(admin.delete("/admin/keys/key_nope"), 404, "invalid_request_error")
    assert_openai_error(ask(gateway, secret), 401, "invalid_request_error")


def test_cli_manages_keys_in_the_same_database(gateway: Gateway) -> None:
    def kvik(*args: str) -> str:
        result = subprocess.run([*KVIK, "gateway", "keys", *args, "--config", str(gateway.config_path)],
                                capture_output=True, text=True, cwd=REPO, env=gateway.env, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout

    created = json.loads(kvik("create", "--name", "from-cli", "--models", "tiny", "--rpm", "5", "--json"))
    secret = created["key"]
    assert ask(gateway, secret).status_code == 200
    assert created["id"] in kvik("list")
    kvik("revoke", created["id"])
    # The gateway caches keys for key_cache_ttl_s (0.5 s in the tests); a CLI revoke is seen after it.
    time.sleep(0.6)
    assert ask(gateway, secret).status_code == 401
