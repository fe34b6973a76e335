"""A Batch API input file: JSON Lines, one request per line, checked when it is uploaded.

Each line is `{"custom_id": str, "method": "POST", "url": "/v1/chat/completions", "body": {...}}`,
as OpenAI's. A file that breaks the shape is refused at upload with a 400 naming the first bad line
(1-based, as an editor shows it), so nothing is discovered hours into a batch. Whether a body is a
valid request for the model is checked when the line runs; a line that is not goes to the batch's
error file with the 400 the endpoint would have given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvik.core import client_json
from kvik.core.errors import InvalidRequestError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_CUSTOM_ID_CHARS = 512


@dataclass(slots=True)
class BatchLine:
    index: int  # 0-based among the requests
    file_line: int  # 1-based line number in the file
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_input_file(content: bytes, max_lines: int) -> list[BatchLine]:
    """Every request of the file, or InvalidRequestError naming the first bad line. Blank lines are
    skipped."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"file: is not UTF-8 text (byte {exc.start}); upload JSON Lines",
                                  param="file") from None
    lines: list[BatchLine] = []
    seen: set[str] = set()
    # JSON Lines end at "\n" (a "\r" before it is dropped). Not str.splitlines(): it also splits at
    # U+2028, U+0085 and other characters JSON carries raw inside strings (JSON.stringify and
    # orjson write them unescaped), which would cut one request in two.
    for number, raw in enumerate((line.removesuffix("\r") for line in text.split("\n")), start=1):
        if not raw.strip():
            continue
        if len(lines) >= max_lines:
            raise InvalidRequestError(f"file: has more than {max_lines} requests; split it into several batches",
                                      param="file")
        lines.append(_parse_line(raw, number, len(lines), seen))
    if not lines:
        raise InvalidRequestError("file: has no requests (one JSON object per line)", param="file")
    return lines


def _parse_line(raw: str, number: int, index: int, seen: set[str]) -> BatchLine:
    def bad(message: str) -> InvalidRequestError:
        return InvalidRequestError(f"file: line {number}: {message}", param="file")

    try:
        item = client_json.loads(raw)
    except ValueError as exc:
        raise bad(f"is not valid JSON ({exc})") from None
    if not isinstance(item, dict):
        raise bad("must be a JSON object with custom_id, method, url and body")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise bad(f"custom_id: give a string of 1 to {MAX_CUSTOM_ID_CHARS} characters")
    if custom_id in seen:
        raise bad(f"custom_id {custom_id!r} is used by an earlier line; each line needs its own")
    seen.add(custom_id)
    if item.get("method", "POST") != "POST":
        raise bad(f"method: {item.get('method')!r} is not supported; use POST")
    url = item.get("url")
    if url not in ENDPOINTS:
        raise bad(f"url: {url!r} is not one of {', '.join(ENDPOINTS)}")
    body = item.get("body")
    if not isinstance(body, dict):
        raise bad("body: must be a JSON object (the request's body)")
    return BatchLine(index, number, custom_id, url, body)
