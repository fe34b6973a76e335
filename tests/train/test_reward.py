"""Task reward: a reward model learns a known preference rule (the preferred answer mentions a
keyword) to >= 90 % held-out accuracy; what it writes is an HF LlamaForSequenceClassification
(num_labels=1, a `score` head) that transformers loads on its own and that scores as training did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.train.preference_helpers import KEYWORD, write_keyword_comparisons

from kvik.data.comparisons import ComparisonsConfig, prepare_comparisons
from kvik.train.config import train_config_from_dict
from kvik.train.trainer import train


pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def comparisons_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prefs")
    source = write_keyword_comparisons(root / "labels.jsonl", 360)
    return prepare_comparisons(ComparisonsConfig(str(source), str(root / "prepared"),
                                                 val_fraction=0.2)).output_dir


def reward_config(out: Path, init_from: Path, comparisons: Path, **overrides) -> dict:
    config = {"output_dir": str(out), "task": "reward", "model": {"init_from": str(init_from)},
              "data": {"comparisons": str(comparisons), "seq_len": 64}, "max_steps": 80,
              "micro_batch_size": 8, "optim": {"lr": 1e-3, "warmup_steps": 5, "weight_decay": 0.0},
              "checkpoint": {"every_steps": 40, "keep_last": 1}, "eval_every": 40,
              "tensorboard": False, "seed": 0}
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def trained_reward_model(tmp_path_factory, tiny_llama: Path, comparisons_dir: Path):
    out = tmp_path_factory.mktemp("reward") / "rm"
    result = train(train_config_from_dict(reward_config(out, tiny_llama, comparisons_dir)))
    return out, result


def test_reward_model_learns_the_rule_to_90_percent_held_out(trained_reward_model) -> None:
    out, result = trained_reward_model
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["step"] == 0)
    assert start["val_accuracy"] < 0.75  # a fresh score head knows nothing of the rule
    assert result.finished and result.evaluation["val_pairs"] >= 50
    assert result.evaluation["val_accuracy"] >= 0.9
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["val_accuracy"] == result.evaluation["val_accuracy"]


def test_saved_reward_model_is_an_hf_sequence_classifier_that_agrees(trained_reward_model) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from kvik.train.reward import RewardScorer

    out, _ = trained_reward_model
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["num_labels"] == 1 if "num_labels" in config else len(config["id2label"]) == 1
    assert config["pad_token_id"] is not None
    model = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    assert model.score.weight.shape[0] == 1
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = "Say something about the farm."
    good, bad = f"The farmer counts his {KEYWORD} in the morning.", "The farmer counts his dog in the morning."
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                            {"role": "assistant", "content": r}], tokenize=False)
             for r in (good, bad)]
    with torch.no_grad():
        hf_scores = [float(model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits)
                     for t in texts]
    ours = RewardScorer(out, torch.device("cpu")).score([prompt, prompt], [good, bad])
    assert ours == pytest.approx(hf_scores, abs=1e-5)
    assert hf_scores[0] > hf_scores[1]


def test_lora_reward_model_writes_adapter_and_full_model(tmp_path: Path, tiny_llama: Path,
                                                         comparisons_dir: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "rm-lora"
    config = reward_config(out, tiny_llama, comparisons_dir, max_steps=4, eval_every=0,
                           lora={"r": 4, "alpha": 8})
    result = train(train_config_from_dict(config))
    assert result.finished and 0.0 <= result.evaluation["val_accuracy"] <= 1.0
    assert (out / "adapter" / "adapter_config.json").exists()
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1
