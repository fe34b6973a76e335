"""Bad input to the gateway gets a clear 4xx in the OpenAI error shape, never a 5xx (issue 10,
finding 11, and must-show 2): the named cases, then schemathesis over the gateway's own OpenAPI
schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import ADMIN_KEY, Gateway, GatewayFactory, Upstream, model_config

pytestmark = pytest.mark.timeout(300)

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def gateway(gateways: GatewayFactory, upstreams: list[Upstream]) -> Gateway:
    for upstream in upstreams:
        upstream.reset()
    return gateways.start({"models": [model_config("tiny", upstreams)], "guardrails": {"pii": {"enabled": True}},
                           "limits": {"max_body_bytes": 1024 * 1024}}, name="bad-input")


@pytest.fixture(scope="module")
def key(gateway: Gateway) -> str:
    return gateway.create_key(name="bad-input")


@pytest.fixture
def client(gateway: Gateway, key: str) -> httpx.Client:
    with gateway.client(key) as client:
        yield client


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("options", ["x", [1], 5, True, {"include_usage": "yes"}])
def test_ill_typed_stream_options_are_400(client: httpx.Client, options: object) -> None:
    error = assert_error(client.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": options}),
                         400)
    assert "stream_options" in error["message"]


def test_metadata_nested_100k_deep_is_400(client: httpx.Client) -> None:
    depth = 100_000
    raw = json.dumps(CHAT)[:-1] + ', "metadata": ' + "[" * depth + "]" * depth + "}"
    error = assert_error(client.post("/v1/chat/completions", content=raw,
                                     headers={"content-type": "application/json"}), 400)
    assert "deeper than 64" in error["message"]
    shallow_but_over = json.dumps(CHAT)[:-1] + ', "metadata": ' + '{"a": ' * 70 + "1" + "}" * 70 + "}"
    assert_error(client.post("/v1/chat/completions", content=shallow_but_over,
                             headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("request_id", ["caf\xe9".encode("utf-8"), "caf\xe9".encode("latin-1"), b"has space",
                                        b"x" * 129, b"tab\there"])
def test_bad_x_request_ids_are_400(client: httpx.Client, request_id: bytes) -> None:
    assert_error(client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": request_id}), 400,
                 param="x-request-id")


def test_a_good_x_request_id_is_kept(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "trace-42/abc"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "trace-42/abc"


@pytest.mark.parametrize(("field", "value"), [
    ("rpm", 1e30), ("tpm", 2**63), ("token_budget", -1), ("rpm", "5"), ("rpm", True), ("tpm", 1.5),
    ("name", "\ud800"), ("name", ""), ("team", ""), ("models", [""]), ("role", "root"),
])
def test_bad_admin_key_fields_are_400(gateway: Gateway, field: str, value: object) -> None:
    body = json.dumps({"name": "x", field: value}).encode()  # json.dumps writes 1e30 and lone surrogates as sent
    with gateway.admin() as admin:
        error = assert_error(admin.post("/admin/keys", content=body, headers={"content-type": "application/json"}),
                             400)
    assert field in error["message"] or value == "\ud800"  # that one is not even valid UTF-8 JSON text


@pytest.mark.parametrize(("extra", "param"), [
    ({"max_tokens": "many"}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 2**40}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"), ({"max_completion_tokens": True}, "max_completion_tokens"),
    ({"n": 0}, "n"), ({"n": 1000}, "n"), ({"best_of": "2"}, "best_of"), ({"stream": "yes"}, "stream"),
    ({"model": 5}, "model"), ({"model": ""}, "model"), ({"model": "m" * 300}, "model"),
])
def test_ill_typed_fields_the_gateway_reads_are_400(client: httpx.Client, extra: dict, param: str) -> None:
    assert_error(client.post("/v1/chat/completions", json={**CHAT, **extra}), 400, param=param)


@pytest.mark.parametrize("raw", [b'{"model": "tiny",', b"[1, 2]", b'"text"', b"\xff\xfe{}", b"", b"null"])
def test_bodies_that_are_not_json_objects_are_400(client: httpx.Client, raw: bytes) -> None:
    assert_error(client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}), 400)


def test_other_mistakes(client: httpx.Client, gateway: Gateway) -> None:
    assert_error(client.post("/v1/chat/completions", json={"model": "tiny"}), 400, param="messages")
    assert_error(client.post("/v1/completions", json={"model": "tiny"}), 400, param="prompt")
    assert_error(client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404, param="model")
    assert_error(client.get("/v1/nothing"), 404)
    # A lone surrogate parses with json.loads but is not Unicode: the gateway refuses it before the
    # cache key, the redaction or the usage rows see it (kvik.core.client_json).
    surrogate = json.dumps({**CHAT, "temperature": 0, "messages": [{"role": "user", "content": "\ud800 x"}]})
    error = assert_error(client.post("/v1/chat/completions", content=surrogate,
                                     headers={"content-type": "application/json"}), 400)
    assert "messages.0.content: holds the escape \\ud800" in error["message"], error
    with gateway.admin() as admin:
        assert_error(admin.get("/admin/usage", params={"since": "yesterday"}), 400, param="since")
        assert_error(admin.get("/admin/usage", params={"group_by": "colour"}), 400, param="group_by")


def test_schemathesis_finds_no_server_errors(gateway: Gateway, tmp_path: Path) -> None:
    """Fuzz every operation of the gateway's /openapi.json (the OpenAI request schemas kvik's server
    validates with, and the admin API's), positive and negative cases, with an admin key."""
    result = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{gateway.url}/openapi.json",
         "--checks", "not_a_server_error", "--max-examples", "25", "--workers", "1",
         "--max-time", "60", "--request-timeout", "30", "--generation-deterministic",
         "--suppress-health-check", "all", "--report-dir", str(tmp_path),
         "--header", f"Authorization: Bearer {ADMIN_KEY}"],
        capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert httpx.get(f"{gateway.url}/health", timeout=5).status_code == 200
