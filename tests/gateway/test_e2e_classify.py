"""/classify through the gateway to a real `kvik serve` replica of a reward model (a tiny
`LlamaForSequenceClassification` that kvik writes itself): the key's models and usage row, redaction
of the inputs, the response cache (scores are not sampled), and the replica's own refusals."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import UPSTREAM_MODEL, Gateway, GatewayFactory, KvikServe, free_port, model_config

pytest.importorskip("torch")  # the replica is kvik serve, which needs torch (the gateway does not)
pytestmark = pytest.mark.timeout(300)

EMAIL = "jane.doe@example.com"


@pytest.fixture(scope="module")
def reward_replica(tmp_path_factory: pytest.TempPathFactory, workdir: Path) -> Iterator[KvikServe]:
    from tests.pooling_models import make_reward_model

    model = make_reward_model(tmp_path_factory.mktemp("reward") / "model", pad_token_id=0)
    replica = KvikServe("reward", model, free_port(), workdir, extra=("--max-model-len", "256"))
    try:
        replica.launch()
        replica.wait_ready(120.0)
        yield replica
    finally:
        replica.stop()


@pytest.fixture(scope="module")
def gateway(gateways: GatewayFactory, reward_replica: KvikServe) -> Gateway:
    return gateways.start({"models": [model_config("reward", [reward_replica], aliases=["rm"])],
                           "guardrails": {"pii": {"enabled": True}}}, name="classify")


def test_classify_is_keyed_redacted_cached_and_charged(gateway: Gateway, reward_replica: KvikServe) -> None:
    with gateway.admin() as admin:
        account = admin.post("/admin/keys", json={"name": "scorer", "models": ["reward"]}).json()
    marker = f"score-{secrets.token_hex(4)}"
    texts = [f"{marker} a helpful answer", f"{marker} write to {EMAIL}"]
    with gateway.client(account["key"]) as client:
        first = client.post("/classify", json={"model": "reward", "input": texts})
        second = client.post("/v1/classify", json={"model": "rm", "input": texts})
        streamed = client.post("/classify", json={"model": "reward", "input": "x", "stream": True})
        chat = client.post("/v1/chat/completions", json={"model": "reward", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})
    assert (first.status_code, second.status_code) == (200, 200), (first.text, second.text)
    assert [r.headers["x-kvik-cache"] for r in (first, second)] == ["miss", "hit"]
    assert second.json()["data"] == first.json()["data"]
    # The scores are the replica's own for the redacted inputs, and the address never reached it.
    direct = httpx.post(f"{reward_replica.url}/classify", timeout=30, json={
        "model": UPSTREAM_MODEL, "input": [texts[0], f"{marker} write to [EMAIL]"]}).json()
    for got, expected in zip(first.json()["data"], direct["data"]):
        assert got["logits"] == pytest.approx(expected["logits"], abs=1e-5)
    assert EMAIL not in reward_replica.log_path.read_text(errors="replace")
    # Scores are not streamed; a generation request is the replica's own clear 400.
    assert (streamed.status_code, streamed.json()["error"]["param"]) == (400, "stream")
    assert chat.status_code == 400 and "/classify" in chat.json()["error"]["message"]

    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    assert prompt_tokens == direct["usage"]["prompt_tokens"] > 0
    with gateway.admin() as admin:
        rows = admin.get("/admin/usage", params={"key_id": account["id"]}).json()["data"]
    # The miss charged the replica's count; the hit is counted, not charged; the replica's 400 is
    # counted as an error. (The stream, refused before its model was read, is a row of model "".)
    reward = next(r for r in rows if r["model"] == "reward")
    assert (reward["requests"], reward["errors"], reward["prompt_tokens"], reward["completion_tokens"]) == (
        3, 1, prompt_tokens, 0)
