"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters at run time (admin only).

The shapes are vLLM's. The engine core reads and checks the adapter (kvik.engine.lora_manager), so
this process never touches torch; its typed errors come back as 400 (not an adapter, rank above
--max-lora-rank, another base model), 404 (unknown name) or 409 (name taken, adapter in use).
Both endpoints need `Authorization: Bearer <--admin-api-key>`; without that flag they answer 403,
since loading reads a directory of the server's machine.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, Request

from kvik.core.errors import (AuthenticationError, ConflictError, InvalidRequestError, PermissionDeniedError)
from kvik.protocol.openai import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from kvik.server.json_body import ParsedBodyRoute
from kvik.server.routes.models import model_card
from kvik.server.routes.responses import ERROR_RESPONSES
from kvik.server.state import ServerState

router = APIRouter(route_class=ParsedBodyRoute)


async def check_admin_key(request: Request) -> None:  # async: no thread-pool hop
    state: ServerState = request.app.state.server
    expected = state.config.admin_api_key
    if expected is None:
        raise PermissionDeniedError("runtime LoRA adapter updates are off on this server: start kvik serve with "
                                    "--admin-api-key KEY (or $KVIK_ADMIN_API_KEY) and send that key")
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise AuthenticationError("this endpoint needs the admin key: send 'Authorization: Bearer <admin key>'")


def _lora_engine(state: ServerState) -> Any:
    engine = state.require_engine()
    if not engine.info.enable_lora:
        raise InvalidRequestError("this server does not serve LoRA adapters; start it with --enable-lora")
    return engine


@router.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES, summary="Serve a LoRA adapter (admin)")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    engine = _lora_engine(state)
    if body.lora_name in state.config.served_model_names:
        raise ConflictError(f"lora_name: {body.lora_name!r} is the base model's name; pick another",
                            param="lora_name")
    info = await engine.add_lora(body.lora_name, body.lora_path)
    state.lora_adapters[info.name] = info
    return model_card(state, info.name)


@router.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES, summary="Stop serving a LoRA adapter (admin)")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    engine = _lora_engine(state)
    await engine.remove_lora(body.lora_name)
    state.lora_adapters.pop(body.lora_name, None)
    return {"id": body.lora_name, "object": "model", "deleted": True}
