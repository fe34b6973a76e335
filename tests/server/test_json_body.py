"""Large JSON bodies are parsed in the tokenizer workers, not on the server's event loop (issue 10,
finding 2: `json.loads` of a 5 MB chat body held the loop, and `/health` with it, for 10-15 ms).

In process, against the real app and request gate, with a pool that records what it was asked to
parse; the real pool's parsing is tested in tests/engine/test_preprocess_pool.py and the loop's
latency while megabytes arrive in bench/health_under_load.py."""

from __future__ import annotations

import asyncio
import json
import re

import httpx

from kvik.engine.preprocess_pool import ParsedBody, _parse_json_job
from kvik.server.app import create_app
from kvik.server.json_body import WORKER_PARSE_BYTES
from kvik.server.state import ServerConfig, ServerState


class RecordingPool:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def parse_json(self, body: bytes) -> ParsedBody:
        self.bodies.append(body)
        return _parse_json_job(body)  # what the worker runs, here in process


def post(state: ServerState, body: bytes, content_type: str = "application/json") -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", content=body, headers={"content-type": content_type})

    return asyncio.run(send())


def state_with(pool: RecordingPool | None) -> ServerState:
    state = ServerState(ServerConfig(["tiny"]))
    state.preprocess_pool = lambda: pool  # type: ignore[method-assign]
    return state


def test_a_large_body_is_parsed_by_the_pool_and_answered_as_a_small_one_would_be():
    pool = RecordingPool()
    filler = "x" * (WORKER_PARSE_BYTES + 1)
    # Parsed in the pool, then validated by FastAPI as usual: `messages` has the wrong type.
    big = json.dumps({"model": "tiny", "messages": filler}).encode()
    response = post(state_with(pool), big)
    assert pool.bodies == [big]
    small = post(state_with(pool), json.dumps({"model": "tiny", "messages": "x"}).encode())
    assert len(pool.bodies) == 1, "a small body parses on the loop"
    assert response.status_code == small.status_code == 400
    assert response.json()["error"]["param"] == small.json()["error"]["param"] == "messages"
    assert response.json()["error"]["message"] == small.json()["error"]["message"]


def test_a_large_body_that_is_not_json_gets_the_answer_a_small_one_gets():
    pool = RecordingPool()
    pad = b" " * WORKER_PARSE_BYTES
    cases = [(b'{"model": "tiny", "messages": [' + pad + b"}", b'{"model": "tiny", "messages": [}'),  # syntax
             (b'{"model": "' + b"\xff" * WORKER_PARSE_BYTES + b'"}', b'{"model": "\xff"}'),  # not UTF-8
             (b"[" * 300_000 + b"]" * 300_000, b"[" * 100_000)]  # nested past the parser's limit
    for big, small in cases:
        answers = [post(state_with(pool), body) for body in (big, small)]
        assert [a.status_code for a in answers] == [400, 400], answers[0].text
        # The same answer but for where a syntax error is: the padding moves it.
        errors = [a.json()["error"] for a in answers]
        for error in errors:
            error["message"] = re.sub(r" at character \d+", "", error["message"])
        assert errors[0] == errors[1]
    assert len(pool.bodies) == len(cases)


def test_without_a_pool_or_for_other_content_types_the_loop_parses_as_before():
    big = json.dumps({"model": "tiny", "messages": "x" * (WORKER_PARSE_BYTES + 1)}).encode()
    response = post(state_with(None), big)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    pool = RecordingPool()
    response = post(state_with(pool), big, content_type="text/plain")
    assert pool.bodies == [] and response.status_code in (400, 415, 422), response.text
