"""Issue 10's findings against a real `kvik serve`: each test reproduces what a hostile or careless
client did to the server before, and checks what it gets now."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import psutil
import pytest

from tests.server.conftest import metric_value
from tests.server.test_bad_input import assert_error, post
from tests.support.sse import sse_lines

NESTED_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                "{{ messages[0]['content'] }}")


def chat(content: str = "hi", **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


class HealthProbe:
    """/health every 20 ms on a thread, recording each latency."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies, self.stop = f"{url}/health", [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                started = time.perf_counter()
                client.get(self.url)
                self.latencies.append(time.perf_counter() - started)
                time.sleep(0.02)

    def __enter__(self) -> HealthProbe:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


# -- finding 1: chat templates sent by clients --

def test_request_templates_are_refused_by_default(server):
    for body in (chat(chat_template_kwargs={"chat_template": NESTED_LOOPS}), chat(chat_template=NESTED_LOOPS)):
        error = assert_error(post(server, "chat/completions", json=body), 400, param="chat_template")
        assert "--trust-request-chat-template" in error["message"]


@pytest.mark.parametrize("kwargs", [
    {"messages": []}, {"add_generation_prompt": False}, {"tools": "x"}, {"bos_token": "<evil>"},
    {"raise_exception": 1}, {"__class__": 1},
])
def test_reserved_template_arguments_are_400(server, kwargs):
    assert_error(post(server, "chat/completions", json=chat(chat_template_kwargs=kwargs)), 400,
                 param="chat_template_kwargs")


def test_ill_typed_template_kwargs_are_400(server):
    for value in ([1, 2], "x", 5):
        assert_error(post(server, "chat/completions", json=chat(chat_template_kwargs=value)), 400)
    ok = post(server, "chat/completions", json=chat(chat_template_kwargs={"enable_thinking": False}))
    assert ok.status_code == 200, ok.text


@pytest.fixture(scope="module")
def trusting_server(server_factory):
    return server_factory("--trust-request-chat-template", "--tokenizer-timeout", "3")


def test_trusted_request_template_renders_in_a_sandbox_with_limits(trusting_server):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    ok = post(trusting_server, "chat/completions", json=chat(chat_template=template))
    assert ok.status_code == 200, ok.text
    huge = post(trusting_server, "chat/completions",
                json=chat(chat_template="{% set s = 'a' * 50000000 %}{{ s }}"))
    assert "exceeds the limit" in assert_error(huge, 400)["message"]
    escape = post(trusting_server, "chat/completions",
                  json=chat(chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"))
    assert escape.status_code == 400, escape.text


def test_looping_request_template_is_stopped_and_health_stays_fast(trusting_server):
    with HealthProbe(trusting_server.url) as probe:
        started = time.monotonic()
        response = post(trusting_server, "chat/completions", json=chat(chat_template=NESTED_LOOPS))
        elapsed = time.monotonic() - started
    assert "took longer than 3 s" in assert_error(response, 400)["message"]
    assert elapsed < 30
    assert len(probe.latencies) > 10 and max(probe.latencies) < 1.0, max(probe.latencies)
    # The killed worker was replaced: the next request renders normally.
    again = post(trusting_server, "chat/completions", json=chat())
    assert again.status_code == 200, again.text


# -- finding 2: large inputs off the event loop; sizes refused before parsing --

def test_oversized_prompt_is_refused_before_tokenizing(server):
    started = time.monotonic()
    error = assert_error(post(server, "chat/completions", json=chat("word " * 1_000_000)), 400,
                         code="context_length_exceeded")
    assert "bytes of text" in error["message"]
    assert time.monotonic() - started < 10


@pytest.fixture(scope="module")
def long_context_server(server_factory, tmp_path_factory, tiny_llama):
    """The tiny model with its context stretched to 2M tokens, so megabytes of prompt really get
    tokenized instead of being refused by their size."""
    import shutil

    path = tmp_path_factory.mktemp("long-context") / "tiny"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 2**21
    (path / "config.json").write_text(json.dumps(config))
    return server_factory("--max-model-len", str(2**21), "--kv-cache-memory", "1100MiB",
                          "--max-body-bytes", str(32 * 2**20), "--tokenizer-timeout", "300",
                          model_dir=path, name="tiny")


def test_health_and_other_requests_stay_fast_while_megabytes_are_tokenized(long_context_server):
    server = long_context_server
    big = chat("the quick brown fox jumps over the lazy dog " * 25_000, max_tokens=2**21)  # ~1.1 MB
    small_latencies: list[float] = []

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            big_task = asyncio.create_task(client.post("/chat/completions", json=big))
            await asyncio.sleep(0.3)
            while not big_task.done():
                started = time.perf_counter()
                small = await client.post("/chat/completions", json=chat())
                small_latencies.append(time.perf_counter() - started)
                assert small.status_code == 200, small.text
            return await big_task

    with HealthProbe(server.url) as probe:
        response = asyncio.run(main())
    # Tokenized (in a worker), then refused for its length: the request was really processed.
    assert_error(response, 400, code="context_length_exceeded")
    assert len(probe.latencies) > 5 and len(small_latencies) >= 1
    assert max(probe.latencies) < 1.0, max(probe.latencies)
    assert max(small_latencies) < 5.0, small_latencies


def test_memory_stays_bounded_after_multi_megabyte_prompts(long_context_server):
    """Finding 13: RSS grew from 0.54 to ~1.9 GiB after multi-MB prompts. Large inputs are
    tokenized in recycled workers that trim their heap, over-long ones never ship their ids back,
    and the server trims after large bodies: after a first large request, more do not grow RSS."""
    server = long_context_server
    big = chat("all work and no play makes jack a dull boy " * 20_000, max_tokens=2**21)  # ~0.9 MB

    def rss() -> dict[int, int]:
        process = psutil.Process(server.process.pid)
        return {p.pid: p.memory_info().rss for p in [process, *process.children(recursive=True)]}

    for _ in range(2):  # warm: both workers have handled one
        assert post(server, "chat/completions", json=big, timeout=300).status_code == 400
    before = rss()
    for _ in range(4):
        assert post(server, "chat/completions", json=big, timeout=300).status_code == 400
    after = rss()
    grown = {pid: (after[pid] - before[pid]) / 2**20 for pid in before if pid in after}
    assert max(grown.values()) < 64, grown


def test_chunked_body_over_the_limit_is_413(server):
    def chunks():
        for _ in range(40):
            yield b"x" * 2**20  # 40 MiB, no Content-Length

    response = httpx.post(f"{server.base_url}/completions", content=chunks(),
                          headers={"content-type": "application/json"}, timeout=60)
    assert_error(response, 413, code="request_too_large")


def test_slow_body_is_cut_off(server_factory):
    slow = server_factory("--body-read-timeout", "2")
    with socket.create_connection(("127.0.0.1", int(slow.url.rsplit(":", 1)[1])), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        started = time.monotonic()
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert time.monotonic() - started < 10


def test_slow_headers_are_cut_off_and_other_clients_are_served(server_factory):
    """Finding 12 on the server (slowloris): headers that trickle in get 408 and a closed connection
    after --header-timeout, and meanwhile other clients are answered."""
    slow = server_factory("--header-timeout", "2")
    port = int(slow.url.rsplit(":", 1)[1])
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(20)]
    try:
        started = time.monotonic()
        for sock in sockets:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never finished
        health = httpx.get(f"{slow.url}/health", timeout=5)
        assert health.status_code == 200
        replies = [sock.recv(4096) for sock in sockets]
        elapsed = time.monotonic() - started
    finally:
        for sock in sockets:
            sock.close()
    assert all(reply.startswith(b"HTTP/1.1 408") for reply in replies), replies[0][:200]
    assert b"--header-timeout" in replies[0]
    assert 1.5 < elapsed < 10, elapsed


# -- finding 3 (server part): a request that crashed a replica is a 400 --

@pytest.mark.parametrize("key", ["²", "٣", "0x10", "99999999999999999999"])
def test_unicode_digit_logit_bias_keys_are_400(server, key):
    response = post(server, "completions", json={"model": "tiny", "prompt": "hi", "logit_bias": {key: 1}})
    assert response.status_code == 400, response.text


# -- finding 11 (server part) --

def test_impossible_n_is_400_not_retryable_503(server):
    # max_num_seqs 64 + max_waiting 256: 3 prompts x n 64 = 192 fits; 8 x 64 never can.
    response = post(server, "completions", json={"model": "tiny", "prompt": ["a"] * 8, "n": 64,
                                                 "max_tokens": 1})
    error = assert_error(response, 400, param="n")
    assert "320" in error["message"] and "Retry-After" not in response.headers


def test_python_api_takes_size_strings_and_names_wrong_types(tiny_llama):
    from kvik import LLM, SamplingParams
    from kvik.core.errors import ConfigError

    llm = LLM(str(tiny_llama), show_progress=False, kv_cache_memory="8MiB", max_model_len=128)
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    with pytest.raises(ConfigError, match="kv_cache_memory: 'lots' is not a size"):
        LLM(str(tiny_llama), kv_cache_memory="lots")
    with pytest.raises(ConfigError, match="max_num_seqs: expected an integer, got str"):
        LLM(str(tiny_llama), max_num_seqs="4")


# -- findings 8 and 9: failures look like failures --

def engine_pid(server) -> int:
    """The server's child that runs the engine core: the one with torch loaded (the others are
    tokenizer workers and multiprocessing's resource tracker)."""
    children = psutil.Process(server.process.pid).children()
    engines = [c for c in children if any("libtorch" in m.path for m in c.memory_maps())]
    assert len(engines) == 1, [c.cmdline() for c in children]
    return engines[0].pid


def test_stream_that_fails_mid_way_ends_with_an_error_and_no_done(server_factory):
    # Step 8 is mid-way through 100 tokens: a prefill, a single decode step, then runs of up to
    # 8 forwards (multi-step decoding).
    failing = server_factory("--log-level", "info", env={"KVIK_FAULT_STEP": "8"})
    body = {"model": "tiny", "prompt": "Tell me a story", "max_tokens": 100, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{failing.base_url}/completions", json=body, timeout=60) as response:
        lines = [line for line in sse_lines(response) if line]
    assert response.status_code == 200
    assert lines[-1] != "data: [DONE]" and "[DONE]" not in "\n".join(lines)
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert "injected fault" in error["message"] and error["type"] == "server_error"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the line is written when the response closes
        log_lines = [json.loads(line.split("kvik.server.requests: ", 1)[1])
                     for line in failing.log().splitlines() if "kvik.server.requests: " in line]
        if log_lines:
            break
        time.sleep(0.1)
    assert log_lines[-1]["status"] == 500 and "injected fault" in log_lines[-1]["error"]
    # Timings of what it did get: the wait for its first step, then that step, then more.
    assert 0 <= log_lines[-1]["queue_ms"] <= log_lines[-1]["ttft_ms"] <= log_lines[-1]["latency_ms"], log_lines[-1]
    # The engine keeps serving after a failed step.
    again = httpx.post(f"{failing.base_url}/completions", json={**body, "stream": False}, timeout=60)
    assert again.status_code == 200, again.text


def test_killed_engine_fails_requests_health_and_exits_nonzero(server_factory):
    """Must show 4: kill -9 the engine process under load."""
    victim = server_factory()
    client = openai.AsyncOpenAI(base_url=victim.base_url, api_key="x", max_retries=0, timeout=60)

    streaming = [asyncio.Event() for _ in range(8)]

    async def one(i: int) -> str:
        try:
            stream = await client.completions.create(model="tiny", prompt=f"story {i}", max_tokens=400,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                streaming[i].set()
        except openai.APIError as exc:
            return f"error: {exc}"
        return "finished"

    async def main():
        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        # Kill once every stream has its first token, not after a fixed sleep: on a fast machine
        # 400 tokens can finish before any sleep long enough for a slow one.
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streaming)), timeout=60)
        psutil.Process(engine_pid(victim)).kill()
        started = time.monotonic()
        results = await asyncio.gather(*tasks)
        return results, time.monotonic() - started

    results, elapsed = asyncio.run(main())
    assert all(r.startswith("error") for r in results), results
    assert elapsed < 10
    health = httpx.get(f"{victim.url}/health", timeout=5) if victim.process.poll() is None else None
    if health is not None:
        assert health.status_code == 503
    assert victim.process.wait(timeout=30) == 1
    assert "the engine died" in victim.log()


def test_no_engine_outlives_its_killed_server(server_factory):
    server = server_factory()
    children = psutil.Process(server.process.pid).children(recursive=True)
    assert len(children) >= 2  # the engine core and the tokenizer workers
    server.process.kill()
    server.process.wait(10)
    # The engine dies with its parent (PR_SET_PDEATHSIG), the workers when their pipes close.
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [p.cmdline() for p in alive]


def test_kv_blocks_come_back_after_each_of_these_failures(server):
    text = httpx.get(f"{server.url}/metrics").text
    assert metric_value(text, "kvik:num_requests_running") == 0
    assert metric_value(text, "kvik:kv_cache_free_blocks") == metric_value(text, "kvik:kv_cache_total_blocks")


def test_the_api_server_process_never_loads_torch(server):
    """The engine core runs in its own process: the API server's never maps libtorch."""
    server_maps = {m.path for m in psutil.Process(server.process.pid).memory_maps()}
    engine_maps = {m.path for m in psutil.Process(engine_pid(server)).memory_maps()}
    assert any("libtorch" in path for path in engine_maps)
    assert not any("libtorch" in path for path in server_maps)
