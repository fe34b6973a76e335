"""/v1/files and /v1/batches through the gateway (see kvik.gateway.batch_proxy)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvik.gateway.batch_proxy import BatchProxy

router = APIRouter()

_PASSED_HEADERS = ("content-type",)


async def _forward(request: Request, path: str) -> Response:
    state = request.app.state.gateway
    principal = await state.auth.authenticate(request.headers.get("authorization"))
    body = await request.body()  # bounded in size and time by the ClientLimits middleware
    answer = await BatchProxy(state).forward(principal, request.method, path, request.url.query, body,
                                             request.headers.get("content-type"))
    headers = {name: answer.headers[name] for name in _PASSED_HEADERS if name in answer.headers}
    return Response(answer.content, status_code=answer.status_code, headers=headers)


@router.post("/v1/files")
@router.get("/v1/files")
async def files(request: Request) -> Response:
    return await _forward(request, "/v1/files")


@router.get("/v1/files/{file_id}")
@router.delete("/v1/files/{file_id}")
async def one_file(file_id: str, request: Request) -> Response:
    return await _forward(request, f"/v1/files/{file_id}")


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    return await _forward(request, f"/v1/files/{file_id}/content")


@router.post("/v1/batches")
@router.get("/v1/batches")
async def batches(request: Request) -> Response:
    return await _forward(request, "/v1/batches")


@router.get("/v1/batches/{batch_id}")
async def one_batch(batch_id: str, request: Request) -> Response:
    return await _forward(request, f"/v1/batches/{batch_id}")


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> Response:
    return await _forward(request, f"/v1/batches/{batch_id}/cancel")
