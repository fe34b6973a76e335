"""Admin routes for a key's priority tier and fair-share weight:

    GET /admin/keys/{key_id}/scheduling  -> {"tier", "weight", "priority"}
    PUT /admin/keys/{key_id}/scheduling  {"tier": "background", "weight": 1.0}
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from kvik.core.errors import InvalidRequestError
from kvik.gateway.audit import record_admin_action
from kvik.gateway.auth import BOOTSTRAP_ADMIN_ID
from kvik.gateway.state import GatewayState

router = APIRouter(prefix="/admin")


class SchedulingUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tier: str
    weight: float = 1.0


async def _admin(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    await state.auth.authenticate_admin(request.headers.get("authorization"))
    return state


async def _check_key(state: GatewayState, key_id: str) -> None:
    if key_id != BOOTSTRAP_ADMIN_ID:
        await asyncio.to_thread(state.keys.get, key_id)  # 404 for an unknown key


@router.get("/keys/{key_id}/scheduling")
async def get_scheduling(key_id: str, request: Request) -> Response:
    state = await _admin(request)
    await _check_key(state, key_id)
    current = await asyncio.to_thread(state.scheduling.get, key_id)
    return JSONResponse(current.to_public_dict(state.config.scheduling.tiers[current.tier]))


@router.put("/keys/{key_id}/scheduling")
async def set_scheduling(key_id: str, request: Request) -> Response:
    state = await _admin(request)
    await _check_key(state, key_id)
    try:
        update = SchedulingUpdate.model_validate_json(await request.body())
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        raise InvalidRequestError(f"{param}: {error['msg']}" if param else error["msg"], param=param) from None
    updated = await asyncio.to_thread(state.scheduling.set, key_id, update.tier, update.weight)
    await record_admin_action(request, "key.scheduling", key_id, update.model_dump())
    return JSONResponse(updated.to_public_dict(state.config.scheduling.tiers[updated.tier]))
