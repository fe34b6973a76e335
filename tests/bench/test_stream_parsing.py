"""What the load generator records from the bytes a server streams (no server: httpx's MockTransport)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvik.bench.load import api_root, endpoint_url, is_token_chunk, send_request
from kvik.bench.load import sse_lines as load_sse_lines
from kvik.bench.stats import RequestRecord
from tests.support.sse import sse_lines


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


class ChunkStream(httpx.SyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks


def test_sync_sse_lines_split_only_at_cr_lf_and_crlf():
    """The tests' sync reader: one line per CR, LF or CRLF, even split across chunks (a CRLF, a UTF-8
    character), never at the raw U+2028 and U+0085 a JSON string may hold."""
    event = "data: " + json.dumps(completion("a\u2028b\x85c"), ensure_ascii=False)
    body = f"{event}\r\n\r\n: keep-alive\rdata: [DONE]\n\nlast".encode()
    cuts = [3, body.index("\u2028".encode()) + 1, body.index(b"\r\n") + 1, body.index(b"alive\r") + 6,
            len(body) - 2]
    chunks = [body[start:end] for start, end in zip([0, *cuts], [*cuts, len(body)])]
    expected = [event, "", ": keep-alive", "data: [DONE]", "", "last"]
    assert list(sse_lines(httpx.Response(200, stream=ChunkStream(chunks)))) == expected
    assert list(httpx.Response(200, stream=ChunkStream(chunks)).iter_lines()) != expected


def test_sync_sse_lines_is_lazy():
    def chunks() -> Iterator[bytes]:
        yield b"data: 1\n"
        raise AssertionError("read past the first line")

    class Stream(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            return chunks()

    assert next(sse_lines(httpx.Response(200, stream=Stream()))) == "data: 1"


def test_async_sse_lines_hold_a_cr_that_ends_a_chunk():
    """kvik bench's own reader splits the same way, a CRLF cut between two chunks included."""
    body = b"data: 1\r\n\r\ndata: 2\rdata: 3"
    cuts = [body.index(b"\r\n") + 1, body.index(b"2\r") + 2]
    chunks = [body[start:end] for start, end in zip([0, *cuts], [*cuts, len(body)])]

    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            for chunk in chunks:
                yield chunk

    async def read() -> list[str]:
        return [line async for line in load_sse_lines(httpx.Response(200, stream=Stream()))]

    assert asyncio.run(read()) == ["data: 1", "", "data: 2", "data: 3"]
