"""Fixtures for the gateway tests: real processes on 127.0.0.1 (see harness.py).

`redis_server` and `postgres_server` start private instances in temp dirs on free ports and tear
them down after the session; they skip with a reason when the binaries are missing, unless
KVIK_TEST_REQUIRE_SERVICES=1 (set by CI) turns the skip into a failure.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.harness import (
    Gateway,
    GatewayFactory,
    PostgresCluster,
    RedisServer,
    Upstream,
    free_port,
    missing_service,
    model_config,
)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="session")
def upstreams(workdir: Path) -> Iterator[list[Upstream]]:
    """Two replicas shared by the tests that do not kill them; `reset()` them before use."""
    pair = [Upstream(name, free_port(), workdir) for name in ("a", "b")]
    try:
        for upstream in pair:
            upstream.start()
        yield pair
    finally:
        for upstream in pair:
            upstream.stop()


@pytest.fixture(scope="module")
def gateways(workdir: Path) -> Iterator[GatewayFactory]:
    factory = GatewayFactory(workdir)
    yield factory
    factory.stop_all()


@pytest.fixture(scope="session")
def redis_server(workdir: Path) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        missing_service("redis-server is not installed (apt-get install -y redis-server)")
    server = RedisServer(binary, free_port(), workdir)
    server.start(timeout=20)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresCluster]:
    cluster = PostgresCluster()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def standard_gateway(upstreams: list[Upstream], workdir: Path) -> Iterator[Gateway]:
    """One gateway shared by the cache, guardrail and SDK tests: auth on, PII redaction and the test
    moderation hook on, in-memory cache, SQLite."""
    factory = GatewayFactory(workdir)
    try:
        yield factory.start({
            "models": [model_config("tiny", upstreams, aliases=["tiny-latest"]),
                       model_config("other", upstreams)],
            "guardrails": {"pii": {"enabled": True, "patterns": [{"name": "employee_id", "regex": r"EMP-\d{6}"}]},
                           "moderation": {"hook": "moderation_hook:block_forbidden"}},
        }, name="standard")
    finally:
        factory.stop_all()
