"""The chat page, the admin console and their assets, served from the files `make web` builds.

The build (web/build.mjs) writes `static/index.html`, `static/console.html` and content-hashed files
under `static/assets/`, each with `.br` and `.gz` siblings; a request gets the smallest encoding it
accepts. Hashed names never change content, so they are cached for a year; the HTML is revalidated.

Every page carries a strict Content-Security-Policy: scripts and styles only from this origin (no
inline script or style at all), no plugins, no framing, connections only back to this origin, images
only from here or data: URLs, so model output that slipped past the sanitiser still could not load a
tracking image, post a form elsewhere or run script.
"""

from __future__ import annotations

import gzip
import html
import json
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

STATIC_DIR = Path(__file__).resolve().parent / "static"
ASSETS_DIR = STATIC_DIR / "assets"
CONFIG_PLACEHOLDER = "__KVIK_PAGE_CONFIG__"

CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "font-src 'self'",
    "connect-src 'self'",  # CSP 3: 'self' covers ws:/wss: to the same host
    "manifest-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
    "permissions-policy": "camera=(), microphone=(), geolocation=(), payment=(), usb=()",
}
CONTENT_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
                 ".woff2": "font/woff2", ".svg": "image/svg+xml", ".png": "image/png",
                 ".json": "application/json", ".ico": "image/x-icon", ".map": "application/json"}
_ASSET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
NOT_BUILT = ("kvik's web page is not built. Run `make web` in the kvik checkout (needs Node.js 20 and "
             "npm), or install kvik with `make .venv/.installed`, which builds it.\n")


@dataclass(slots=True, frozen=True)
class PageConfig:
    """What the page needs to know about the process serving it (a <meta> tag, not inline script)."""

    product: str  # "server" or "gateway"
    conversations: str  # "browser": kept in localStorage; "server": the gateway's /ui/conversations
    console: bool = False  # the admin console exists at /console


def pages_built() -> bool:
    return (STATIC_DIR / "index.html").is_file()


@dataclass(slots=True, frozen=True)
class _Encoded:
    identity: bytes
    gzip: bytes


def _page_bytes(name: str, config_json: str) -> _Encoded | None:
    path = STATIC_DIR / name
    try:
        # The file's change time is part of the cache key: a `make web` while serving is picked up.
        changed = path.stat().st_mtime_ns
    except OSError:
        return None
    return _render_page(path, changed, config_json)


@lru_cache(maxsize=8)
def _render_page(path: Path, changed: int, config_json: str) -> _Encoded:
    text = path.read_text(encoding="utf-8").replace(CONFIG_PLACEHOLDER, html.escape(config_json, quote=True))
    body = text.encode()
    return _Encoded(body, gzip.compress(body, 9, mtime=0))


def page_response(request: Request, name: str, config: PageConfig) -> Response:
    """`index.html` or `console.html` with this process's config, gzip when accepted."""
    page = _page_bytes(name, json.dumps(asdict(config), separators=(",", ":")))
    if page is None:
        return PlainTextResponse(NOT_BUILT, status_code=404, headers=SECURITY_HEADERS)
    headers = {**SECURITY_HEADERS, "cache-control": "no-cache", "vary": "Accept-Encoding"}
    body = page.identity
    if "gzip" in _accepted(request):
        body, headers["content-encoding"] = page.gzip, "gzip"
    return Response(body, media_type="text/html; charset=utf-8", headers=headers)


@lru_cache(maxsize=256)
def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def asset_response(request: Request, name: str) -> Response:
    """A built asset by its hashed name, in the best encoding the client accepts."""
    if not _ASSET_NAME.match(name) or name.endswith((".br", ".gz")):
        return PlainTextResponse("not found\n", status_code=404)
    path = ASSETS_DIR / name
    body = _read(path)
    if body is None:
        return PlainTextResponse("not found\n", status_code=404)
    headers = {"cache-control": "public, max-age=31536000, immutable", "vary": "Accept-Encoding",
               "x-content-type-options": "nosniff", "cross-origin-resource-policy": "same-origin"}
    accepted = _accepted(request)
    for encoding, suffix in (("br", ".br"), ("gzip", ".gz")):
        if encoding in accepted:
            encoded = _read(path.with_name(name + suffix))
            if encoded is not None:
                body, headers["content-encoding"] = encoded, encoding
                break
    media_type = CONTENT_TYPES.get(path.suffix, "application/octet-stream")
    return Response(body, media_type=media_type, headers=headers)


def _accepted(request: Request) -> set[str]:
    header = request.headers.get("accept-encoding", "")
    accepted = set()
    for part in header.split(","):
        name, _, params = part.strip().partition(";")
        if name and params.replace(" ", "") not in ("q=0", "q=0.0", "q=0.00", "q=0.000"):
            accepted.add(name.lower())
    return accepted
