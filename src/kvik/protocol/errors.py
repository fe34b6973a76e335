"""The OpenAI error envelope, built from `KvikError`s in one place for the server and the gateway."""

from __future__ import annotations

import math
from typing import Any

from kvik.core.errors import KvikError, RetryableError


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` exactly as OpenAI sends it."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_from_exception(exc: KvikError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Map a typed error to (HTTP status, JSON body, extra headers)."""
    headers: dict[str, str] = {}
    if isinstance(exc, RetryableError):
        # Retry-After takes whole seconds; never advertise 0, clients would spin.
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return exc.http_status, error_body(exc.message, exc.error_type, exc.param, exc.code), headers
