"""Multi-LoRA through `kvik serve` and the official OpenAI SDK: the `model` field picks the adapter,
/v1/models lists adapters with their base as parent, adapters load and unload at run time through the
admin-only endpoints, with 4xx for every bad input."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from tests.lora.helpers import reference_greedy, write_random_adapter
from tests.support.processes import ServerProcess, start_kvik_serve

ADMIN = "admin-secret"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def lora_server(lora_base, trained_adapters, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("lora-server")
    modules = [f"{name}={path}" for name, path in trained_adapters.items()]
    server = start_kvik_serve(log_dir, "--enable-lora", "--lora-modules", *modules, "--max-loras", "3",
                              "--max-lora-rank", "8", "--admin-api-key", ADMIN, "--kv-cache-memory", "32MiB",
                              "--batch-db", "none", "--responses-store", ":memory:", model_dir=lora_base)
    yield server
    server.stop()


def metric_value(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def admin(server: ServerProcess, path: str, body: dict, key: str | None = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)


def complete(server: ServerProcess, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> str:
    return client(server).completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text


def expected_text(base: Path, adapter: Path | None, prompt: list[int]) -> str:
    from transformers import AutoTokenizer

    tokens = reference_greedy(base, adapter, prompt, MAX_TOKENS)
    return AutoTokenizer.from_pretrained(base).decode(tokens, skip_special_tokens=True)


def test_models_lists_adapters_with_parent(lora_server, trained_adapters) -> None:
    models = {m.id: m for m in client(lora_server).models.list().data}
    assert set(models) == {"tiny", *trained_adapters}
    card = models["ad0"].model_dump()
    assert card["parent"] == "tiny" and card["root"] == str(trained_adapters["ad0"].resolve())
    assert client(lora_server).models.retrieve("ad3").id == "ad3"


def test_concurrent_requests_across_adapters_match_hf_peft(lora_server, lora_base, trained_adapters) -> None:
    """All eight adapters and the base model at once on three slots: adapters take turns in the LRU."""
    names = ["tiny", *trained_adapters] * 2
    prompts = [[5, 17, 42, 99, 7 + i % 4, 3, 20 + i] for i in range(len(names))]
    with ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(lambda pair: complete(lora_server, *pair), zip(names, prompts)))
    for name, prompt, text in zip(names, prompts, texts):
        adapter = trained_adapters.get(name)
        assert text == expected_text(lora_base, adapter, prompt), name
    metrics = httpx.get(f"{lora_server.url}/metrics", timeout=10).text
    assert 'kvik:lora_adapters{model_name="tiny"} 8.0' in metrics
    assert metric_value(metrics, "kvik:lora_slot_loads_total") >= 8  # three slots for eight adapters
    assert 'model_name="ad5"' in metrics  # latency and tokens per adapter
    # Chat goes through the same path.
    reply = client(lora_server).chat.completions.create(
        model="ad1", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert reply.model == "ad1" and reply.usage.completion_tokens >= 1


def test_runtime_load_and_unload(lora_server, lora_base, trained_adapters) -> None:
    prompt = [9, 8, 7, 6, 5]
    late = trained_adapters["ad7"]
    response = admin(lora_server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(late)})
    assert response.status_code == 200, response.text
    assert response.json()["parent"] == "tiny"
    assert "late" in {m.id for m in client(lora_server).models.list().data}
    assert complete(lora_server, "late", prompt) == expected_text(lora_base, late, prompt)

    response = admin(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert response.status_code == 200, response.text
    with pytest.raises(openai.NotFoundError):
        complete(lora_server, "late", prompt)
    # Loaded again under the same name: a fresh registration, same tokens.
    assert admin(lora_server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(late)}).status_code == 200
    assert complete(lora_server, "late", prompt) == expected_text(lora_base, late, prompt)


def test_admin_endpoints_refuse_bad_input(lora_server, lora_base, trained_adapters, model_dir_factory,
                                          tmp_path) -> None:
    good = {"lora_name": "x", "lora_path": str(trained_adapters["ad0"])}

    def error(response: httpx.Response, status: int) -> dict:
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert set(body) == {"message", "type", "param", "code"}
        return body

    error(admin(lora_server, "/v1/load_lora_adapter", good, key=None), 401)
    error(admin(lora_server, "/v1/load_lora_adapter", good, key="wrong"), 401)
    error(admin(lora_server, "/v1/unload_lora_adapter", {"lora_name": "ad0"}, key="wrong"), 401)
    error(admin(lora_server, "/v1/load_lora_adapter", {"lora_name": "x"}), 400)  # no lora_path
    assert error(admin(lora_server, "/v1/load_lora_adapter", {**good, "lora_path": str(tmp_path / "no")}),
                 400)["param"] == "lora_path"
    big = write_random_adapter(lora_base, tmp_path / "big", seed=5, r=16)
    assert "max-lora-rank" in error(admin(lora_server, "/v1/load_lora_adapter",
                                          {**good, "lora_path": str(big)}), 400)["message"]
    other = write_random_adapter(model_dir_factory("llama", "small"), tmp_path / "other", seed=6, r=2)
    assert error(admin(lora_server, "/v1/load_lora_adapter", {**good, "lora_path": str(other)}),
                 400)["code"] == "invalid_lora_adapter"
    error(admin(lora_server, "/v1/load_lora_adapter", {**good, "lora_name": "ad0"}), 409)  # taken
    error(admin(lora_server, "/v1/load_lora_adapter", {**good, "lora_name": "tiny"}), 409)  # the base
    error(admin(lora_server, "/v1/load_lora_adapter", {**good, "lora_name": "bad name"}), 400)
    error(admin(lora_server, "/v1/unload_lora_adapter", {"lora_name": "ghost"}), 404)
    with pytest.raises(openai.NotFoundError):
        complete(lora_server, "ghost", [1, 2, 3])
    with pytest.raises(openai.BadRequestError, match="LoRA adapter"):
        client(lora_server).embeddings.create(model="ad0", input="hello")


def test_unload_refused_while_a_request_uses_the_adapter(lora_server) -> None:
    stream = client(lora_server).completions.create(model="ad2", prompt=[4, 5, 6], max_tokens=400, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # the request is running
    response = admin(lora_server, "/v1/unload_lora_adapter", {"lora_name": "ad2"})
    stream.close()
    assert response.status_code == 409, response.text
    assert "in use" in response.json()["error"]["message"]


def test_runtime_updates_are_off_without_an_admin_key(lora_base, trained_adapters, tmp_path) -> None:
    server = start_kvik_serve(tmp_path, "--enable-lora", "--kv-cache-memory", "16MiB", "--batch-db", "none",
                              "--responses-store", ":memory:", model_dir=lora_base)
    try:
        response = admin(server, "/v1/load_lora_adapter",
                         {"lora_name": "x", "lora_path": str(trained_adapters["ad0"])}, key="anything")
        assert response.status_code == 403 and "--admin-api-key" in response.json()["error"]["message"]
    finally:
        server.stop()
