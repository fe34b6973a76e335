"""Fixtures for the web tests: real processes on 127.0.0.1 and Debian's chromium driven by Playwright.

- `kvik_server`: `kvik serve` on the tiny random Llama (serves the page with browser storage).
- `scripted`: tests/web/scripted_upstream.py, whose answers the tests pick (hostile HTML, tools...).
- `gateway`: `kvik gateway` with two models: `scripted` and `tiny` (the kvik server), auth on.
- `browser`: headless chromium from /usr/bin (Playwright never downloads one); skipped with a reason
  when it or the built page is missing, unless KVIK_TEST_REQUIRE_SERVICES=1 (CI) makes that a failure.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import (
    Gateway,
    GatewayFactory,
    KvikServe,
    ServerProcess,
    free_port,
    missing_service,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# The README's screenshots are taken by these tests: into docs/img/ with KVIK_UPDATE_SCREENSHOTS=1
# (`make screenshots`), else into a temporary directory, so a test run leaves the checkout as it was.
SCREENSHOTS = (REPO / "docs" / "img" if os.environ.get("KVIK_UPDATE_SCREENSHOTS") == "1"
               else Path(tempfile.mkdtemp(prefix="kvik-screenshots-")))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_path() -> str:
    path = shutil.which("chromium") or (("/usr/bin/chromium") if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        missing_service("chromium is not installed (apt-get install -y chromium)")
    return path


def require_built_page() -> None:
    from kvik.web import pages_built

    if not pages_built():
        missing_service("the web page is not built (run `make web`)")


@pytest.fixture(scope="session")
def web_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("web")


@pytest.fixture(scope="session")
def launched_kvik_server(tiny_llama: Path, web_workdir: Path) -> Iterator[KvikServe]:
    """Started but maybe still loading: the gateway and the scripted upstream start meanwhile."""
    pytest.importorskip("torch")
    server = KvikServe("web", tiny_llama, free_port(), web_workdir)
    try:
        server.launch()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def kvik_server(launched_kvik_server: KvikServe) -> KvikServe:
    launched_kvik_server.wait_ready(180)
    # One request pays the first-use costs. Plain httpx: Playwright's sync API may own the event loop.
    httpx.post(launched_kvik_server.url + "/v1/completions", json={"model": "tiny", "prompt": "warm up",
                                                                     "max_tokens": 4}, timeout=60).raise_for_status()
    return launched_kvik_server


@pytest.fixture(scope="session")
def scripted(web_workdir: Path) -> Iterator[ServerProcess]:
    port = free_port()
    upstream = ServerProcess([sys.executable, str(HERE / "scripted_upstream.py"), "--port", str(port)], port,
                             web_workdir / "scripted.log")
    try:
        yield upstream.start()
    finally:
        upstream.stop()


@pytest.fixture(scope="session")
def gateway(launched_kvik_server: KvikServe, scripted: ServerProcess, web_workdir: Path) -> Iterator[Gateway]:
    factory = GatewayFactory(web_workdir)
    try:
        gateway = factory.start({
            "models": [
                {"name": "scripted", "replicas": [{"url": scripted.url}],
                 "pricing": {"input_per_million": 1.0, "output_per_million": 2.0}},
                {"name": "tiny", "upstream_model": "tiny", "replicas": [{"url": launched_kvik_server.url}]},
            ],
        }, name="web-gateway")
        launched_kvik_server.wait_ready(180)
        yield gateway
    finally:
        factory.stop_all()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One chromium per test module (Playwright's sync API owns an event loop while it runs)."""
    executable = chromium_path()
    require_built_page()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield instance
        finally:
            instance.close()

