"""kvik.core.tracing when off (the default) and its configuration checks. The traces themselves
are checked end to end in tests/gateway/test_tracing_e2e.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvik.core import tracing
from kvik.core.errors import ConfigError


def test_off_by_default_loads_no_sdk_and_creates_no_spans() -> None:
    # The OpenTelemetry API may be loaded by FastAPI itself (its native telemetry, which stays off
    # without a global tracer provider); kvik loads the SDK and the exporter only when configured.
    code = ("import sys\n"
            "import kvik.server.app, kvik.gateway.app, kvik.engine.async_llm, kvik.cli.main\n"
            "from kvik.core import tracing\n"
            "assert not tracing.enabled()\n"
            "assert tracing.start_span('x') is None\n"
            "with tracing.span('y') as span:\n"
            "    assert span is None\n"
            "sdk = ('opentelemetry.sdk', 'opentelemetry.exporter')\n"
            "loaded = sorted(m for m in sys.modules if m.startswith(sdk))\n"
            "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("endpoint, ratio, message", [
    ("127.0.0.1:4318", 1.0, "give an http"),
    ("grpc://collector:4317", 1.0, "give an http"),
    ("http://collector:4318", 1.5, "between 0 and 1"),
    ("http://collector:4318", -0.1, "between 0 and 1"),
])
def test_config_refuses_what_cannot_work(endpoint: str, ratio: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tracing.TracingConfig(endpoint, ratio)


def test_endpoint_without_path_gets_the_traces_path() -> None:
    assert tracing.TracingConfig("http://collector:4318").traces_url == "http://collector:4318/v1/traces"
    assert tracing.TracingConfig("http://collector:4318/").traces_url == "http://collector:4318/v1/traces"
    assert tracing.TracingConfig("https://c.example/otlp/v1/traces").traces_url == "https://c.example/otlp/v1/traces"


def test_log_format_is_unchanged_when_off() -> None:
    base = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    assert tracing.log_format(base) == base
