"""Alert rules and the Grafana dashboard: promtool checks the rules and runs their unit tests, the
dashboard's queries are valid PromQL (promtool again) over metric names kvik really exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import DEPLOY, require_tool

PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvik.json"
# Series names in PromQL: kvik's own all start with "kvik" (`kvik:` for the server, `kvik_gateway_`).
KVIK_METRIC = re.compile(r"\bkvik[a-zA-Z0-9_:]*")
ALERTS = {"KvikTimeToFirstTokenP99High", "KvikKVCacheNearlyFull", "KvikQueueBacklog",
          "KvikGatewayErrorRateHigh", "KvikGatewayBreakerOpen"}


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_tool("promtool", "apt-get install -y prometheus")


def _run(command: list[str], cwd: Path) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def _alert_rules() -> list[dict]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yaml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_alert_rules_pass_promtool_check(promtool: str) -> None:
    output = _run([promtool, "check", "rules", "alerts.yaml"], PROMETHEUS)
    assert f"SUCCESS: {len(ALERTS)} rules found" in output
    assert {rule["alert"] for rule in _alert_rules()} == ALERTS


def test_alert_unit_tests_pass(promtool: str) -> None:
    """Each alert fires on the series that should fire it, with its labels and annotations, and stays
    silent on the others (deploy/prometheus/alerts_test.yaml)."""
    _run([promtool, "test", "rules", "alerts_test.yaml"], PROMETHEUS)
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yaml").read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert fired == ALERTS  # every alert has a case where it must fire


def test_prometheus_config_of_the_compose_stack_is_valid(promtool: str) -> None:
    _run([promtool, "check", "config", "prometheus.yml"], PROMETHEUS)


def test_alerts_and_their_tests_use_metrics_kvik_exports(exported_metric_names: set[str]) -> None:
    used = {name for rule in _alert_rules() for name in KVIK_METRIC.findall(rule["expr"])}
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yaml").read_text())["tests"]
    used |= {KVIK_METRIC.match(series["series"]).group(0)
             for test in tests for series in test["input_series"]}
    assert used and used <= exported_metric_names, sorted(used - exported_metric_names)


def _dashboard_panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def _dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in _dashboard_panels() for target in panel.get("targets", [])]


def test_dashboard_structure() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["refId"] and target["expr"].strip()
            for variable in re.findall(r"\$(\w+)", target["expr"]):
                assert variable in variables | {"__rate_interval", "__interval", "__range"}, variable
    titles = " ".join(panel["title"].lower() for panel in panels)
    for topic in ("time to first token", "inter-token", "end-to-end", "throughput", "kv cache",
                  "queue depth", "gateway requests", "error rate", "breaker", "gateway latency"):
        assert topic in titles, topic


def test_dashboard_queries_use_metrics_kvik_exports(exported_metric_names: set[str]) -> None:
    for expr in _dashboard_exprs():
        names = set(KVIK_METRIC.findall(expr))
        assert names, f"{expr!r} reads no kvik metric"
        assert names <= exported_metric_names, f"{expr!r}: {sorted(names - exported_metric_names)} not exported"
    used = {name for expr in _dashboard_exprs() for name in KVIK_METRIC.findall(expr)}
    for needed in ("kvik:time_to_first_token_seconds_bucket", "kvik:inter_token_latency_seconds_bucket",
                   "kvik:e2e_request_latency_seconds_bucket", "kvik:generation_tokens_total",
                   "kvik:kv_cache_usage_perc", "kvik:num_requests_waiting", "kvik_gateway_requests_total",
                   "kvik_gateway_breaker_state", "kvik_gateway_request_duration_seconds_bucket"):
        assert needed in used, needed


def test_dashboard_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    """promtool parses every query (as a recording rule) once Grafana's variables are filled in."""
    substitutions = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h",
                     "$model": ".*", "$gateway_model": ".*"}
    rules = []
    for i, expr in enumerate(_dashboard_exprs()):
        for variable, value in sorted(substitutions.items(), key=lambda kv: -len(kv[0])):
            expr = expr.replace(variable, value)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    output = _run([promtool, "check", "rules", "queries.yaml"], tmp_path)
    assert f"SUCCESS: {len(rules)} rules found" in output
