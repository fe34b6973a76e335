"""kvik.core.client_json: a client's JSON with a lone surrogate escape is refused, naming the
field; paired escapes, escaped backslashes and plain text parse as json.loads parses them."""

from __future__ import annotations

import json

import pytest

from kvik.core.client_json import lone_surrogate_path, loads


@pytest.mark.parametrize("raw,expected", [
    (r'{"a": "\ud83d\ude00"}', {"a": "\U0001F600"}),  # a pair: one character
    (r'{"a": "\uD83D\uDE00"}', {"a": "\U0001F600"}),
    (r'{"a": "\\ud800"}', {"a": "\\ud800"}),  # an escaped backslash, then text
    (r'{"a": "caf\u00e9", "b": [1, 2.5, null, true]}', {"a": "café", "b": [1, 2.5, None, True]}),
])
def test_valid_text_parses_as_json_loads(raw, expected):
    assert loads(raw) == expected == json.loads(raw)
    assert loads(raw.encode()) == expected
    assert loads(bytearray(raw.encode())) == expected


@pytest.mark.parametrize("raw,path,escape", [
    (r'{"a": "\ud800"}', "a", r"\ud800"),  # a high half alone
    (r'{"a": "x \udc00 y"}', "a", r"\udc00"),  # a low half alone
    (r'{"a": "\ud800\ud800\udc00"}', "a", r"\ud800"),  # a high half followed by a full pair
    (r'{"a": "\\\ud800"}', "a", r"\ud800"),  # an escaped backslash, then a real escape
    (r'{"m": [{"c": "ok"}, {"c": [{"t": "\udbff"}]}]}', "m.1.c.0.t", r"\udbff"),
    (r'"\ud800"', "the body", r"\ud800"),
])
def test_lone_surrogate_is_refused_naming_the_field(raw, path, escape):
    for text in (raw, raw.encode()):
        with pytest.raises(json.JSONDecodeError) as caught:
            loads(text)
        assert caught.value.msg.startswith(f"{path}: holds the escape {escape}, half of a UTF-16 surrogate pair")
        caught.value.msg.encode("utf-8")  # the message itself can be sent


def test_a_surrogate_in_a_key_is_refused_and_the_message_stays_encodable():
    with pytest.raises(json.JSONDecodeError) as caught:
        loads(rb'{"ok": {"\udbff": 1}}')
    assert caught.value.msg.startswith("ok.\\udbff: holds the escape \\udbff")
    caught.value.msg.encode("utf-8")


def test_path_finder_sees_every_string():
    assert lone_surrogate_path({"a": ["x", {"b": "y"}], "c": 1}) is None
    assert lone_surrogate_path({"a": ["x", {"b": "\ud800"}]}) == ("a.1.b", "\ud800")
