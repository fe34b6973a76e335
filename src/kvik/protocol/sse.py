"""Server-sent events framing as the OpenAI streaming API uses it."""

from __future__ import annotations

import json
from typing import Any

DONE_FRAME = b"data: [DONE]\n\n"


def sse_frame(payload: dict[str, Any]) -> bytes:
    """One `data: {...}` event; compact JSON, non-ASCII kept as is (UTF-8 on the wire)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
