"""OpenAPI documentation of responses, so generated clients and schemathesis know the shapes."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("Invalid request (the `param` field names the culprit)"),
    401: _error("Missing or wrong API key"),
    404: _error("Unknown model"),
    413: _error("Request body too large"),
    503: _error("Loading, draining or at capacity; see Retry-After"),
}

GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "A completion object, or an event stream of chunks when `stream` is true",
          "content": {"application/json": {}, "text/event-stream": {}}},
}
