"""GET /health (readiness) and GET /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvik.server.json_body import ParsedBodyRoute
from kvik.server.state import DRAIN_HEADER, ServerState

router = APIRouter(route_class=ParsedBodyRoute)


@router.get("/health", summary="200 when ready; 503 while loading, draining or when the engine died")
async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.shutting_down:  # from the first moment after SIGTERM, while it still serves
        return JSONResponse({"status": "draining"}, status_code=503,
                            headers={"Retry-After": "5", DRAIN_HEADER: "1"})
    if state.load_error is not None:
        return JSONResponse({"status": "failed", "error": str(state.load_error)}, status_code=503)
    if not state.ready:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
    if state.engine_dead:
        return JSONResponse({"status": "engine_dead", "error": state.engine.dead_reason}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics", summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
