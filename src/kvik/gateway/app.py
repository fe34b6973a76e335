"""The FastAPI application: routes, the error envelope, client limits, and the state's lifetime."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvik.core import tracing
from kvik.core.errors import InvalidRequestError, KvikError, NotFoundError
from kvik.web.client_limits import ClientLimits, send_error
from kvik.gateway.config import GatewayConfig
from kvik.gateway.openapi import add_components
from kvik.gateway.routes import admin, admin_console, batches, conversations, openai, ops, scheduling
from kvik.gateway.serving import ProxyService
from kvik.gateway.state import GatewayState
from kvik.protocol.errors import error_body, error_from_exception
from kvik.protocol.openai import ChatCompletionRequest, CompletionRequest
from kvik.protocol.pooling import ClassifyRequest, EmbeddingRequest
from kvik.protocol.responses import ResponsesRequest
from kvik.web import PageConfig, install_web
from kvik.web.tracing import TracingMiddleware

logger = logging.getLogger("kvik.gateway")

METRICS_PATH = "/metrics"


def create_app(config: GatewayConfig, config_path: Path | None = None) -> FastAPI:
    """The gateway app; with `config_path`, SIGHUP, a change of the file and the admin API reload it."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await GatewayState.start(config, config_path)
        app.state.gateway = state
        app.state.service = ProxyService(state)
        hangup = _on_sighup(lambda: state.reloader.reload_in_background("SIGHUP"))
        try:
            yield
        finally:
            hangup()
            await state.close()

    app = FastAPI(title="kvik gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(openai.router)
    app.include_router(admin.router)
    app.include_router(ops.router)
    app.include_router(admin_console.router)
    app.include_router(conversations.router)
    app.include_router(scheduling.router)
    app.include_router(batches.router)
    install_web(app, PageConfig(product="gateway", conversations="server", console=True))
    served = [name for model in config.models for name in (model.name, *model.aliases)]
    app.openapi = add_components(  # type: ignore[method-assign]
        app, [ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ClassifyRequest, ResponsesRequest,
              admin.KeyCreate],
        served_models=served)
    # Outermost first: which listener may serve what, then the size and time limits on bodies.
    app.add_middleware(ClientLimits, max_body_bytes=config.limits.max_body_bytes,
                       body_timeout_s=config.limits.body_timeout_s)
    app.add_middleware(ListenerGate, metrics_port=config.metrics.port)
    if tracing.enabled():  # outermost: the request's span covers the limits and the last streamed byte
        app.add_middleware(TracingMiddleware)

    @app.exception_handler(KvikError)
    async def on_kvik_error(request: Request, exc: KvikError) -> JSONResponse:
        status, body, headers = error_from_exception(exc)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error: KvikError = NotFoundError(f"Unknown path {request.url.path}.")
        else:
            error = InvalidRequestError(str(exc.detail))
            error.http_status = exc.status_code
        status, body, headers = error_from_exception(error)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, body, headers = error_from_exception(InvalidRequestError(str(exc.errors()[0]["msg"])))
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("The gateway had an internal error.", "server_error"), status_code=500)

    return app


def _on_sighup(handler: Callable[[], None]) -> Callable[[], None]:
    """Run `handler` on SIGHUP; returns the undo. A no-op where signals cannot be handled (not the
    main thread, as with an in-process test client, or Windows)."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, handler)
    except (AttributeError, NotImplementedError, RuntimeError, ValueError):
        return lambda: None
    return lambda: loop.remove_signal_handler(signal.SIGHUP)


class ListenerGate:
    """ASGI middleware for a separate metrics listener (`metrics.port`): `/metrics` is served only
    there, and only `/metrics` is. The listener is told by the local port of the connection."""

    def __init__(self, app: Any, *, metrics_port: int | None) -> None:
        self.app = app
        self.metrics_port = metrics_port

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.metrics_port is not None and scope["type"] == "http":
            server = scope.get("server") or (None, None)
            on_metrics_listener = server[1] == self.metrics_port
            if on_metrics_listener != (scope["path"] == METRICS_PATH):
                await send_error(send, NotFoundError(f"Unknown path {scope['path']}."))
                return
        await self.app(scope, receive, send)
