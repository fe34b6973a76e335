"""Two models behind one `kvik serve`, with a memory budget that holds one: requests alternate
between them, the least recently used model is unloaded (its engine process stops) and loaded again,
and no request fails during a swap."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.server.conftest import start_server

START_TIMEOUT = 240.0


def engine_processes(server) -> int:
    """Children of the server that have torch loaded: one per loaded model."""
    count = 0
    for child in psutil.Process(server.process.pid).children(recursive=True):
        try:
            if any("libtorch" in m.path for m in child.memory_maps()):
                count += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return count


def ask(server, model: str) -> str:
    response = httpx.post(f"{server.base_url}/chat/completions", timeout=600, json={
        "model": model, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": "name a colour"}]})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_two_models_swap_under_a_memory_budget_without_failing_a_request(tmp_path, model_dir_factory):
    llama, qwen = model_dir_factory("llama"), model_dir_factory("qwen2")
    # Each model: ~0.5 MiB of weights + 8 MiB of KV cache; the budget holds one of them.
    server = start_server(llama, tmp_path, "--model", f"b={qwen}", "--model-memory-budget", "12MiB",
                          "--kv-cache-memory", "8MiB", "--batch-db", "none", name="a", timeout=START_TIMEOUT)
    try:
        cards = {card["id"]: card for card in httpx.get(f"{server.base_url}/models").json()["data"]}
        assert cards["a"]["loaded"] and not cards["b"]["loaded"] and cards["b"]["status"] == "unloaded"
        first = {"a": ask(server, "a")}

        peak = 0
        stop = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, engine_processes(server))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        watcher.start()
        answers: dict[str, set[str]] = {"a": {first["a"]}, "b": set()}
        try:
            # Rounds of concurrent requests that alternate the model: every round needs a swap.
            for model in ("b", "a", "b"):
                with ThreadPoolExecutor(4) as pool:
                    for answer in pool.map(lambda _: ask(server, model), range(4)):
                        answers[model].add(answer)
                cards = {card["id"]: card for card in httpx.get(f"{server.base_url}/models").json()["data"]}
                assert cards[model]["loaded"] and not cards["a" if model == "b" else "b"]["loaded"]
        finally:
            stop.set()
            watcher.join()
        assert answers["a"] == {first["a"]} and len(answers["b"]) == 1  # greedy: the same answer each time
        assert peak <= 1  # never two models loaded at once
        assert server.log().count("unloading a (least recently used)") >= 1
        assert server.log().count("unloading b (least recently used)") >= 1
    finally:
        server.stop()


def test_a_model_too_large_for_the_budget_is_refused_at_start(tmp_path, model_dir_factory):
    llama, qwen = model_dir_factory("llama"), model_dir_factory("qwen2")
    with pytest.raises(RuntimeError, match="more than the budget"):
        start_server(llama, tmp_path, "--model", f"b={qwen}", "--model-memory-budget", "4MiB",
                     "--kv-cache-memory", "8MiB", "--batch-db", "none", name="a", timeout=START_TIMEOUT)
