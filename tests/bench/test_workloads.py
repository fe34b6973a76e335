"""Workloads are reproducible, respect their ranges, and fail clearly on bad input."""

from __future__ import annotations

import json

import pytest

from kvik.bench.load import arrival_times
from kvik.bench.workloads import WorkloadSpec, build_workload, parse_range
from kvik.core.errors import ConfigError


def test_parse_range():
    assert parse_range("64,256") == (64, 256)
    assert parse_range("128") == (128, 128)
    for bad in ("0,5", "9,3", "a,b", "1,2,3"):
        with pytest.raises(ConfigError):
            parse_range(bad)


def test_random_workload_is_seeded_and_within_ranges():
    spec = WorkloadSpec(num_prompts=50, input_len_range=(8, 20), output_len_range=(3, 9), seed=7)
    first = build_workload(spec, chat=False, vocab_size=100)
    assert first == build_workload(spec, chat=False, vocab_size=100)
    other_seed = WorkloadSpec(num_prompts=50, input_len_range=(8, 20), output_len_range=(3, 9), seed=8)
    assert first != build_workload(other_seed, chat=False, vocab_size=100)
    for request in first:
        assert 8 <= len(request.prompt) <= 20 and request.prompt_tokens == len(request.prompt)
        assert all(0 <= t < 100 for t in request.prompt)
        assert 3 <= request.max_tokens <= 9
    assert {len(r.prompt) for r in first} != {8}  # the lengths do vary


def test_random_chat_workload_sends_words():
    spec = WorkloadSpec(num_prompts=3, input_len_range=(5, 5), output_len_range=(4, 4))
    requests = build_workload(spec, chat=True, vocab_size=None)
    for request in requests:
        assert request.prompt is None and request.max_tokens == 4
        (message,) = request.messages
        assert message["role"] == "user" and len(message["content"].split()) == 5


def test_token_ids_need_a_vocabulary_size():
    with pytest.raises(ConfigError, match="--vocab-size"):
        build_workload(WorkloadSpec(num_prompts=1), chat=False, vocab_size=None)


def test_prefix_workload_shares_the_prefix_only():
    spec = WorkloadSpec(kind="prefix", num_prompts=4, prefix_len=40, question_len=6, output_len_range=(2, 2))
    requests = build_workload(spec, chat=False, vocab_size=500)
    prefixes = {tuple(r.prompt[:40]) for r in requests}
    questions = {tuple(r.prompt[40:]) for r in requests}
    assert len(prefixes) == 1 and len(questions) == 4
    assert all(len(r.prompt) == 46 and r.max_tokens == 2 for r in requests)
    chat = build_workload(spec, chat=True, vocab_size=None)
    assert len({r.messages[0]["content"] for r in chat}) == 1
    assert all(r.messages[0]["role"] == "system" and len(r.messages[1]["content"].split()) == 6 for r in chat)


def test_file_workload(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello there", "max_tokens": 5}, {"prompt": [1, 2, 3]}, {"prompt": "third"}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    spec = WorkloadSpec(kind=str(path), num_prompts=2, output_len_range=(7, 7))
    requests = build_workload(spec, chat=False, vocab_size=None)
    assert [(r.prompt, r.max_tokens, r.prompt_tokens) for r in requests] == [
        ("hello there", 5, None), ([1, 2, 3], 7, 3)]
    chat = build_workload(WorkloadSpec(kind=str(path), num_prompts=1), chat=True, vocab_size=None)
    assert chat[0].messages == [{"role": "user", "content": "hello there"}]


@pytest.mark.parametrize("line, chat, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, False, "--endpoint chat"),
    ({"prompt": [1, 2]}, True, "--endpoint completions"),
    ({"prompt": "a", "messages": []}, False, "exactly one"),
    ({"prompt": "a", "max_tokens": 0}, False, "max_tokens"),
])
def test_file_workload_errors(tmp_path, line, chat, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ConfigError, match=message):
        build_workload(WorkloadSpec(kind=str(path)), chat=chat, vocab_size=None)


def test_unknown_workload_names_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="random, prefix or a JSONL file"):
        build_workload(WorkloadSpec(kind=str(tmp_path / "missing.jsonl")), chat=False, vocab_size=10)


def test_poisson_arrivals_are_seeded_with_the_requested_mean_gap():
    times = arrival_times(20_000, request_rate=4.0, seed=3)
    assert times == arrival_times(20_000, request_rate=4.0, seed=3)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    mean_gap = times[-1] / (len(times) - 1)
    assert mean_gap == pytest.approx(0.25, rel=0.03)  # 1 / rate; the sample mean of 20k exponentials
    assert arrival_times(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError):
        arrival_times(3, 0.0, seed=0)
