"""What the load generator records from the bytes a server streams (no server: httpx's MockTransport)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from kvik.bench.load import api_root, endpoint_url, is_token_chunk, send_request
from kvik.bench.stats import RequestRecord


def sse(*payloads: Any, done: bool = True) -> bytes:
    frames = [f"data: {json.dumps(p)}\n\n" for p in payloads]
    return ("".join(frames) + (": keep-alive\n\ndata: [DONE]\n\n" if done else "")).encode()


def completion(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def chat(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def usage(prompt: int, output: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": output,
                                     "total_tokens": prompt + output}}


def record_of(status: int, body: bytes, is_chat: bool = False) -> RequestRecord:
    async def go() -> RequestRecord:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, "http://test/v1/completions", {}, {"prompt": "x"},
                                      RequestRecord(index=0, prompt_tokens=3), is_chat, time.perf_counter())

    return asyncio.run(go())


def test_completion_stream_with_usage():
    # The empty piece is a token whose bytes do not yet make a character; it still counts.
    record = record_of(200, sse(completion("a"), completion(""), completion("bc", "length"), usage(7, 3)))
    assert record.success and record.error is None
    assert record.output_tokens == 3 and record.prompt_tokens == 7
    assert record.ttft_s is not None and record.e2e_s is not None and record.e2e_s >= record.ttft_s
    assert len(record.itl_s) == 2


def test_without_usage_tokens_are_counted_as_chunks():
    record = record_of(200, sse(completion("a"), completion("b"), completion("", "length")))
    assert record.success and record.output_tokens == 2 and len(record.itl_s) == 1
    assert record.prompt_tokens == 3  # the workload's own count stays


def test_chat_role_header_and_finish_chunk_are_not_tokens():
    body = sse(chat({"role": "assistant", "content": ""}), chat({"content": "Hi"}),
               chat({"content": " there"}), chat({}, "length"), usage(5, 2))
    record = record_of(200, body, is_chat=True)
    assert record.success and record.output_tokens == 2 and len(record.itl_s) == 1


@pytest.mark.parametrize("payload, chat_endpoint, expected", [
    (completion("x"), False, True),
    (completion(""), False, True),
    (completion("", "stop"), False, False),
    (completion("end", "stop"), False, True),
    (usage(1, 1), False, False),
    (chat({"role": "assistant", "content": ""}), True, False),
    (chat({"role": "assistant", "content": "Hi"}), True, True),
    (chat({}), True, True),
    (chat({}, "stop"), True, False),
])
def test_is_token_chunk(payload, chat_endpoint, expected):
    assert is_token_chunk(payload, chat_endpoint) is expected


@pytest.mark.parametrize("status, body, message", [
    (503, b'{"error": {"message": "overloaded"}}', "HTTP 503"),
    (200, sse(completion("a"), {"error": {"message": "generation failed"}}), "error in stream"),
    (200, sse(completion("a"), done=False), "without [DONE]"),
    (200, sse(usage(1, 0)), "without generating"),
    (200, b"data: {not json\n\n", "JSONDecodeError"),
])
def test_failures_are_recorded_not_raised(status, body, message):
    record = record_of(status, body)
    assert not record.success and message in record.error


def test_connection_errors_are_recorded():
    async def go() -> RequestRecord:
        def refuse(request: httpx.Request) -> httpx.Response:
            raise httpx.ConnectError("connection refused", request=request)

        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
            return await send_request(client, "http://test/v1/completions", {}, {}, RequestRecord(index=0),
                                      False, time.perf_counter())

    record = asyncio.run(go())
    assert not record.success and record.error.startswith("ConnectError")


def test_urls_accept_a_base_with_or_without_v1():
    assert api_root("http://h:8000/v1/") == api_root("http://h:8000") == "http://h:8000"
    assert endpoint_url("http://h:8000/v1", "chat") == "http://h:8000/v1/chat/completions"
    assert endpoint_url("http://h:8000", "completions") == "http://h:8000/v1/completions"


def test_raw_line_separators_inside_json_strings_do_not_split_an_event():
    """JSON may carry U+2028 and U+0085 unescaped (pydantic and orjson do); SSE lines end only at CR,
    LF or CRLF, so such a token is one event (httpx's aiter_lines() would split it)."""
    frames = [json.dumps(p, ensure_ascii=False) for p in (completion("a\u2028b"), completion("c\x85", "length"),
                                                          usage(7, 2))]
    body = "".join(f"data: {frame}\r\n\r\n" for frame in frames) + "data: [DONE]\n\n"
    record = record_of(200, body.encode())
    assert record.success and record.error is None, record.error
    assert record.output_tokens == 2
