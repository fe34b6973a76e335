"""Mutation fuzzing of a live server: valid, feature-rich bodies for each JSON endpoint, each
request with one to three parts replaced by a hostile value, deleted, or joined by a stray field.
Every answer must be a success or a 4xx in the OpenAI error shape, never a 5xx, and every stream
must end; the server must serve normally afterwards.

schemathesis (test_bad_input.py) builds bodies from the OpenAPI schema: its strings leave out
surrogates, and most of its bodies stop at the first field they break. Starting from bodies that
pass validation, and replacing a value by a hostile one of the same kind half the time, reaches the
code behind validation. A script like this one found the lone surrogate escape in `stop` that
failed as a 500 (test_bad_input.py now has that case by name). The seed is fixed so a failure
repeats; this seed's 400 requests pass validation about a quarter of the time. Six other seeds
of 800 requests each passed when it was written."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.mutation import fuzz

pytestmark = pytest.mark.timeout(300)

REQUESTS = 400
SEED = 20261206

TOOL = {"type": "function", "function": {"name": "lookup", "description": "find a word",
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "tiny", "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "n": 2, "seed": 3,
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "logprobs": True, "top_logprobs": 2, "stop": ["\n"], "logit_bias": {"5": 1.0}, "presence_penalty": 0.1,
        "tools": [TOOL], "tool_choice": "auto", "stream": False, "stream_options": {"include_usage": True},
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}},
    },
    "/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 4, "echo": True, "logprobs": 2,
                        "best_of": 2, "n": 1, "stop": "x", "stream": True, "seed": 1},
    "/v1/responses": {
        "model": "tiny", "max_output_tokens": 4, "instructions": "be brief", "store": False,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
    },
    "/v1/embeddings": {"model": "tiny", "input": ["a", "b"], "encoding_format": "float"},
    "/tokenize": {"model": "tiny", "prompt": "hello", "add_special_tokens": True},
    "/detokenize": {"model": "tiny", "tokens": [1, 2, 3]},
}


def test_mutated_requests_get_success_or_a_clear_4xx(server_factory):
    server = server_factory("--max-num-seqs", "8")
    with httpx.Client(base_url=server.url, timeout=60) as client:
        failures, statuses = fuzz(client, BODIES, REQUESTS, SEED)
        assert client.get("/health").status_code == 200
        normal = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 3
    assert not failures, f"{len(failures)} of {REQUESTS} answers were wrong:\n" + "\n".join(failures[:10])
    # The mix reached past validation: some requests succeeded, some were refused.
    refused = sum(count for status, count in statuses.items() if 400 <= status < 500)
    assert statuses.get(200, 0) >= REQUESTS // 10 and refused >= REQUESTS // 4, statuses
