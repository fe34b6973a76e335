"""The OpenAI-compatible endpoints clients call."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvik.gateway.openapi import request_body
from kvik.gateway.request_body import Endpoint
from kvik.gateway.serving import CHAT, CLASSIFY, COMPLETIONS, EMBEDDINGS, RESPONSES, ProxyService
from kvik.gateway.state import GatewayState

router = APIRouter()
_STARTED = int(time.time())


def _proxied(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    """The route of an endpoint the gateway proxies (kvik.gateway.serving's pipeline)."""

    async def route(request: Request) -> Response:
        service: ProxyService = request.app.state.service
        return await service.handle(request, endpoint)

    return route


# (path, endpoint, the request schema in /openapi.json); /v1/classify is /classify's alias, as on kvik serve.
for _path, _endpoint, _schema in (
        ("/v1/chat/completions", CHAT, "ChatCompletionRequest"), ("/v1/completions", COMPLETIONS, "CompletionRequest"),
        ("/v1/embeddings", EMBEDDINGS, "EmbeddingRequest"), ("/classify", CLASSIFY, "ClassifyRequest"),
        ("/v1/classify", CLASSIFY, None), ("/v1/responses", RESPONSES, "ResponsesRequest")):
    router.add_api_route(_path, _proxied(_endpoint), methods=["POST"], name=_endpoint.name,
                         include_in_schema=_schema is not None,
                         openapi_extra=request_body(_schema) if _schema else None)


@router.get("/v1/responses/{response_id}")
@router.delete("/v1/responses/{response_id}")
async def stored_response(response_id: str, request: Request) -> Response:
    """A stored response, from (or deleted on) the replica that stores it; only the tenant that made
    it can reach it (kvik.gateway.stored_responses)."""
    service: ProxyService = request.app.state.service
    principal = await service.state.auth.authenticate(request.headers.get("authorization"))
    return await service.stored.forward(principal, request.method, response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def stored_response_input_items(response_id: str, request: Request) -> Response:
    """The input items of a stored response, from the replica that stores it (query passed on)."""
    service: ProxyService = request.app.state.service
    principal = await service.state.auth.authenticate(request.headers.get("authorization"))
    return await service.stored.forward(principal, "GET", response_id, suffix="/input_items",
                                        query=request.url.query)


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
