"""GET /v1/models and /v1/models/{model_id}."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from kvik.server.json_body import ParsedBodyRoute
from kvik.server.routes.responses import ERROR_RESPONSES
from kvik.server.state import ServerState

router = APIRouter(route_class=ParsedBodyRoute)


def model_card(state: ServerState, name: str) -> dict[str, Any]:
    adapter = state.lora_adapters.get(name)
    if adapter is not None:  # vLLM's shape: the adapter's directory as root, the base model as parent
        info = state.engine.info if state.engine is not None else None
        return {"id": name, "object": "model", "created": adapter.created, "owned_by": "kvik",
                "root": adapter.path, "parent": state.model_name,
                "max_model_len": info.max_model_len if info else None}
    if state.models is not None:  # several models: say which are loaded now
        pooled = state.models.models[name]
        info = pooled.engine.info if pooled.engine is not None else None
        return {"id": name, "object": "model", "created": state.started, "owned_by": "kvik",
                "root": pooled.spec.args.model, "max_model_len": info.max_model_len if info else None,
                "status": pooled.state.value, "loaded": pooled.engine is not None}
    info = state.engine.info if state.engine is not None else None
    return {"id": name, "object": "model", "created": state.started, "owned_by": "kvik",
            "root": info.model_path if info else None,
            "max_model_len": info.max_model_len if info else None}


@router.get("/v1/models", responses=ERROR_RESPONSES, summary="List the served models")
async def list_models(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    names = [*state.config.served_model_names, *state.lora_adapters]
    return {"object": "list", "data": [model_card(state, n) for n in names]}


@router.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES, summary="Describe a model")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    return model_card(state, state.resolve_model(model_id))
