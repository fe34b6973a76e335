"""Large JSON bodies are parsed in a worker process, not on the event loop.

`json.loads` holds the GIL: a 5 MB chat body costs 10-15 ms of the loop (more on a busy machine),
during which `/health` and every stream wait. The request gate (`kvik.server.app.RequestGate`) sends
a body larger than `WORKER_PARSE_BYTES` to the tokenizer workers (`PreprocessPool.parse_json`) and
leaves the result in the ASGI scope; the routes' request class hands that to FastAPI instead of
parsing the bytes again. FastAPI then validates the parsed value as usual (well under a
millisecond for one long string), so errors, OpenAPI schema and behaviour are those of a small body.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.routing import APIRoute

from kvik.core import client_json
from kvik.engine.preprocess_pool import ParsedBody

PARSED_BODY_KEY = "kvik.parsed_body"

# Below this a body parses on the loop in well under a millisecond, less than the trip to a worker.
WORKER_PARSE_BYTES = 256 * 1024


def is_json(headers: dict[bytes, bytes]) -> bool:
    """FastAPI reads a body as JSON for `application/json` and `application/*+json` only."""
    content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
    return content_type == b"application/json" or (
        content_type.startswith(b"application/") and content_type.endswith(b"+json"))


class _ParsedRequest(Request):
    async def json(self) -> Any:
        parsed: ParsedBody | None = self.scope.get(PARSED_BODY_KEY)
        if parsed is None:
            if not hasattr(self, "_json"):  # Starlette's cache, as its own json() keeps it
                self._json = client_json.loads(await self.body())
            return self._json
        if parsed.error is not None:  # what json.loads raised, for FastAPI's usual 400
            message, position = parsed.error
            raise json.JSONDecodeError(message, "", position)
        if parsed.failure is not None:  # too deep, not UTF-8: FastAPI's "error parsing the body"
            raise ValueError(parsed.failure)
        return parsed.value


class ParsedBodyRoute(APIRoute):
    """A route that takes the body the gate had parsed in a worker, when it did, and otherwise
    parses it with `kvik.core.client_json` (no lone surrogates)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            return await handler(_ParsedRequest(request.scope, request.receive))

        return route_handler
