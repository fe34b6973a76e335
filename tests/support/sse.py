"""Reading a streaming httpx.Response line by line the way SSE and JSON Lines define a line."""

from __future__ import annotations

from collections.abc import Iterator

import httpx

from kvik.bench.load import split_sse_lines


def sse_lines(response: httpx.Response) -> Iterator[str]:
    """Lines ended only at CR, LF or CRLF: httpx's iter_lines() also splits at U+2028, U+0085 etc."""
    buffer = ""
    for text in response.iter_text():
        lines, buffer = split_sse_lines(buffer + text)
        yield from lines
    if buffer:
        yield buffer.removesuffix("\r")
