"""POST /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvik.protocol.openai import ChatCompletionRequest, CompletionRequest
from kvik.server.json_body import ParsedBodyRoute
from kvik.server.routes.responses import ERROR_RESPONSES, GENERATION_RESPONSES

router = APIRouter(route_class=ParsedBodyRoute)


@router.post("/v1/chat/completions", responses={**ERROR_RESPONSES, **GENERATION_RESPONSES},
             summary="Create a chat completion")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await request.app.state.chat.create(body, request)


@router.post("/v1/completions", responses={**ERROR_RESPONSES, **GENERATION_RESPONSES},
             summary="Create a completion")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await request.app.state.completions.create(body, request)
