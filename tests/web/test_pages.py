"""Serving the built page: security headers, the encoding each client accepts, hashed assets only,
and the live metrics' percentiles against Prometheus' own rule."""

from __future__ import annotations

import gzip
import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvik.gateway.live_metrics import LiveMetrics, _quantile
from kvik.web import PageConfig, install_web, pages
from tests.web.conftest import require_built_page


@pytest.fixture(scope="module")
def client() -> TestClient:
    require_built_page()
    app = FastAPI()
    install_web(app, PageConfig(product="gateway", conversations="server", console=True))
    return TestClient(app)


def built_assets() -> dict[str, dict]:
    return json.loads((pages.STATIC_DIR / "build-info.json").read_text())["files"]


def test_page_headers_and_config(client: TestClient) -> None:
    response = client.get("/", headers={"accept-encoding": "identity"})
    assert response.status_code == 200
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp and "unsafe" not in csp
    assert "frame-ancestors 'none'" in csp and "img-src 'self' data:" in csp
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["cache-control"] == "no-cache"
    assert '"product":"gateway"' in response.text.replace("&quot;", '"')
    assert "<script>" not in response.text and " style=" not in response.text  # nothing inline
    zipped = client.get("/console", headers={"accept-encoding": "gzip"})
    assert zipped.status_code == 200 and zipped.headers["content-encoding"] == "gzip"


def test_assets_in_the_best_accepted_encoding(client: TestClient) -> None:
    name = next(n for n in built_assets() if n.startswith("chat-") and n.endswith(".js"))
    raw = (pages.ASSETS_DIR / name).read_bytes()
    for accept, encoding in (("gzip, deflate, br", "br"), ("gzip", "gzip"), ("identity", None),
                             ("br;q=0, gzip", "gzip")):
        response = client.get(f"/assets/{name}", headers={"accept-encoding": accept})
        assert response.status_code == 200
        assert response.headers.get("content-encoding") == encoding
        assert response.headers["cache-control"] == "public, max-age=31536000, immutable"
        assert response.headers["content-type"].startswith("text/javascript")
    body = client.get(f"/assets/{name}.gz", headers={"accept-encoding": "identity"})
    assert body.status_code == 404  # encoded files are only reached through content negotiation
    assert gzip.decompress((pages.ASSETS_DIR / f"{name}.gz").read_bytes()) == raw
    for bad in ("../pages.py", "..%2Fpages.py", ".hidden", "nope.js"):
        assert client.get(f"/assets/{bad}").status_code == 404


def test_page_not_built_says_how_to_build(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(pages, "STATIC_DIR", tmp_path)
    app = FastAPI()
    install_web(app, PageConfig(product="server", conversations="browser"))
    response = TestClient(app).get("/")
    assert response.status_code == 404 and "make web" in response.text


def test_live_percentiles_follow_prometheus() -> None:
    # histogram_quantile: linear inside the bucket that holds the rank.
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (float("inf"), 40.0)]
    assert _quantile(0.5, buckets) == pytest.approx((0.1 + 0.4 * (20 - 10) / 20) * 1000)
    assert _quantile(0.25, buckets) == pytest.approx((0.1 + 0.4 * (10 - 10) / 20) * 1000)
    assert _quantile(0.99, [(0.1, 0.0), (float("inf"), 5.0)]) == pytest.approx(100.0)  # +Inf: highest bound
    assert _quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None

    registry = CollectorRegistry()
    requests = Counter("kvik_gateway_requests", "", ["model", "replica", "status"], registry=registry)
    latency = Histogram("kvik_gateway_request_duration_seconds", "", ["model", "replica"],
                        buckets=(0.1, 0.5, 1.0), registry=registry)
    live = LiveMetrics(registry)
    for status, seconds in (("200", 0.05), ("200", 0.3), ("429", 0.01), ("502", 0.7)):
        requests.labels("m", "r", status).inc()
        latency.labels("m", "r").observe(seconds)
    summary = live.summary()
    assert summary["totals"] == {"requests": 4.0, "errors": 1.0, "rejected": 1.0}
    minute = summary["windows"]["60"]
    assert minute["requests"] == 4.0 and minute["latency_ms"]["p50"] == pytest.approx(100.0)
