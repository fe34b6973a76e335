"""The FastAPI application: routers, authentication, body limits, and one error mapping.

Every error leaves as OpenAI's envelope `{"error": {"message", "type", "param", "code"}}`: typed
`KvikError`s with their own status, validation failures as 400 naming the field, unknown routes 404.
A 500 means a bug, never bad input.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvik import __version__
from kvik.core import tracing
from kvik.core.errors import AuthenticationError, InvalidRequestError, KvikError, RequestTooLargeError
from kvik.core.memory import release_freed_memory
from kvik.protocol.errors import error_body, error_from_exception
from kvik.server.batches.lines import LineServings
from kvik.server.batches.service import BatchService
from kvik.server.json_body import PARSED_BODY_KEY, WORKER_PARSE_BYTES, is_json
from kvik.server.model_pool import lease_scope
from kvik.server.routes import batches, generation, lora, models, ops, pooling, responses_api, tokenize
from kvik.server.serving.chat import ChatServing
from kvik.server.serving.completions import CompletionServing
from kvik.server.serving.pooling import PoolingServing
from kvik.server.serving.responses_api import ResponsesServing
from kvik.server.serving.streams import ClientDisconnected
from kvik.server.state import DRAIN_HEADER, ServerState
from kvik.web import PageConfig, install_web
from kvik.web.tracing import TracingMiddleware

logger = logging.getLogger("kvik.server")

# After a request this large, its freed memory is handed back to the system: without it a replica's
# RSS ratcheted up with every multi-megabyte prompt.
LARGE_BODY_BYTES = 2**20

# Paths that never need a key and never count as in-flight work for draining.
OPS_PATHS = frozenset({"/health", "/metrics"})


class RequestGate:
    """Pure ASGI middleware in front of every route but /health and /metrics: reads the whole body
    before the app sees it, refusing more than the size limit with 413 whether the client declared
    it (Content-Length) or streams it chunked, and a client that sends it too slowly with 408; and
    counts in-flight requests for the graceful drain (streaming responses until their last byte)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPS_PATHS:
            await self.app(scope, receive, send)
            return
        config = self.state.config
        # Batch input files may be larger than a request (the file's own limit is checked on upload).
        limit = max(config.max_body_bytes, config.batch.max_file_bytes + 2**16) \
            if scope["path"] == "/v1/files" else config.max_body_bytes
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_error(send, RequestTooLargeError(
                f"request body is {int(declared)} bytes; the limit is {limit}"))
            return
        self.state.request_started()
        try:
            try:
                body = await asyncio.wait_for(_read_body(receive, limit), config.body_read_timeout)
            except asyncio.TimeoutError:
                await _send_error(send, _BodyTimeout(
                    f"the request body did not arrive within {config.body_read_timeout:.0f} s"))
                return
            except KvikError as exc:
                await _send_error(send, exc)
                return
            if body is None:  # the client left while sending
                return
            if len(body) > WORKER_PARSE_BYTES and scope["method"] == "POST" and is_json(headers):
                pool = self.state.preprocess_pool()
                if pool is not None:
                    try:
                        scope[PARSED_BODY_KEY] = await pool.parse_json(body)
                    except KvikError as exc:
                        await _send_error(send, exc)
                        return
            with lease_scope():  # models the request used stay loaded until its last byte is sent
                await self.app(scope, _replay(body, receive), self._mark_draining(send))
            if len(body) > LARGE_BODY_BYTES:
                del body
                release_freed_memory()
        finally:
            self.state.request_finished()


    def _mark_draining(self, send: Send) -> Send:
        """`send`, adding `x-kvik-draining` to a response that starts after SIGTERM."""
        state = self.state

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start" and state.shutting_down:
                message = {**message, "headers": [*message.get("headers", ()), _DRAIN_HEADER_PAIR]}
            await send(message)

        return marked


_DRAIN_HEADER_PAIR = (DRAIN_HEADER.encode(), b"1")


class _BodyTimeout(InvalidRequestError):
    http_status = 408
    code = "request_timeout"


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestTooLargeError(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the real channel (for disconnects)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _send_error(send: Send, exc: KvikError) -> None:
    status, body, headers = error_from_exception(exc)
    response = JSONResponse(body, status_code=status, headers=headers)
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def _field_path(loc: Any) -> list[str]:
    """A field named as OpenAI names it: `limit`, not FastAPI's `query.limit` (nor `body.model`)."""
    parts = list(loc)
    if parts[:1] in (["body"], ["query"]):
        parts = parts[1:]
    return [str(part) for part in parts]


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        # FastAPI's msg is a constant ("JSON decode error"); the parser's own message is in ctx.
        detail = (first.get("ctx") or {}).get("error") or first.get("msg")
        position = first.get("loc", ())[-1:]
        if position and isinstance(position[0], int) and position[0] > 0:
            detail = f"{detail} at character {position[0]}"
        return f"the request body is not valid JSON ({detail})", None
    locations = [_field_path(e.get("loc", ())) for e in errors]
    location = locations[0]
    top = location[0] if location else None
    # A value matching none of a union's branches (prompt: str | list[str] | ...) fails once per
    # branch, with the branch name in the location: report the field, not the branch.
    if top and len(errors) > 1 and all(loc[:1] == [top] for loc in locations) and \
            len({tuple(loc) for loc in locations}) > 1 and not location[1:2] == ["0"]:
        return f"{top}: has the wrong type or shape ({first.get('msg')})", top
    param = ".".join(location) or None
    if first.get("type") == "missing" and param:
        return f"{param}: field required", param
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return message, param


def create_app(state: ServerState) -> FastAPI:
    # async: FastAPI runs a plain `def` dependency on its thread pool, a thread hop per request.
    async def check_api_key(request: Request) -> None:
        expected = state.config.api_key
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
            raise AuthenticationError("Incorrect or missing API key: send 'Authorization: Bearer <key>'")

    app = FastAPI(title="kvik", version=__version__,
                  description="OpenAI-compatible server for kvik's paged-KV engine.")
    app.state.server = state
    app.state.chat = ChatServing(state)
    app.state.completions = CompletionServing(state)
    app.state.pooling = PoolingServing(state)
    app.state.responses = ResponsesServing(state)
    app.state.batches = BatchService(state, state.config.batch, LineServings(
        app.state.chat, app.state.completions, app.state.pooling, app.state.responses))
    keyed = [Depends(check_api_key)]
    app.include_router(generation.router, dependencies=keyed)
    app.include_router(pooling.router, dependencies=keyed)
    app.include_router(responses_api.router, dependencies=keyed)
    app.include_router(models.router, dependencies=keyed)
    app.include_router(tokenize.router, dependencies=keyed)
    app.include_router(batches.router, dependencies=keyed)
    app.include_router(ops.router)
    # The admin key, not the API key; checked before the body is read.
    app.include_router(lora.router, dependencies=[Depends(lora.check_admin_key)])
    install_web(app, PageConfig(product="server", conversations="browser"))
    app.add_middleware(RequestGate, state=state)
    if tracing.enabled():  # outermost: the request's span covers the gate and the last streamed byte
        app.add_middleware(TracingMiddleware)

    @app.exception_handler(KvikError)
    async def kvik_error(request: Request, exc: KvikError) -> Response:
        status, body, headers = error_from_exception(exc)
        if status >= 500 and status != 503:
            logger.error("request failed: %s", exc.message)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        message, param = validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param, None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code: Any = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "server_error", None, None),
                            status_code=500)

    return app
