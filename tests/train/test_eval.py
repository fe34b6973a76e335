"""`kvik eval`: the win rate of a policy served by a real `kvik serve` process against a reference
model directory, judged by a reward model, equals the one recomputed by hand from HF transformers'
scores of the same answers; lm-evaluation-harness's local-completions client scores a local
multiple-choice task through kvik serve exactly as HF transformers' log-likelihoods rank the choices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.server.conftest import start_server
from tests.train.preference_helpers import write_keyword_comparisons
from tests.train.test_reward import reward_config

from kvik.data.comparisons import ComparisonsConfig, prepare_comparisons
from kvik.train.config import train_config_from_dict
from kvik.train.evaluate import wilson_interval, win_rate
from kvik.train.trainer import train


def test_win_rate_arithmetic() -> None:
    result = win_rate([1.0, 2.0, 0.5, 3.0], [0.5, 2.0, 1.0, 1.0])
    assert (result.wins, result.ties, result.losses) == (2, 1, 1)
    assert result.win_rate == pytest.approx(2.5 / 4)
    low, high = wilson_interval(2.5, 4)
    assert result.interval == (low, high) and low < 0.625 < high


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_win_rate_of_a_served_policy(tmp_path: Path, tiny_llama: Path, model_dir_factory) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prefs = prepare_comparisons(ComparisonsConfig(
        str(write_keyword_comparisons(tmp_path / "labels.jsonl", 80)), str(tmp_path / "prefs"),
        val_fraction=0.25)).output_dir
    rm = tmp_path / "rm"
    train(train_config_from_dict(reward_config(rm, tiny_llama, prefs, max_steps=5, eval_every=0)))
    other = model_dir_factory("llama", seed=1)  # a different random "policy"
    server = start_server(other, tmp_path, name="policy", timeout=300)
    try:
        out = tmp_path / "eval"
        result = subprocess.run(
            [sys.executable, "-m", "kvik.cli.main", "eval", "winrate", "--policy", server.url,
             "--reference", str(tiny_llama), "--reward-model", str(rm), "--prompts", str(prefs),
             "--limit", "8", "--max-tokens", "8", "--output", str(out)],
            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "win rate" in result.stdout
    summary = json.loads((out / "winrate.json").read_text())
    # JSON Lines end at "\n" only: the samples hold generated text, written with ensure_ascii=False,
    # and splitlines() would also cut at a raw U+2028 or U+0085 inside one.
    samples = [json.loads(line) for line in (out / "winrate_samples.jsonl").read_text().split("\n") if line]
    assert summary["prompts"] == len(samples) == 8
    # Recompute every score with HF transformers on the saved reward model.
    tokenizer = AutoTokenizer.from_pretrained(rm)
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()

    def score(prompt: str, answer: str) -> float:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": answer}], tokenize=False)
        with torch.no_grad():
            return float(model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits)

    policy = [score(s["prompt"], s["policy"]) for s in samples]
    reference = [score(s["prompt"], s["reference"]) for s in samples]
    assert [s["policy_reward"] for s in samples] == pytest.approx(policy, abs=1e-4)
    assert [s["reference_reward"] for s in samples] == pytest.approx(reference, abs=1e-4)
    assert summary["win_rate"] == pytest.approx(win_rate(policy, reference).win_rate)


TASK_YAML = """task: kvik_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
QUESTIONS = [("The capital of France is", [" Paris", " a fox", " the engine"], 0),
             ("The quick brown fox jumps over the", [" lazy dog", " memory", " Tuesday"], 0),
             ("A language model reads a sequence of", [" bricks", " tokens", " songs"], 1),
             ("Blocks that hold the same prefix can be", [" eaten", " shared", " painted"], 1),
             ("When memory runs out, the newest request is", [" paused", " promoted", " sung"], 0),
             ("One plus one is", [" three", " seven", " two"], 2)]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_lm_eval_harness_through_kvik_serve_matches_transformers(tmp_path: Path, tiny_llama: Path) -> None:
    pytest.importorskip("lm_eval")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "kvik_tiny_mc.yaml").write_text(TASK_YAML.format(data=data))
    server = start_server(tiny_llama, tmp_path, name="tiny", timeout=300)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    try:
        result = subprocess.run(
            [sys.executable, "-m", "kvik.cli.main", "eval", "lm-eval", "--base-url", server.url,
             "--model", "tiny", "--tokenizer", str(tiny_llama), "--tasks", "kvik_tiny_mc",
             "--include-path", str(tasks), "--output", str(tmp_path / "results.json")],
            capture_output=True, text=True, timeout=600, env=env)
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr[-4000:]
    accuracy = json.loads((tmp_path / "results.json").read_text())["results"]["kvik_tiny_mc"]["acc,none"]

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    correct = 0
    for question, choices, answer in QUESTIONS:
        context = tokenizer(question)["input_ids"]
        scores = []
        for choice in choices:
            whole = tokenizer(question + choice)["input_ids"]
            continuation = whole[len(context):]
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0], -1)
            scores.append(sum(float(logprobs[len(context) - 1 + i, t]) for i, t in enumerate(continuation)))
        correct += max(range(len(choices)), key=scores.__getitem__) == answer
    assert accuracy == pytest.approx(correct / len(QUESTIONS))
