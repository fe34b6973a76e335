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
