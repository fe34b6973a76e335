"""Operations endpoints: liveness (no key) and Prometheus metrics, which name every replica URL: on
their own listener (`metrics.port`, see `listeners`) or behind an admin key (`metrics.auth`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvik.gateway.state import GatewayState

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the process serves; per model, how many replicas can take traffic."""
    state: GatewayState = request.app.state.gateway
    models = {pool.name: sum(1 for r in pool.replicas if r.is_available()) for pool in state.router.pools}
    return JSONResponse({"status": "ok", "available_replicas": models})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    if state.config.metrics.port is None and state.config.metrics.auth == "admin_key":
        await state.auth.authenticate_admin(request.headers.get("authorization"))
    return Response(state.metrics.render(state.router), media_type=CONTENT_TYPE_LATEST)
