"""`text_size` is what the size checks see of a request: the UTF-8 bytes of its strings, counted
without serializing (the server calls it on the event loop, for conversations of megabytes)."""

from __future__ import annotations

import json

from kvik.engine.input_processor import text_size, utf8_size


def test_counts_utf8_bytes_of_every_string_and_key():
    assert utf8_size("abc") == 3
    assert utf8_size("é€😀") == 2 + 3 + 4
    assert utf8_size("\ud800") == 3  # a lone surrogate (JSON allows it) counts, as it did when encoded
    messages = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": None},
                {"role": "tool", "content": [{"type": "text", "text": "日本"}], "n": 12, "ok": True}]
    expected = (len("role") * 3 + len("content") * 3 + len("user") + len("héllo".encode()) + len("assistant")
                + len("tool") + len("type") + len("text") * 2 + len("日本".encode()) + len("n") + 2
                + len("ok") + len("True"))
    assert text_size(messages) == expected
    # Never more than the JSON text itself (which adds quotes, separators and escapes).
    assert text_size(messages) <= len(json.dumps(messages, ensure_ascii=False).encode())


def test_deep_nesting_does_not_recurse():
    value: object = "x"
    for _ in range(100_000):
        value = {"a": [value]}
    assert text_size(value) == 100_000 + 1
