"""Reading a streaming httpx.Response line by line the way SSE and JSON Lines define a line."""

from __future__ import annotations

from collections.abc import Iterator

import httpx

from kvik.bench.load import SSE_LINE_END


def sse_lines(response: httpx.Response) -> Iterator[str]:
    """Lines ended only at CR, LF or CRLF: httpx's iter_lines() also splits at U+2028, U+0085 etc."""
    buffer = ""
    for text in response.iter_text():
        buffer += text
        # A CR that ends a chunk may be the first half of a CRLF: hold it until the next chunk.
        cut = len(buffer) - 1 if buffer.endswith("\r") else len(buffer)
        *lines, rest = SSE_LINE_END.split(buffer[:cut])
        buffer = rest + buffer[cut:]
        yield from lines
    if buffer:
        yield buffer.removesuffix("\r")
