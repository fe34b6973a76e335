"""Mutation fuzzing helpers: hostile variants of valid request bodies, and what is wrong with an
answer to one (anything but a success or a 4xx in the OpenAI error shape, or a stream that never
ends). Used against a live server (tests/server/test_mutation_fuzz.py) and a gateway in front of
real replicas (tests/gateway/test_e2e_kvik_serve.py)."""

from __future__ import annotations

import copy
import json
import random
from typing import Any, Iterator

import httpx


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


def hostile_value(rng: random.Random, old: Any = None) -> Any:
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


def mutate(body: dict, rng: random.Random) -> dict:
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
            parent[last] = hostile_value(rng, parent[last])
        elif roll < 0.85:
            del parent[last]
        else:
            field = rng.choice(("unknown_field", "stream", "n", "max_tokens", "model"))
            body[field] = hostile_value(rng)
    return body


def answer_problem(response: httpx.Response, text: str) -> str | None:
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


def fuzz(client: httpx.Client, bodies: dict[str, dict[str, Any]], requests: int,
         seed: int) -> tuple[list[str], dict[int, int]]:
    """POST `requests` mutated copies of `bodies` (path -> valid body) through `client`: the
    problems found (one line each) and how many answers had each status."""
    rng = random.Random(seed)
    failures: list[str] = []
    statuses: dict[int, int] = {}
    for _ in range(requests):
        path = rng.choice(list(bodies))
        body = mutate(copy.deepcopy(bodies[path]), rng)
        raw = json.dumps(body)  # NaN and Infinity as Python writes them: they must be refused cleanly
        with client.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as response:
            text = response.read().decode("utf-8", "replace")
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        problem = answer_problem(response, text)
        if problem:
            failures.append(f"POST {path} {raw[:300]} -> {problem}")
    return failures, statuses
