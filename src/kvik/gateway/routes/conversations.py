"""The chat page's conversation store: `/ui/conversations`, per API key (see `conversations.py`).

Authentication is the bearer key, as for the model endpoints; no cookie is involved anywhere, so a
cross-site page cannot make the browser act on a user's conversations (no ambient credentials).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvik.core import client_json
from kvik.core.errors import InvalidRequestError, RequestTooLargeError
from kvik.gateway.conversations import ANONYMOUS_OWNER, MAX_DOCUMENT_BYTES, ConversationStore
from kvik.gateway.state import GatewayState

router = APIRouter(prefix="/ui/conversations")
# The document limit plus room for the title and the JSON around it.
MAX_BODY_BYTES = MAX_DOCUMENT_BYTES + 64 * 1024


async def _owner(request: Request) -> tuple[ConversationStore, str]:
    state: GatewayState = request.app.state.gateway
    principal = await state.auth.authenticate(request.headers.get("authorization"))
    return ConversationStore(state.db), principal.key_id or ANONYMOUS_OWNER


async def _json_body(request: Request) -> dict[str, Any]:
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise RequestTooLargeError(f"The request body is over {MAX_BODY_BYTES} bytes.")
    try:
        body = client_json.loads(raw)
    except ValueError as exc:
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    unknown = set(body) - {"title", "data"}
    if unknown:
        raise InvalidRequestError(f"{sorted(unknown)[0]}: unknown field; send title and/or data",
                                  param=sorted(unknown)[0])
    return body


@router.get("")
async def list_conversations(request: Request) -> Response:
    store, owner = await _owner(request)
    query = request.query_params.get("q") or None
    if query is not None and len(query) > 200:
        raise InvalidRequestError("q: search for at most 200 characters", param="q")
    limit_text = request.query_params.get("limit", "100")
    if not limit_text.isdigit():
        raise InvalidRequestError("limit: give a whole number", param="limit")
    rows = await asyncio.to_thread(store.list, owner, query=query, limit=int(limit_text))
    return JSONResponse({"object": "list", "data": [row.to_dict() for row in rows]})


@router.post("")
async def create_conversation(request: Request) -> Response:
    store, owner = await _owner(request)
    body = await _json_body(request)
    summary = await asyncio.to_thread(store.create, owner, body.get("title"), body.get("data"))
    return JSONResponse(summary.to_dict(), status_code=201)


@router.get("/{conversation_id}")
async def get_conversation(request: Request, conversation_id: str) -> Response:
    store, owner = await _owner(request)
    return JSONResponse(await asyncio.to_thread(store.get, owner, conversation_id))


@router.patch("/{conversation_id}")
async def update_conversation(request: Request, conversation_id: str) -> Response:
    store, owner = await _owner(request)
    body = await _json_body(request)
    if body.get("title") is None and body.get("data") is None:
        raise InvalidRequestError("send title and/or data to change", param="title")
    summary = await asyncio.to_thread(store.update, owner, conversation_id, title=body.get("title"),
                                      data=body.get("data"))
    return JSONResponse(summary.to_dict())


@router.delete("/{conversation_id}")
async def delete_conversation(request: Request, conversation_id: str) -> Response:
    store, owner = await _owner(request)
    await asyncio.to_thread(store.delete, owner, conversation_id)
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})
