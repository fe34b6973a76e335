"""The browser side of kvik, shared by `kvik serve` and `kvik gateway`: the chat page at `/`, the
admin console at `/console` (gateway), their built assets at `/assets/`, and the WebSocket endpoint
for streaming on `/v1/chat/completions` and `/v1/completions`.

Front-end sources live in the repository's top-level `web/` folder; `make web` builds them into
`kvik/web/static/`. This package never imports the engine, the server or the gateway: it only adds
routes to the app it is given, and the WebSocket reaches the app's own HTTP routes in-process.
"""

from __future__ import annotations

from fastapi import FastAPI, Request, WebSocket
from starlette.responses import Response

from kvik.web.pages import PageConfig, asset_response, page_response, pages_built
from kvik.web.websocket import SocketOptions, StreamingSocket

__all__ = ["PageConfig", "SocketOptions", "install_web", "pages_built"]

STREAMING_PATHS = ("/v1/chat/completions", "/v1/completions")


def install_web(app: FastAPI, config: PageConfig, socket_options: SocketOptions | None = None) -> None:
    """Add the page, console, asset and WebSocket routes to `app`."""
    options = socket_options or SocketOptions.from_env()

    async def chat_page(request: Request) -> Response:
        return page_response(request, "index.html", config)

    async def asset(request: Request, name: str) -> Response:
        return asset_response(request, name)

    app.add_api_route("/", chat_page, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/assets/{name}", asset, methods=["GET", "HEAD"], include_in_schema=False)
    if config.console:
        async def console_page(request: Request) -> Response:
            return page_response(request, "console.html", config)

        app.add_api_route("/console", console_page, methods=["GET", "HEAD"], include_in_schema=False)

    for path in STREAMING_PATHS:
        def endpoint_for(endpoint_path: str):  # noqa: ANN202 - binds the path per route
            async def streaming_socket(websocket: WebSocket) -> None:
                await StreamingSocket(websocket, endpoint_path, options).run()
            return streaming_socket

        app.add_api_websocket_route(path, endpoint_for(path))
