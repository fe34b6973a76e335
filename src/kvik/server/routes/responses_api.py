"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{response_id}."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvik.protocol.responses import ResponsesRequest
from kvik.server.json_body import ParsedBodyRoute
from kvik.server.routes.responses import ERROR_RESPONSES, GENERATION_RESPONSES

router = APIRouter(route_class=ParsedBodyRoute)


@router.post("/v1/responses", responses={**ERROR_RESPONSES, **GENERATION_RESPONSES},
             summary="Create a model response")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    return await request.app.state.responses.create(body, request)


@router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES, summary="Get a stored response")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    return await request.app.state.responses.retrieve(response_id)


@router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES, summary="Delete a stored response")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    return await request.app.state.responses.delete(response_id)
