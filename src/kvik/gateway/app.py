"""The FastAPI application: routes, the error envelope, and the state's lifetime."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvik.core.errors import InvalidRequestError, KvikError, NotFoundError
from kvik.gateway.config import GatewayConfig
from kvik.gateway.routes import admin, admin_console, batches, conversations, openai, ops, tenancy
from kvik.gateway.serving import ProxyService
from kvik.gateway.state import GatewayState
from kvik.protocol.errors import error_body, error_from_exception
from kvik.web import PageConfig, install_web

logger = logging.getLogger("kvik.gateway")


def create_app(config: GatewayConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await GatewayState.start(config)
        app.state.gateway = state
        app.state.service = ProxyService(state)
        try:
            yield
        finally:
            await state.close()

    app = FastAPI(title="kvik gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(openai.router)
    app.include_router(admin.router)
    app.include_router(ops.router)
    app.include_router(admin_console.router)
    app.include_router(conversations.router)
    app.include_router(tenancy.router)
    app.include_router(batches.router)
    install_web(app, PageConfig(product="gateway", conversations="server", console=True))

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
