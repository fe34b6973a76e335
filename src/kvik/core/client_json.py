"""JSON from clients, refusing strings that are not Unicode.

`json.loads` accepts `"\\ud800"`: the escape of one half of a UTF-16 surrogate pair without the
other half. Python keeps it as a lone surrogate code point, which no UTF-8 encoder will write, so
the request would fail wherever its text is next encoded (the message to the engine process, the
tokenizer, SQLite), as a 500 after the server had accepted it. RFC 8259 (section 8.2) leaves the
behaviour of such strings unpredictable; kvik refuses them where a client's JSON is parsed, with a
`json.JSONDecodeError` (a ValueError) that names the field. Raw bytes cannot smuggle one in: a
surrogate is not valid UTF-8, and decoding the body already fails.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Only text with a surrogate escape in it is searched after parsing: most bodies have none, and a
# scan for this literal prefix costs a fraction of the parse.
_ESCAPE = {bytes: re.compile(rb"\\u[dD][89a-fA-F]"), str: re.compile(r"\\u[dD][89a-fA-F]")}
_SURROGATE = re.compile("[\ud800-\udfff]")


def loads(raw: bytes | bytearray | str) -> Any:
    """`json.loads`, refusing a string (value or key) that holds a lone surrogate."""
    value = json.loads(raw)
    if _ESCAPE[str if isinstance(raw, str) else bytes].search(raw):
        where = lone_surrogate_path(value)
        if where is not None:
            path, text = where
            # The path may itself hold the surrogate (a key): escaped, so the message can be sent.
            path = path.encode("utf-8", "backslashreplace").decode("utf-8")
            found = _SURROGATE.search(text).group()
            raise json.JSONDecodeError(
                f"{path or 'the body'}: holds the escape \\u{ord(found):04x}, half of a UTF-16 surrogate pair "
                "without the other half; send valid Unicode", "", 0)
    return value


def lone_surrogate_path(value: Any) -> tuple[str, str] | None:
    """The first string in a parsed JSON value (keys included) that holds a lone surrogate: its
    path ("messages.0.content") and the string, or None. (A paired escape parses to one character.)"""
    if not _holds_surrogate(value):  # the common case, without building a path per node
        return None
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path, item
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                inner = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    return inner, key
                stack.append((inner, child))
        elif isinstance(item, list):
            stack.extend((f"{path}.{index}" if path else str(index), child)
                         for index, child in reversed(list(enumerate(item))))
    return None


def _holds_surrogate(value: Any) -> bool:
    search = _SURROGATE.search
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if search(item):
                return True
        elif isinstance(item, dict):
            for key in item:
                if search(key):
                    return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
