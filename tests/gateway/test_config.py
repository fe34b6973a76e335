"""Config parsing: defaults, `env:` secrets, and errors that name the field to fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvik.cli.main import main
from kvik.core.errors import ConfigError
from kvik.gateway.config import load_config, parse_config

BASE = {"models": [{"name": "tiny", "aliases": ["tiny-latest"],
                    "replicas": [{"url": "http://127.0.0.1:8001"}, {"url": "http://127.0.0.1:8002/v1/", "weight": 2}]}]}


def with_changes(**top: object) -> dict:
    return {**yaml.safe_load(yaml.safe_dump(BASE)), **top}


def test_issue_example_parses_with_documented_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UPSTREAM_KEY", "s3cret")
    path = tmp_path / "gateway.yaml"
    path.write_text("""
models:
  - name: tiny
    aliases: [tiny-latest]
    balancing: least_outstanding
    replicas:
      - url: http://127.0.0.1:8001
      - url: http://127.0.0.1:8002
        weight: 2
        api_key: env:UPSTREAM_KEY
auth:
  enabled: true
database_url: sqlite:///gateway.db
redis_url: null
""")
    config = load_config(path)
    replicas = config.models[0].replicas
    assert replicas[1].api_key == "s3cret" and replicas[1].weight == 2
    # A relative SQLite path is relative to the config file, not to wherever the command runs.
    assert config.database_url == f"sqlite:///{tmp_path / 'gateway.db'}"
    breaker = config.breaker
    assert (breaker.volume_threshold, breaker.error_threshold_percent, breaker.sleep_window_s) == (20, 50, 5)
    assert config.cache.enabled and config.redis_url is None


def test_replica_urls_are_normalised() -> None:
    config = parse_config(with_changes())
    assert [r.url for r in config.models[0].replicas] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


@pytest.mark.parametrize(("change", "expected"), [
    ({"models": [{"name": "tiny", "replicas": [{"url": "ftp://x"}]}]}, "models[0].replicas[0].url"),
    ({"models": [{"name": "tiny", "balancng": "x", "replicas": [{"url": "http://a"}]}]},
     "models[0].balancng: unknown field"),
    ({"models": [{"name": "tiny", "balancing": "random", "replicas": [{"url": "http://a"}]}]},
     "models[0].balancing"),
    ({"models": [{"name": "tiny", "replicas": []}]}, "models[0].replicas"),
    ({"models": [{"name": "tiny", "replicas": [{"url": "http://a", "weight": 0}]}]}, "models[0].replicas[0].weight"),
    ({"models": [{"name": "a", "replicas": [{"url": "http://a"}]},
                 {"name": "b", "aliases": ["a"], "replicas": [{"url": "http://b"}]}]}, "models[1].aliases[0]"),
    ({"database_url": "mysql://x"}, "database_url"),
    ({"redis_url": "http://x"}, "redis_url"),
    ({"breaker": {"error_threshold_percent": 150}}, "breaker.error_threshold_percent"),
    ({"guardrails": {"pii": {"patterns": [{"name": "x", "regex": "("}]}}}, "guardrails.pii.patterns[0].regex"),
    ({"guardrails": {"moderation": {"hook": "no_such_module_kvik:check"}}}, "guardrails.moderation.hook"),
    ({"cache": {"backend": "redis"}}, "cache.backend"),
    ({"responses": {"retention_days": -1}}, "responses.retention_days"),
    ({"responses": {"retention_days": float("nan")}}, "responses.retention_days"),
])
def test_errors_name_the_field(change: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(with_changes(**change))
    assert expected in info.value.message


def test_missing_environment_variable_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVIK_NO_SUCH_VAR", raising=False)
    raw = with_changes()
    raw["models"][0]["replicas"][1]["api_key"] = "env:KVIK_NO_SUCH_VAR"
    with pytest.raises(ConfigError, match=r"models\[0\]\.replicas\[1\]\.api_key: environment variable "
                                          r"KVIK_NO_SUCH_VAR is not set"):
        parse_config(raw)


def test_check_config_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(BASE))
    assert main(["gateway", "check-config", str(good)]) == 0
    assert "OK" in capsys.readouterr().out

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_changes(models=[{"name": "tiny", "replicas": [{"url": "nope"}]}])))
    assert main(["gateway", "check-config", str(bad)]) == 2
    assert "models[0].replicas[0].url" in capsys.readouterr().err

    broken = tmp_path / "broken.yaml"
    broken.write_text("models: [\n")
    assert main(["gateway", "check-config", str(broken)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
