"""The Helm chart (deploy/helm/kvik), rendered by Helm's own template engine (Helm's Go SDK through
the helm-python-sdk wheel; the `helm` CLI itself is on no package registry we can use) and the output
validated against the Kubernetes OpenAPI schemas by kubernetes-validate, strictly (unknown fields
are errors), for the oldest and newest Kubernetes versions the chart supports."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helm_python import Chart, HelmRenderError, lint

from tests.deploy.conftest import DEPLOY

CHART = DEPLOY / "helm" / "kvik"
KUBERNETES_VERSIONS = ("1.25.0", "1.37.0")  # Chart.yaml: kubeVersion >=1.25
SECRETS = {"adminKey": "admin-secret", "replicaApiKey": "replica-secret",
           "databaseUrl": "postgresql://kvik:pw@postgres:5432/kvik", "redisUrl": "redis://redis:6379/0"}
DEFAULT = {"secrets": SECRETS}
# Everything switched the other way: a secret of one's own, no HPA, Redis, a model volume, a GPU,
# extra flags, scheduling constraints and ServiceMonitors.
EVERYTHING = {
    "secrets": {"existingSecret": "my-kvik-secrets"},
    "replica": {
        "replicaCount": 3, "autoscaling": {"enabled": False}, "drainTimeoutSeconds": 120,
        "model": {"path": "/models/qwen", "servedName": "qwen", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
        "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "32Gi"}, "requests": {"cpu": "4", "memory": "16Gi"}},
        "extraArgs": ["--max-num-seqs", "32"], "extraEnv": [{"name": "KVIK_CPU_KERNELS", "value": "0"}],
        "nodeSelector": {"accelerator": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "podAnnotations": {"team": "llm"},
    },
    "gateway": {"redis": True, "replicaCount": 3, "replicaDiscovery": {"mode": "static"}, "config": {"limits": {"default_rpm": 600}, "health": {"interval_s": 2}}},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
}
RELEASE, NAMESPACE = "prod", "llm"


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """`helm template prod deploy/helm/kvik -n llm` with `values`: the Kubernetes objects."""
    with Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def one(objects: list[dict], kind: str, component: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (
        component is None or o["metadata"]["labels"].get("app.kubernetes.io/component") == component)]
    assert len(found) == 1, f"{len(found)} {kind} objects for {component}"
    return found[0]


def replica_container(objects: list[dict]) -> dict:
    return one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]


def test_chart_lints_clean() -> None:
    for values in (DEFAULT, EVERYTHING):
        report = lint(CHART, values, strict=True, kube_version="v1.30.0")
        assert not report["errors"], report
        assert not [m for m in report["messages"] if m["severity"] >= 2], report["messages"]


@pytest.mark.parametrize("values", [DEFAULT, EVERYTHING], ids=["defaults", "everything"])
def test_manifests_validate_against_the_kubernetes_schemas(values: dict) -> None:
    objects = render(values)
    custom = [o for o in objects if o["apiVersion"].startswith("monitoring.coreos.com/")]
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            if obj not in custom:  # CRDs have no schema in Kubernetes' own
                kubernetes_validate.validate(obj, version, strict=True)
    kinds = sorted(o["kind"] for o in objects)
    expected = ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                "PodDisruptionBudget", "Secret", "Service", "Service", "StatefulSet"]
    if values is EVERYTHING:
        expected = sorted([k for k in expected if k not in ("HorizontalPodAutoscaler", "Secret")]
                          + ["ServiceMonitor", "ServiceMonitor"])
    assert kinds == expected


def test_a_broken_manifest_fails_validation() -> None:
    """The validator is strict: the check above cannot pass by validating nothing."""
    statefulset = copy.deepcopy(one(render(DEFAULT), "StatefulSet"))
    statefulset["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("drain", [30, 120])
def test_grace_period_covers_the_pre_stop_sleep_the_announce_and_the_drain(drain: int) -> None:
    objects = render({**DEFAULT, "replica": {"drainTimeoutSeconds": drain, "preStopSleepSeconds": 7,
                                             "drainAnnounceSeconds": 4}})
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert args[args.index("--drain-timeout") + 1] == str(drain)
    assert args[args.index("--drain-announce-seconds") + 1] == "4"
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]
    assert pod["terminationGracePeriodSeconds"] == 7 + 4 + drain + 10


def test_the_default_announce_outlasts_the_gateways_probe_interval() -> None:
    from kvik.gateway.config import HealthConfig

    args = replica_container(render(DEFAULT))["args"]
    assert float(args[args.index("--drain-announce-seconds") + 1]) > HealthConfig().interval_s


def test_probes() -> None:
    objects = render(DEFAULT)
    replica = replica_container(objects)
    assert replica["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert replica["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # Liveness must not fail during a drain, when /health answers 503.
    assert replica["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}
    assert replica["resources"]["requests"] and replica["resources"]["limits"]
    gateway = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["resources"]["requests"] and gateway["resources"]["limits"]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("values", [DEFAULT, EVERYTHING], ids=["defaults", "everything"])
def test_selectors_target_the_right_pods(values: dict) -> None:
    objects = render(values)
    statefulset, deployment = one(objects, "StatefulSet"), one(objects, "Deployment")
    replica_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    gateway_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert not _matches(statefulset["spec"]["selector"]["matchLabels"], gateway_labels)
    assert _matches(one(objects, "PodDisruptionBudget", "replica")["spec"]["selector"]["matchLabels"], replica_labels)
    assert _matches(one(objects, "PodDisruptionBudget", "gateway")["spec"]["selector"]["matchLabels"], gateway_labels)
    headless = one(objects, "Service", "replica")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["metadata"]["name"] == statefulset["spec"]["serviceName"]
    assert _matches(headless["spec"]["selector"], replica_labels)
    assert _matches(one(objects, "Service", "gateway")["spec"]["selector"], gateway_labels)
    for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
        component = monitor["metadata"]["labels"]["app.kubernetes.io/component"]
        service = one(objects, "Service", component)
        assert _matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
        assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
        assert monitor["metadata"]["labels"]["release"] == "prometheus"


def test_hpa_scales_the_statefulset_on_queue_depth() -> None:
    objects = render(DEFAULT)
    hpa, statefulset = one(objects, "HorizontalPodAutoscaler"), one(objects, "StatefulSet")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                             "name": statefulset["metadata"]["name"]}
    assert "replicas" not in statefulset["spec"]  # the HPA owns the count; an upgrade must not reset it
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "4"}
    # The name prometheus-adapter gives kvik's gauge (deploy/prometheus-adapter/values.yaml).
    (rule,) = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert one(render(EVERYTHING), "StatefulSet")["spec"]["replicas"] == 3


def test_adapter_rule_reads_a_metric_kvik_exports(exported_metric_names: set[str]) -> None:
    (rule,) = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    assert rule["seriesQuery"].split("{")[0] == "kvik:num_requests_waiting"
    assert "kvik:num_requests_waiting" in exported_metric_names


@pytest.mark.parametrize("values", [DEFAULT, EVERYTHING], ids=["defaults", "everything"])
def test_every_secret_reference_resolves(values: dict) -> None:
    objects = render(values)
    refs = [env["valueFrom"]["secretKeyRef"] for o in objects if o["kind"] in ("StatefulSet", "Deployment")
            for c in o["spec"]["template"]["spec"]["containers"] for env in c.get("env", [])
            if "valueFrom" in env]
    assert {r["key"] for r in refs} >= {"admin-key", "replica-api-key", "database-url"}
    secrets = [o for o in objects if o["kind"] == "Secret"]
    if values is EVERYTHING:
        assert not secrets and {r["name"] for r in refs} == {"my-kvik-secrets"}
        assert "redis-url" in {r["key"] for r in refs}
        return
    (secret,) = secrets
    for ref in refs:
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    # No secret value is written anywhere but the Secret.
    rendered = yaml.safe_dump([o for o in objects if o["kind"] != "Secret"])
    assert not [v for v in SECRETS.values() if v in rendered]


def test_a_missing_secret_value_stops_the_render() -> None:
    with pytest.raises(HelmRenderError, match="secrets.databaseUrl is required"):
        render({"secrets": {k: v for k, v in SECRETS.items() if k != "databaseUrl"}})


@pytest.mark.parametrize("values", [DEFAULT, EVERYTHING], ids=["defaults", "everything"])
def test_the_gateway_accepts_its_generated_config(values: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvik.gateway.config import parse_config

    objects = render(values)
    for var in ("KVIK_ADMIN_KEY", "KVIK_REPLICA_API_KEY", "KVIK_GATEWAY_DATABASE_URL", "KVIK_GATEWAY_REDIS_URL"):
        monkeypatch.setenv(var, SECRETS["redisUrl"] if "REDIS" in var else SECRETS["databaseUrl"]
                           if "DATABASE" in var else "secret")
    config = parse_config(yaml.safe_load(one(objects, "ConfigMap")["data"]["gateway.yaml"]))
    statefulset, headless = one(objects, "StatefulSet"), one(objects, "Service", "replica")
    count = statefulset["spec"].get("replicas") or one(objects, "HorizontalPodAutoscaler")["spec"]["maxReplicas"]
    name, service = statefulset["metadata"]["name"], headless["metadata"]["name"]
    (model,) = config.models
    assert model.name == replica_container(objects)["args"][replica_container(objects)["args"].index("--served-model-name") + 1]
    if values is EVERYTHING:  # static: the stable pod names
        assert [r.url for r in model.replicas] == [
            f"http://{name}-{i}.{service}.{NAMESPACE}.svc.cluster.local:8000" for i in range(count)]
        assert all(r.api_key == "secret" for r in model.replicas)
    else:  # the default: every address of the headless Service
        dns = model.discovery.dns
        assert (dns.name, dns.port, dns.api_key) == (f"{service}.{NAMESPACE}.svc.cluster.local", 8000, "secret")
        assert model.replicas == []
    assert config.host == "0.0.0.0" and config.database_url == SECRETS["databaseUrl"]
    if values is EVERYTHING:
        assert config.redis_url == SECRETS["redisUrl"]
        assert config.limits.default_rpm == 600 and config.health.interval_s == 2
    else:
        assert config.redis_url is None
