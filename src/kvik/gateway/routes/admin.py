"""The admin API: keys, usage and replica state. Every route needs a key with the admin role."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from kvik.core.errors import ConfigError, InvalidRequestError
from kvik.gateway.audit import record_action, record_admin_action
from kvik.gateway.keys import MAX_LIMIT
from kvik.gateway.openapi import request_body
from kvik.gateway.state import GatewayState
from kvik.gateway.usage import aggregate_usage

router = APIRouter(prefix="/admin")


# Strict integers: `1e30` is a float, not a limit; the bound keeps values exact in SQL and JSON.
Limit = Annotated[StrictInt, Field(ge=1, le=MAX_LIMIT)]


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    role: Literal["user", "admin"] = "user"
    models: list[Annotated[str, Field(min_length=1, max_length=200)]] | None = None
    rpm: Limit | None = None
    tpm: Limit | None = None
    token_budget: Limit | None = None
    team: Annotated[str, Field(min_length=1, max_length=200)] | None = None


async def _admin(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    await state.auth.authenticate_admin(request.headers.get("authorization"))
    return state


@router.post("/keys", openapi_extra=request_body("KeyCreate"))
async def create_key(request: Request) -> Response:
    state = await _admin(request)
    try:
        spec = KeyCreate.model_validate_json(await request.body())
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        raise InvalidRequestError(f"{param}: {error['msg']}" if param else error["msg"], param=param) from None
    new = await asyncio.to_thread(state.keys.create, spec.name, role=spec.role, models=spec.models,
                                  rpm=spec.rpm, tpm=spec.tpm, token_budget=spec.token_budget, team=spec.team)
    await record_admin_action(request, "key.create", new.key.id, spec.model_dump())
    # The secret appears in this response and nowhere else, ever.
    return JSONResponse({**new.key.to_public_dict(), "key": new.secret}, status_code=201)


@router.get("/keys")
async def list_keys(request: Request) -> Response:
    state = await _admin(request)
    include_revoked = request.query_params.get("include_revoked", "false").lower() in ("1", "true", "yes")
    keys = await asyncio.to_thread(state.keys.list, include_revoked=include_revoked)
    return JSONResponse({"object": "list", "data": [key.to_public_dict() for key in keys]})


@router.get("/keys/{key_id}")
async def get_key(request: Request, key_id: str) -> Response:
    state = await _admin(request)
    key = await asyncio.to_thread(state.keys.get, key_id)
    return JSONResponse(key.to_public_dict())


@router.delete("/keys/{key_id}")
async def revoke_key(request: Request, key_id: str) -> Response:
    state = await _admin(request)
    key = await asyncio.to_thread(state.keys.revoke, key_id)
    state.auth.forget(key_id)
    await record_admin_action(request, "key.revoke", key_id, {})
    return JSONResponse(key.to_public_dict())


@router.get("/usage")
async def usage(request: Request) -> Response:
    """Aggregates per key and model (`group_by=key,model,replica,status` to choose), optionally
    within `since`/`until` (unix seconds) and for one `key_id`."""
    state = await _admin(request)
    query = request.query_params
    group_by = [g.strip() for g in query.get("group_by", "key,model").split(",") if g.strip()]
    await state.usage.flush()  # include the rows still queued, so the answer is current
    rows = await asyncio.to_thread(aggregate_usage, state.db, group_by=group_by,
                                   since=_float(query, "since"), until=_float(query, "until"),
                                   key_id=query.get("key_id"))
    return JSONResponse({"object": "list", "group_by": group_by, "data": rows})


@router.get("/replicas")
async def replicas(request: Request) -> Response:
    """Every replica in rotation or draining; `state` is up, down, awaiting_probe (added, not yet
    probed), draining (the replica announced its shutdown) or retired (removed, finishing its
    requests in flight)."""
    state = await _admin(request)
    data = [{"model": r.model, "url": r.url, "weight": r.weight, "healthy": r.healthy, "state": r.phase,
             "breaker": r.breaker.state.name.lower(), "outstanding": r.outstanding}
            for r in [*state.router.all_replicas(), *state.router.retiring]]
    return JSONResponse({"object": "list", "data": data})


@router.post("/config/reload")
async def reload_config(request: Request) -> Response:
    """Read the config file again and apply it (what SIGHUP does); 400 naming the field when the
    file is invalid, in which case the running config stays."""
    state: GatewayState = request.app.state.gateway
    # The actor is checked before: the reload may change the admin key this request came with.
    actor = await state.auth.authenticate_admin(request.headers.get("authorization"))
    try:
        result = await state.reloader.reload("admin API")
    except ConfigError as exc:
        raise InvalidRequestError(f"The config file was not reloaded (the running config stays): "
                                  f"{exc.message}") from None
    await asyncio.to_thread(record_action, state.db, actor_key_id=actor.key_id or "", action="config.reload",
                            target="config", detail={"changed": result.changed})
    return JSONResponse(result.to_dict())


def _float(query: Any, name: str) -> float | None:
    value = query.get(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise InvalidRequestError(f"{name}: give unix seconds, got {value!r}", param=name) from None
