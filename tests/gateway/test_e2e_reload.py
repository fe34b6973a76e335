"""Config reload of a running `kvik gateway` process: through the admin API, SIGHUP and a change
of the file; a bad file is refused (400 naming the field, a log line) and the old config keeps
serving; models, aliases and the admin key change live; settings that need a restart say so; and
a model's replicas come from a watched file of URLs."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import ADMIN_KEY, Gateway, GatewayFactory, Upstream, model_config, wait_for

pytestmark = pytest.mark.timeout(120)


def chat(gateway: Gateway, key: str, model: str = "tiny") -> httpx.Response:
    with gateway.client(key) as client:
        return client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})


def served_models(gateway: Gateway, key: str) -> set[str]:
    """Names and aliases."""
    with gateway.client(key) as client:
        return {name for m in client.get("/v1/models").json()["data"] for name in (m["id"], *m["aliases"])}


def test_a_bad_config_is_refused_and_the_old_one_keeps_serving(gateways: GatewayFactory,
                                                               upstreams: list[Upstream]) -> None:
    gateway = gateways.start({"models": [model_config("tiny", upstreams[:1])], "reload": {"interval_s": 0.2}},
                             name="reload-bad")
    key = gateway.create_key(name="reload")
    good = gateway.config_path.read_text()
    gateway.config_path.write_text(good.replace("upstream_model:", "upstream_modle:"))

    # The file watch sees it and refuses it, with the field to fix in the log.
    wait_for(lambda: "config reload (file change) refused" in gateway.log(), timeout=10)
    assert "models[0].upstream_modle: unknown field" in gateway.log()
    assert chat(gateway, key).status_code == 200
    # So does the admin API, with a 400 in OpenAI's error shape.
    response = gateway.reload()
    assert response.status_code == 400
    error = response.json()["error"]
    assert "models[0].upstream_modle: unknown field" in error["message"] and error["type"] == "invalid_request_error"
    assert "the running config stays" in error["message"]
    assert chat(gateway, key).status_code == 200

    # Not YAML at all, and a value out of range: refused the same way.
    for text in ("models: [", good.replace("interval_s: 0.5", "interval_s: -1")):
        gateway.config_path.write_text(text)
        response = gateway.reload()
        assert response.status_code == 400, response.text
    assert chat(gateway, key).status_code == 200
    # Fixed: the watch applies it (a model added) without a restart.
    gateway.config_path.write_text(good)
    gateway.rewrite_config(models=[model_config("tiny", upstreams[:1]), model_config("tiny-2", upstreams[1:])])
    wait_for(lambda: "tiny-2" in served_models(gateway, key), timeout=10)
    assert chat(gateway, key, "tiny-2").status_code == 200


def test_sighup_reloads_models_aliases_and_the_admin_key(gateways: GatewayFactory, upstreams: list[Upstream]) -> None:
    gateway = gateways.start({"models": [model_config("tiny", upstreams)], "reload": {"watch": False}},
                             name="reload-hup")
    key = gateway.create_key(name="reload")
    new_admin_key = "kvik-test-rotated-admin-secret"
    gateway.rewrite_config(models=[model_config("tiny", upstreams[1:], aliases=["tiny-latest"])],
                           auth={"enabled": True, "admin_key": new_admin_key, "key_cache_ttl_s": 0.5},
                           port=gateway.port + 1)
    gateway.process.send_signal(signal.SIGHUP)
    wait_for(lambda: "tiny-latest" in served_models(gateway, key), timeout=10)

    assert chat(gateway, key, "tiny-latest").status_code == 200
    with gateway.client(ADMIN_KEY) as client:  # the old admin key no longer works, the new one does
        assert client.get("/admin/replicas").status_code == 401
    with gateway.client(new_admin_key) as client:
        listing = client.get("/admin/replicas").json()["data"]
    assert [r["url"] for r in listing] == [upstreams[1].url]  # the first replica drained and dropped
    # The listen port needs a restart: said in the log, and the old port keeps serving.
    assert "port changed, but takes effect only after a restart" in gateway.log()
    response = gateway.reload(new_admin_key)
    assert response.status_code == 200 and response.json()["restart_required"] == ["port"]


def test_a_models_replicas_from_a_watched_file(gateways: GatewayFactory, upstreams: list[Upstream],
                                               workdir: Path) -> None:
    listing = workdir / "replicas-file.txt"
    listing.write_text(f"{upstreams[0].url}\n")
    gateway = gateways.start({"models": [{
        "name": "tiny", "upstream_model": "tiny",
        "discovery": {"file": {"path": listing.name, "interval_s": 0.2}}}]}, name="reload-file")
    key = gateway.create_key(name="reload")
    assert set(gateway.replicas()) == {upstreams[0].url}
    listing.write_text(f"# both now\n{upstreams[0].url}\n{upstreams[1].url}\n")
    wait_for(lambda: gateway.replicas().get(upstreams[1].url, {}).get("state") == "up", timeout=10)
    listing.write_text(f"{upstreams[1].url}\nnot a url\n")  # a bad line: the list stays as it was
    wait_for(lambda: "replicas-file.txt line 2" in gateway.log(), timeout=10)
    assert set(gateway.replicas()) == {upstreams[0].url, upstreams[1].url}
    listing.write_text(f"{upstreams[1].url}\n")
    wait_for(lambda: set(gateway.replicas()) == {upstreams[1].url}, timeout=10)
    assert chat(gateway, key).status_code == 200
