"""`kvik label`'s web page and its small JSON API, served by kvik itself on 127.0.0.1.

The page (label_static/: HTML, one script file, one style sheet; no CDN, no inline script or style)
talks only to this API:

    GET  /api/next?annotator=NAME  -> {"id", "prompt", "responses": [a, b], "labelled", "prompts"}
    POST /api/label {"id", "annotator", "choice": 0|1}  -> {"ok": true, "labelled"}

Every response carries a strict Content-Security-Policy (scripts, styles and requests only from this
origin; no framing), so answers written by a model cannot run code in the annotator's browser even
if the page's own escaping failed; the script writes them with textContent only. Errors use the
OpenAI envelope {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvik.core.errors import KvikError
from kvik.protocol.errors import error_body, error_from_exception
from kvik.server.labeling import LabelSession

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
ANNOTATOR_PATTERN = r"^[A-Za-z0-9_.@-]{1,64}$"
STATIC = {"label.js": "text/javascript; charset=utf-8", "label.css": "text/css; charset=utf-8"}


class LabelBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=200)
    annotator: str = Field(pattern=ANNOTATOR_PATTERN)
    choice: int = Field(strict=True)


def _asset(name: str) -> bytes:
    return resources.files("kvik.server").joinpath("label_static", name).read_bytes()


def create_label_app(session: LabelSession) -> FastAPI:
    app = FastAPI(title="kvik label", docs_url=None, redoc_url=None, openapi_url=None)
    page = _asset("index.html")
    assets = {name: _asset(name) for name in STATIC}

    @app.middleware("http")
    async def security_headers(request: Request, call_next: Any) -> Response:
        response = await call_next(request)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["Cache-Control"] = "no-store"
        return response

    @app.exception_handler(KvikError)
    async def kvik_error(request: Request, exc: KvikError) -> Response:
        status, body, headers = error_from_exception(exc)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p not in ("body", "query")]
        param = ".".join(where) or None
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        elif param == "annotator":
            message = "annotator: 1-64 characters from letters, digits, '_', '.', '@' and '-'"
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid')}"
        return JSONResponse(error_body(message, "invalid_request_error", param, None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, code),
                            status_code=exc.status_code)

    @app.get("/")
    def index() -> Response:
        return Response(page, media_type="text/html; charset=utf-8")

    @app.get("/static/{name}")
    def static(name: str) -> Response:
        if name not in assets:
            raise StarletteHTTPException(404, f"no static file {name!r}")
        return Response(assets[name], media_type=STATIC[name])

    @app.get("/api/next")
    def next_item(annotator: str = Query(pattern=ANNOTATOR_PATTERN)) -> dict[str, Any]:
        return session.next_item(annotator)

    @app.post("/api/label")
    def label(body: LabelBody) -> dict[str, Any]:
        return session.record(body.id, body.annotator, body.choice)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
