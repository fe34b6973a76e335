"""Bad input gets the documented status and the OpenAI error shape, never a 5xx; schemathesis
fuzzes the server's own OpenAPI schema."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest


def assert_error(response: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def post(server, path: str, **kwargs) -> httpx.Response:
    kwargs.setdefault("timeout", 30)
    return httpx.post(f"{server.base_url}/{path}", **kwargs)


def test_malformed_json(server):
    response = post(server, "completions", content=b'{"prompt": "hi",',
                    headers={"content-type": "application/json"})
    message = assert_error(response, 400)["message"]
    # The parser's own words and where it stopped, not FastAPI's constant "JSON decode error".
    assert message.startswith("the request body is not valid JSON (Expecting property name"), message
    assert "at character 16" in message


JSON = {"content-type": "application/json"}
# Past json_body.WORKER_PARSE_BYTES, so the body is parsed in a tokenizer worker, not on the loop.
PADDING = "a" * (300 * 1024)


@pytest.mark.parametrize("path,body,field", [
    ("chat/completions", r'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \ud800"}]}',
     "messages.0.content"),
    ("chat/completions", r'{"model": "tiny", "max_tokens": 2, "stop": ["\udc00"], '
                         r'"messages": [{"role": "user", "content": "hi"}]}', "stop.0"),
    ("completions", r'{"model": "tiny", "max_tokens": 2, "prompt": "\ud800\ud800\udc00"}', "prompt"),
    ("completions", r'{"model": "tiny", "max_tokens": 2, "prompt": "' + PADDING + r'", "user": "\udbff"}', "user"),
    ("responses", r'{"model": "tiny", "max_output_tokens": 2, "input": "x", "instructions": "\ud83d"}',
     "instructions"),
    ("embeddings", r'{"model": "tiny", "input": ["ok", "\udfff"]}', "input.1"),
])
def test_lone_surrogate_escape_is_a_400_naming_the_field(server, path, body, field):
    """json.loads accepts "\ud800" (half of a UTF-16 pair); such a string cannot be encoded as
    UTF-8, and used to fail as a 500 when the request was sent on to the engine process."""
    message = assert_error(post(server, path, content=body.encode(), headers=JSON), 400)["message"]
    assert f"({field}: holds the escape" in message and "surrogate" in message, message
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_paired_surrogate_escapes_are_text(server):
    """Clients that escape everything outside ASCII (json.dumps's default) send an emoji as a pair."""
    body = r'{"model": "tiny", "max_tokens": 2, "prompt": "smile \ud83d\ude00", "echo": true}'
    response = post(server, "completions", content=body.encode(), headers=JSON)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].startswith("smile \U0001F600")


@pytest.mark.parametrize("body,param", [
    ({"prompt": 5}, "prompt"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 6}, "logprobs"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({}, "prompt"),
])
def test_wrong_types_and_ranges(server, body, param):
    assert_error(post(server, "completions", json={"model": "tiny", **body}), 400, param=param)


def test_chat_specific_errors(server):
    assert_error(post(server, "chat/completions", json={"model": "tiny", "messages": []}), 400,
                 param="messages")
    bad_role = {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}
    assert_error(post(server, "chat/completions", json=bad_role), 400)
    image = {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}
    assert "not supported" in assert_error(post(server, "chat/completions", json=image), 400)["message"]


def test_unknown_model(server):
    error = assert_error(post(server, "completions", json={"model": "gpt-9", "prompt": "hi"}), 404,
                         code="model_not_found")
    assert "gpt-9" in error["message"] and "tiny" in error["message"]
    assert_error(httpx.get(f"{server.base_url}/models/gpt-9"), 404, code="model_not_found")


def test_over_long_prompt_names_limit_and_counts(server):
    response = post(server, "completions", json={"model": "tiny", "prompt": [7] * 600})
    error = assert_error(response, 400, code="context_length_exceeded")
    assert "512" in error["message"] and "600" in error["message"]
    response = post(server, "completions", json={"model": "tiny", "prompt": [7] * 100, "max_tokens": 500})
    error = assert_error(response, 400, param="max_tokens", code="context_length_exceeded")
    assert "600 tokens (100 in the prompt, 500 in the completion)" in error["message"]


def test_over_long_conversation_names_messages(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 600}]}
    error = assert_error(post(server, "chat/completions", json=body), 400, param="messages",
                         code="context_length_exceeded")
    assert "512" in error["message"]


def test_token_ids_outside_vocabulary(server):
    assert_error(post(server, "completions", json={"model": "tiny", "prompt": [1, 99999]}), 400,
                 param="prompt")
    assert_error(post(server, "completions", json={"model": "tiny", "prompt": "x",
                                                     "logit_bias": {"99999": 5}}), 400, param="logit_bias")


def test_lists_the_sampler_reads_every_step_are_bounded(server):
    """A bias over the whole vocabulary or a million stop ids would be applied in every step of the
    batch, which every other request waits on: at most 300 each (OpenAI's limit for logit_bias)."""
    base = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    error = assert_error(post(server, "completions", json={**base, "logit_bias": {str(i): 1 for i in range(301)}}),
                         400, param="logit_bias")
    assert "at most 300 tokens, got 301" in error["message"], error
    error = assert_error(post(server, "completions", json={**base, "stop_token_ids": [10**6] * 301}), 400,
                         param="stop_token_ids")
    assert "at most 300" in error["message"], error
    ok = post(server, "completions", json={**base, "logit_bias": {str(i): 1 for i in range(200)},
                                           "stop_token_ids": [10**6] * 300})
    assert ok.status_code == 200, ok.text


def test_body_too_large(server):
    big = b'{"prompt": "' + b"a" * (17 * 2**20) + b'"}'
    response = post(server, "completions", content=big, headers={"content-type": "application/json"})
    assert_error(response, 413)


def test_unknown_route_and_extra_fields(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    ok = post(server, "completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                            "some_client_extra": {"a": 1}, "best_of": 1})
    assert ok.status_code == 200


def test_schemathesis_finds_no_server_errors(server_factory, tmp_path):
    """Fuzz every operation of /openapi.json, bounded in examples and time. A short context keeps
    generations without max_tokens short."""
    server = server_factory("--max-model-len", "96")
    result = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
         "--checks", "not_a_server_error", "--max-examples", "25", "--workers", "1",
         "--max-time", "90", "--request-timeout", "30", "--generation-deterministic",
         "--suppress-health-check", "all", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    # The server survived and still answers.
    assert httpx.get(f"{server.url}/health").status_code == 200
