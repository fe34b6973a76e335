"""Admin API routes the console uses beyond the basic ones in `admin.py`: changing a key's limits,
usage and cost per day, live rate and latency, the models with their prices, and the audit trail.
Every route needs a key with the admin role."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvik.core import client_json
from kvik.core.errors import InvalidRequestError, RequestTooLargeError
from kvik.gateway.audit import query_actions, query_requests, record_admin_action
from kvik.gateway.live_metrics import LiveMetrics
from kvik.gateway.state import GatewayState
from kvik.gateway.usage_report import daily_usage

router = APIRouter(prefix="/admin")
MAX_BODY_BYTES = 64 * 1024


async def _admin(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    await state.auth.authenticate_admin(request.headers.get("authorization"))
    return state


@router.patch("/keys/{key_id}")
async def update_key(request: Request, key_id: str) -> Response:
    """Change `name`, `models`, `rpm`, `tpm`, `token_budget` or `team` (null clears); takes effect at once on
    this gateway and within `auth.key_cache_ttl_s` on the others."""
    state = await _admin(request)
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise RequestTooLargeError(f"The request body is over {MAX_BODY_BYTES} bytes.")
    try:
        changes = client_json.loads(raw)
    except ValueError as exc:
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(changes, dict) or not changes:
        raise InvalidRequestError("Send a JSON object with the fields to change.")
    key = await asyncio.to_thread(state.keys.update, key_id, changes)
    state.auth.forget(key_id)
    await record_admin_action(request, "key.update", key_id, changes)
    return JSONResponse(key.to_public_dict())


@router.get("/models")
async def models(request: Request) -> Response:
    """Every configured model with its aliases, prices and replica count (for allow-lists and costs)."""
    state = await _admin(request)
    data = [{"id": pool.name, "aliases": list(pool.config.aliases),
             "pricing": pool.config.pricing.model_dump(), "replicas": len(pool.replicas),
             "available_replicas": sum(1 for r in pool.replicas if r.is_available())}
            for pool in state.router.pools]
    return JSONResponse({"object": "list", "data": data})


@router.get("/usage/daily")
async def usage_daily(request: Request) -> Response:
    """Requests, tokens and cost per UTC day, key and model; filters: since, until, key_id, model."""
    state = await _admin(request)
    query = request.query_params
    await state.usage.flush()
    pricing = {pool.name: pool.config.pricing for pool in state.router.pools}
    rows = await asyncio.to_thread(daily_usage, state.db, pricing, since=_float(query, "since"),
                                   until=_float(query, "until"), key_id=query.get("key_id") or None,
                                   model=query.get("model") or None)
    return JSONResponse({"object": "list", "data": rows})


@router.get("/metrics/live")
async def live_metrics(request: Request) -> Response:
    """Request rate, errors and latency/TTFT percentiles over the last 10 s, 60 s and 300 s."""
    state = await _admin(request)
    live: LiveMetrics | None = getattr(request.app.state, "live_metrics", None)
    if live is None:
        live = request.app.state.live_metrics = LiveMetrics(state.metrics.registry)
    return JSONResponse(live.summary())


@router.get("/audit")
async def audit(request: Request) -> Response:
    """Admin actions, newest first; filters: action, actor (key id), target, since, until, limit."""
    state = await _admin(request)
    query = request.query_params
    rows = await asyncio.to_thread(query_actions, state.db, action=query.get("action") or None,
                                   actor=query.get("actor") or None, target=query.get("target") or None,
                                   since=_float(query, "since"), until=_float(query, "until"),
                                   limit=_int(query, "limit", 100))
    return JSONResponse({"object": "list", "data": rows})


@router.get("/requests")
async def requests_log(request: Request) -> Response:
    """One row per request, newest first; filters: key_id, model, status (429 or 4xx), since, until, limit."""
    state = await _admin(request)
    query = request.query_params
    await state.usage.flush()
    rows = await asyncio.to_thread(query_requests, state.db, key_id=query.get("key_id") or None,
                                   model=query.get("model") or None, status=query.get("status") or None,
                                   since=_float(query, "since"), until=_float(query, "until"),
                                   limit=_int(query, "limit", 100))
    return JSONResponse({"object": "list", "data": rows})


def _float(query: Any, name: str) -> float | None:
    value = query.get(name)
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if number != number or number in (float("inf"), float("-inf")):
        raise InvalidRequestError(f"{name}: give unix seconds, got {value!r}", param=name)
    return number


def _int(query: Any, name: str, default: int) -> int:
    value = query.get(name)
    if value is None:
        return default
    if not value.isdigit() or len(value) > 6:
        raise InvalidRequestError(f"{name}: give a whole number up to 500", param=name)
    return int(value)
