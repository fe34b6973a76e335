"""OpenAI's Files and Batches endpoints (the subset the Batch API uses), scoped to the caller's tenant.

POST /v1/files (multipart: file, purpose=batch), GET /v1/files, GET /v1/files/{id},
GET /v1/files/{id}/content, DELETE /v1/files/{id}; POST /v1/batches, GET /v1/batches,
GET /v1/batches/{id}, POST /v1/batches/{id}/cancel.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Form, Query, Request, UploadFile
from fastapi.responses import Response

from kvik.core.errors import InvalidRequestError
from kvik.server.batches.service import BatchService, Caller, caller_from_headers, file_object
from kvik.server.json_body import ParsedBodyRoute
from kvik.server.routes.responses import ERROR_RESPONSES

router = APIRouter(route_class=ParsedBodyRoute)


def _service(request: Request) -> tuple[BatchService, Caller]:
    service: BatchService = request.app.state.batches
    service.require_enabled()
    return service, caller_from_headers(request.headers)


@router.post("/v1/files", responses=ERROR_RESPONSES, summary="Upload a Batch API input file (JSON Lines)")
async def upload_file(request: Request, file: UploadFile | None = None, purpose: str | None = Form(default=None)
                      ) -> dict[str, Any]:
    service, caller = _service(request)
    if file is None:
        raise InvalidRequestError("file: send the file as multipart/form-data field 'file'", param="file")
    if purpose is None:
        raise InvalidRequestError("purpose: field required (use 'batch')", param="purpose")
    content = await file.read()
    return await service.upload(caller, purpose, file.filename or "", content)


@router.get("/v1/files", responses=ERROR_RESPONSES, summary="List files")
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = Query(default=10000, ge=1, le=10000), order: str = "desc") -> dict[str, Any]:
    service, caller = _service(request)
    return await service.list_files(caller, purpose, after, limit, order)


@router.get("/v1/files/{file_id}", responses=ERROR_RESPONSES, summary="Describe a file")
async def get_file(file_id: str, request: Request) -> dict[str, Any]:
    service, caller = _service(request)
    return file_object(await service.get_file(caller, file_id))


@router.get("/v1/files/{file_id}/content", responses=ERROR_RESPONSES, summary="A file's content")
async def file_content(file_id: str, request: Request) -> Response:
    service, caller = _service(request)
    row = await service.get_file(caller, file_id, content=True)
    return Response(bytes(row["content"]), media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", responses=ERROR_RESPONSES, summary="Delete a file")
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    service, caller = _service(request)
    return await service.delete_file(caller, file_id)


@router.post("/v1/batches", responses=ERROR_RESPONSES, summary="Create a batch")
async def create_batch(request: Request) -> dict[str, Any]:
    service, caller = _service(request)
    try:
        body = await request.json()
    except ValueError:
        raise InvalidRequestError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return await service.create_batch(caller, body)


@router.get("/v1/batches", responses=ERROR_RESPONSES, summary="List batches, newest first")
async def list_batches(request: Request, after: str | None = None,
                       limit: int = Query(default=20, ge=1, le=100)) -> dict[str, Any]:
    service, caller = _service(request)
    return await service.list_batches(caller, after, limit)


@router.get("/v1/batches/{batch_id}", responses=ERROR_RESPONSES, summary="Describe a batch")
async def get_batch(batch_id: str, request: Request) -> dict[str, Any]:
    service, caller = _service(request)
    return await service.get_batch(caller, batch_id)


@router.post("/v1/batches/{batch_id}/cancel", responses=ERROR_RESPONSES, summary="Cancel a batch")
async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
    service, caller = _service(request)
    return await service.cancel_batch(caller, batch_id)
