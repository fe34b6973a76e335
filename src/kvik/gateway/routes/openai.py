"""The OpenAI-compatible endpoints clients call."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvik.gateway.openapi import request_body
from kvik.gateway.serving import CHAT, CLASSIFY, COMPLETIONS, EMBEDDINGS, RESPONSES, ProxyService
from kvik.gateway.state import GatewayState

router = APIRouter()
_STARTED = int(time.time())


@router.post("/v1/chat/completions", openapi_extra=request_body("ChatCompletionRequest"))
async def chat_completions(request: Request) -> Response:
    service: ProxyService = request.app.state.service
    return await service.handle(request, CHAT)


@router.post("/v1/completions", openapi_extra=request_body("CompletionRequest"))
async def completions(request: Request) -> Response:
    service: ProxyService = request.app.state.service
    return await service.handle(request, COMPLETIONS)


@router.post("/v1/embeddings", openapi_extra=request_body("EmbeddingRequest"))
async def embeddings(request: Request) -> Response:
    service: ProxyService = request.app.state.service
    return await service.handle(request, EMBEDDINGS)


@router.post("/classify", openapi_extra=request_body("ClassifyRequest"))
@router.post("/v1/classify", include_in_schema=False)
async def classify(request: Request) -> Response:
    service: ProxyService = request.app.state.service
    return await service.handle(request, CLASSIFY)


@router.post("/v1/responses", openapi_extra=request_body("ResponsesRequest"))
async def create_response(request: Request) -> Response:
    service: ProxyService = request.app.state.service
    return await service.handle(request, RESPONSES)


@router.get("/v1/responses/{response_id}")
@router.delete("/v1/responses/{response_id}")
async def stored_response(response_id: str, request: Request) -> Response:
    """A stored response, from (or deleted on) the replica that stores it; only the tenant that made
    it can reach it (kvik.gateway.stored_responses)."""
    service: ProxyService = request.app.state.service
    principal = await service.state.auth.authenticate(request.headers.get("authorization"))
    return await service.stored.forward(principal, request.method, response_id)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """The models this gateway serves and the caller's key may use; aliases are listed on each."""
    state: GatewayState = request.app.state.gateway
    principal = await state.auth.authenticate(request.headers.get("authorization"))
    data = []
    for pool in state.router.pools:
        if principal.key is not None and not principal.key.allows_model(pool.name):
            continue
        data.append({"id": pool.name, "object": "model", "created": _STARTED, "owned_by": "kvik",
                     "aliases": list(pool.config.aliases),
                     "healthy_replicas": sum(1 for r in pool.replicas if r.is_available())})
    return JSONResponse({"object": "list", "data": data})
