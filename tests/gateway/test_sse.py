"""SSE framing used by the streaming relay."""

from __future__ import annotations

from kvik.gateway.sse import EventSplitter, TokenUsage, drop_null_usage, inspect_event


def test_splitter_returns_whole_events_across_arbitrary_reads() -> None:
    splitter = EventSplitter()
    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\r\n\r\n: comment\n\ndata: [DONE]\n\n'
    events = []
    for i in range(0, len(stream), 7):  # 7-byte reads cut events and CRLFs anywhere
        events += splitter.feed(stream[i:i + 7])
    assert events == [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n', b": comment\n\n", b"data: [DONE]\n\n"]
    assert splitter.remainder() == b""


def test_inspect_event_finds_usage_done_and_errors() -> None:
    usage = inspect_event(b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}\n\n')
    assert usage.usage == TokenUsage(3, 4) and usage.usage_only and usage.usage.total_tokens == 7
    content = inspect_event(b'data: {"choices": [{"delta": {"content": "x"}}], "usage": null}\n\n')
    assert content.usage is None and not content.usage_only
    assert inspect_event(b"data: [DONE]\n\n").done
    assert inspect_event(b'data: {"error": {"message": "boom"}}\n\n').error
    assert inspect_event(b": keep-alive\n\n") == inspect_event(b"event: ping\n\n")


def test_drop_null_usage_removes_only_null_usage_members() -> None:
    # kvik serve's shape: `"usage": null` last; vLLM-style compact JSON; first member; in a string.
    assert drop_null_usage(b'data: {"id": "c1", "choices": [{"delta": {}}], "usage": null}\n\n') == (
        b'data: {"id": "c1", "choices": [{"delta": {}}]}\n\n')
    assert drop_null_usage(b'data: {"id":"c1","usage":null,"choices":[]}\n\n') == b'data: {"id":"c1","choices":[]}\n\n'
    assert drop_null_usage(b'data: {"usage": null, "id": "c1"}\n\n') == b'data: {"id": "c1"}\n\n'
    text = b'data: {"choices": [{"delta": {"content": "say \\", \\"usage\\": null"}}]}\n\n'
    assert drop_null_usage(text) == text
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\n'
    assert drop_null_usage(usage) == usage and drop_null_usage(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


def test_inspect_event_counts_content_deltas_and_reads_error_objects() -> None:
    role_only = b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
    assert inspect_event(role_only).content_deltas == 0
    assert inspect_event(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n').content_deltas == 1
    assert inspect_event(b'data: {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]}\n\n'
                         ).content_deltas == 2
    # Generated text that looks like a member is escaped inside the string: not counted twice.
    assert inspect_event(b'data: {"choices": [{"delta": {"content": "\\"content\\": \\"x\\""}}]}\n\n'
                         ).content_deltas == 1
    error = inspect_event(b'data: {"error": {"message": "boom", "type": "server_error"}}\n\n').error
    assert error == {"message": "boom", "type": "server_error"}
    vllm = inspect_event(b'data: {"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}\n\n')
    assert vllm.error is not None and vllm.error["code"] == 400


def test_stream_errors_are_classified_by_who_caused_them() -> None:
    from kvik.gateway.relay import classify_error

    assert classify_error({"message": "engine died", "type": "server_error"}) == (502, False)
    assert classify_error({"message": "x", "type": "invalid_request_error"}) == (400, True)
    assert classify_error({"message": "x", "type": "BadRequestError", "code": 400}) == (400, True)
    assert classify_error({"message": "x", "code": 503}) == (503, False)
    assert classify_error({"message": "x"}) == (502, False)


def test_a_relayed_stream_settles_before_its_last_message() -> None:
    """RelayResponse runs on_close (where the gateway settles the tokens a request held) before the
    body's final message, so a client that sends its next request the moment a stream ends finds
    the last one settled; and exactly once, when the client leaves mid-stream too."""
    import anyio

    from kvik.gateway.relay import RelayResponse

    async def run(leave_after: int | None) -> list[str]:
        events: list[str] = []

        async def content():  # noqa: ANN202
            for part in (b"data: 1\n\n", b"data: 2\n\n"):
                yield part

        async def on_close() -> None:
            await anyio.sleep(0.01)  # settling takes a moment (a database, Redis)
            events.append("settled")

        async def send(message: dict) -> None:  # noqa: ANN001
            if message["type"] == "http.response.body":
                if leave_after is not None and events.count("chunk") == leave_after:
                    raise OSError("client gone")
                events.append("chunk" if message.get("more_body") else "end")

        async def receive() -> dict:
            await anyio.sleep(10)
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        try:
            await RelayResponse(content(), on_close, media_type="text/event-stream")(scope, receive, send)
        except Exception:  # noqa: BLE001 - starlette turns the OSError into ClientDisconnect
            pass
        return events

    assert anyio.run(run, None) == ["chunk", "chunk", "settled", "end"]
    assert anyio.run(run, 1) == ["chunk", "settled"]
