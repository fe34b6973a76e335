"""`kvik bench serve` against the naive baseline and a real `kvik serve` on the same tiny model.

Only what was measured is checked (every request succeeded, produced exactly max_tokens, its figures
exist and are consistent); no assertion depends on how fast this machine is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvik.bench.load import arrival_times
from kvik.cli.main import main
from tests.support.sse import sse_lines

LATENCY_KEYS = [f"{kind}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2e")
                for kind in ("mean", "p50", "p90", "p99")]


def bench(tmp_path: Path, url: str, *flags: str) -> dict[str, Any]:
    out = tmp_path / "result.json"
    code = main(["bench", "serve", "--base-url", url, "--model", "tiny", "--no-progress", "--json", str(out),
                 *flags])
    assert code == 0, out.read_text() if out.exists() else "no result written"
    return json.loads(out.read_text())


def assert_all_exact(result: dict[str, Any], num_prompts: int) -> None:
    summary, records = result["summary"], result["requests"]
    assert summary["completed"] == num_prompts
    assert summary["failed"] == summary["output_length_mismatches"] == 0
    assert len(records) == num_prompts
    for record in records:
        assert record["success"], record["error"]
        assert record["output_tokens"] == record["expected_output_tokens"]
        assert record["ttft_s"] <= record["e2e_s"]
    assert summary["total_output_tokens"] == sum(r["expected_output_tokens"] for r in records)
    throughputs = ["request_throughput", "output_throughput", "total_token_throughput", "goodput"]
    # A server that fell behind sends a request's backlog of tokens as one chunk (kvik and vLLM
    # both coalesce), so on a busy machine a short request may have no gap between token chunks:
    # then ITL is unmeasured (None), never a made-up 0.
    measured_itl = any(record["itl_s"] for record in records)
    for key in LATENCY_KEYS + throughputs:
        if "_itl_" in key and not measured_itl:
            assert summary[key] is None, key
            continue
        assert isinstance(summary[key], float) and summary[key] >= 0, key
    assert summary["total_token_throughput"] > summary["output_throughput"] > 0


def test_naive_server_at_fixed_concurrency(naive, tmp_path):
    result = bench(tmp_path, naive.url + "/v1", "--num-prompts", "8", "--input-len-range", "16,48",
                   "--output-len-range", "4,12", "--max-concurrency", "2", "--label", "naive")
    assert_all_exact(result, 8)
    assert result["label"] == "naive" and result["config"]["max_concurrency"] == 2
    records = result["requests"]
    # The naive server streams one chunk per token, so every token after the first has an ITL.
    assert all(len(r["itl_s"]) == r["output_tokens"] - 1 for r in records)
    # The prompt lengths are the workload's own (token-id prompts), confirmed by the usage chunk.
    assert all(16 <= r["prompt_tokens"] <= 48 for r in records)
    # Never more than two requests in flight: at each send, at most one other is still running.
    spans = [(r["start_s"], r["start_s"] + r["e2e_s"]) for r in records]
    for start, _ in spans:
        assert sum(1 for s, e in spans if s <= start < e) <= 2


def test_kvik_under_poisson_arrivals(kvik_server, tmp_path):
    result = bench(tmp_path, kvik_server.url, "--num-prompts", "8", "--input-len-range", "16,64",
                   "--output-len", "8", "--request-rate", "20", "--seed", "3", "--label", "kvik")
    assert_all_exact(result, 8)
    assert result["config"]["request_rate"] == 20 and result["config"]["vocab_size"] > 0
    starts = [r["start_s"] for r in result["requests"]]
    # Each request left no earlier than its seeded arrival time, in arrival order.
    assert starts == sorted(starts)
    assert all(start >= at for start, at in zip(starts, arrival_times(8, 20.0, seed=3)))


def test_kvik_chat_endpoint_and_prefix_workload(kvik_server, tmp_path):
    chat = bench(tmp_path, kvik_server.url, "--endpoint", "chat", "--num-prompts", "4",
                 "--input-len-range", "8,16", "--output-len", "6")
    assert_all_exact(chat, 4)
    prefix = bench(tmp_path, kvik_server.url, "--workload", "prefix", "--prefix-len", "128",
                   "--question-len", "8", "--num-prompts", "4", "--output-len", "4", "--max-concurrency", "1")
    assert_all_exact(prefix, 4)
    assert all(r["prompt_tokens"] == 136 for r in prefix["requests"])


def test_naive_server_greedy_output_equals_kvik(naive, kvik_server):
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    ours = httpx.post(naive.url + "/v1/completions", json=body, timeout=60).json()
    theirs = httpx.post(kvik_server.url + "/v1/completions", json=body, timeout=60).json()
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
    assert ours["usage"] == {"prompt_tokens": theirs["usage"]["prompt_tokens"], "completion_tokens": 12,
                             "total_tokens": theirs["usage"]["prompt_tokens"] + 12}
    # Streaming sends the same text, one chunk per token, the last one finishing, then usage and [DONE].
    with httpx.stream("POST", naive.url + "/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        events = [line[len("data: "):] for line in sse_lines(response) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == ours["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * 11 + ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_naive_server_rejects_what_it_cannot_serve(naive):
    for body in ({"prompt": [1, 2, 10**6], "max_tokens": 2}, {"prompt": ["a", "b"]}, {"prompt": "a", "n": 2},
                 {"max_tokens": 2}):
        response = httpx.post(naive.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 400, body
        assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("flags", [["--model", "no-such-model"],
                                   ["--model", "tiny", "--workload", "nope.jsonl"]])
def test_a_misconfigured_run_fails_at_once(kvik_server, capsys, flags):
    code = main(["bench", "serve", "--base-url", kvik_server.url, "--num-prompts", "64", "--no-progress",
                 *flags])
    assert code == 2
    assert "error" in capsys.readouterr().err
