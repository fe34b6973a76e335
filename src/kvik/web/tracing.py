"""ASGI middleware that gives every HTTP request a server span, continuing the caller's trace.

Installed by the server's and the gateway's app factories only when tracing is configured
(`kvik.core.tracing.configure`), outermost, so the span covers the whole exchange: a streamed
response's span ends after its last byte. The span is named `METHOD route` once the router has
matched (`POST /v1/chat/completions`), plain `METHOD` for unmatched paths, and carries the HTTP
semantic-convention attributes. Probes and scrapes (`skip_paths`) are not traced.
"""

from __future__ import annotations

from typing import Any

from kvik.core import tracing

Scope = dict[str, Any]


class TracingMiddleware:
    def __init__(self, app: Any, *, skip_paths: frozenset[str] = frozenset({"/health", "/metrics"})) -> None:
        self.app = app
        self.skip_paths = skip_paths

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.skip_paths:
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        attributes = {"http.request.method": method, "url.path": scope["path"], "url.scheme": scope.get("scheme", "http")}
        with tracing.server_span(method, scope.get("headers") or [], attributes) as span:
            async def traced_send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        from opentelemetry.trace import Status, StatusCode

                        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
                await send(message)

            try:
                await self.app(scope, receive, traced_send)
            finally:
                route = scope.get("route")
                path = getattr(route, "path", None)
                if path:
                    span.update_name(f"{method} {path}")
                    span.set_attribute("http.route", path)
