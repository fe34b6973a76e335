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

import copy
import json
import random
from typing import Any, Iterator

import httpx
import pytest

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


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


HOSTILE: list[Any] = [
    None, -1, 0, 1, 0.5, -10**20, 10**20, 2**63, 1e308, -1e308, float("nan"), float("inf"),
    "", "x" * 20000, "\x00", "\ud800", "\udc00 tail", "a\ud83d", "\u202e\ufeff", "NaN", "auto", "none", "required",
    True, False, [], {}, [[]], [None], [-1], [10**9], [1.5], ["x"] * 300, {"": ""}, {"a": None},
    [{"type": "bogus"}], (_nested, 100), (_nested, 900),
]


def _same_kind(a: Any, b: Any) -> bool:
    number = (int, float)
    return (isinstance(a, number) and isinstance(b, number) and not isinstance(a, bool) and not isinstance(b, bool)) \
        or type(a) is type(b)


def _hostile(rng: random.Random, old: Any = None) -> Any:
    """A hostile value; half the time one of the old value's kind (a string for a string), which
    passes type validation more often and so reaches further."""
    alike = [value for value in HOSTILE if _same_kind(value, old)]
    value = rng.choice(alike if alike and rng.random() < 0.5 else HOSTILE)
    if isinstance(value, tuple):  # built afresh: deepcopy recurses twice per level
        make, depth = value
        return make(depth)
    return copy.deepcopy(value)


def _paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    yield path
    if len(path) < 6:
        children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, child in list(children):
            yield from _paths(child, path + (key,))


def _mutate(body: dict, rng: random.Random) -> dict:
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        paths = list(_paths(body))[1:]
        if not paths:
            break
        path = rng.choice(paths)
        *parents, last = path
        parent: Any = body
        for key in parents:
            parent = parent[key]
        roll = rng.random()
        if roll < 0.7:
            parent[last] = _hostile(rng, parent[last])
        elif roll < 0.85:
            del parent[last]
        else:
            field = rng.choice(("unknown_field", "stream", "n", "max_tokens", "model"))
            body[field] = _hostile(rng)
    return body


def _check(response: httpx.Response, text: str) -> str | None:
    """What is wrong with an answer, or None."""
    if response.status_code >= 500:
        return f"HTTP {response.status_code}: {text[:300]}"
    if response.status_code >= 400:
        try:
            error = json.loads(text)["error"]
        except (ValueError, KeyError, TypeError):
            return f"HTTP {response.status_code} without the OpenAI error shape: {text[:300]}"
        if set(error) != {"message", "type", "param", "code"} or not error["message"]:
            return f"HTTP {response.status_code} with a malformed error: {error}"
    elif "text/event-stream" in response.headers.get("content-type", ""):
        # A stream that fails after its 200 must say so in an event, and every stream must end.
        if "data: [DONE]" not in text and '"type":"response.completed"' not in text.replace(" ", "") \
                and '"error"' not in text and "response.incomplete" not in text and "response.failed" not in text:
            return f"a stream that neither ended nor reported an error: {text[-300:]}"
    return None


def test_mutated_requests_get_success_or_a_clear_4xx(server_factory):
    server = server_factory("--max-num-seqs", "8")
    rng = random.Random(SEED)
    failures: list[str] = []
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(REQUESTS):
            path = rng.choice(list(BODIES))
            body = _mutate(copy.deepcopy(BODIES[path]), rng)
            raw = json.dumps(body)  # NaN and Infinity as Python writes them: the server must refuse them cleanly
            with client.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as response:
                text = response.read().decode("utf-8", "replace")
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            problem = _check(response, text)
            if problem:
                failures.append(f"POST {path} {raw[:300]} -> {problem}")
        assert client.get("/health").status_code == 200
        normal = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 3
    assert not failures, f"{len(failures)} of {REQUESTS} answers were wrong:\n" + "\n".join(failures[:10])
    # The mix reached past validation: some requests succeeded, some were refused.
    refused = sum(count for status, count in statuses.items() if 400 <= status < 500)
    assert statuses.get(200, 0) >= REQUESTS // 10 and refused >= REQUESTS // 4, statuses
