"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{response_id}, and
GET /v1/responses/{response_id}/input_items."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request
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


@router.get("/v1/responses/{response_id}/input_items", responses=ERROR_RESPONSES,
            summary="List the input items of a stored response")
async def list_input_items(response_id: str, request: Request, after: str | None = Query(None, max_length=128),
                           limit: int = Query(20, ge=1, le=100),
                           order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
    return await request.app.state.responses.input_items(response_id, after=after, limit=limit, order=order)


@router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES, summary="Delete a stored response")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    return await request.app.state.responses.delete(response_id)
