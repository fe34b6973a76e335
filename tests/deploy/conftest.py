"""Fixtures for the deployment checks: where deploy/ is, external tools, and the metric names kvik
really exports (read from the registries the server and the gateway build, not from a list)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def require_tool(name: str, install_hint: str) -> str:
    """The path of executable `name` (the venv's bin first); skip when it is missing, or fail
    where KVIK_TEST_REQUIRE_SERVICES=1 (CI), since a skipped check there would hide a gap."""
    venv_bin = Path(sys.executable).parent
    path = shutil.which(name, path=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        message = f"{name} is not installed ({install_hint})"
        if os.environ.get("KVIK_TEST_REQUIRE_SERVICES") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def _sample_names(registry) -> set[str]:
    """Every series name a scrape of `registry` can show, children or not: a labelled metric with no
    child yet has no samples, so its names follow from its type as the exposition format defines."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",), "summary": ("", "_sum", "_count")}
    names: set[str] = set()
    for family in registry.collect():
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


@pytest.fixture(scope="session")
def exported_metric_names() -> set[str]:
    """Series names of `kvik serve` (with engine stats present) and of `kvik gateway`."""
    from kvik.engine.llm_engine import EngineStats
    from kvik.gateway.metrics import GatewayMetrics
    from kvik.server.metrics import ServerMetrics

    stats = EngineStats(num_running=1, num_waiting=2, kv_cache_usage=0.5, num_blocks=10, num_free_blocks=5,
                        prefix_cache_queries=4, prefix_cache_hits=2, num_preemptions=0, prompt_tokens=4,
                        generation_tokens=8)
    server = ServerMetrics("m", lambda: [("m", stats)])
    names = _sample_names(server.registry) | _sample_names(GatewayMetrics().registry)
    assert "kvik:num_requests_waiting" in names and "kvik_gateway_requests_total" in names
    return names
