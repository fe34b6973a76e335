"""POST /v1/embeddings (OpenAI) and /classify (vLLM's shape; also at /v1/classify)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvik.protocol.pooling import ClassifyRequest, EmbeddingRequest
from kvik.server.json_body import ParsedBodyRoute
from kvik.server.routes.responses import ERROR_RESPONSES

router = APIRouter(route_class=ParsedBodyRoute)


@router.post("/v1/embeddings", responses=ERROR_RESPONSES, summary="Create embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    return await request.app.state.pooling.embeddings(body, request)


@router.post("/classify", responses=ERROR_RESPONSES,
             summary="Classify inputs with a sequence-classification (e.g. reward) model")
@router.post("/v1/classify", responses=ERROR_RESPONSES, include_in_schema=False)
async def classify(body: ClassifyRequest, request: Request) -> Response:
    return await request.app.state.pooling.classify(body, request)
