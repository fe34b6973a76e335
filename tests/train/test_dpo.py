"""Task dpo: on held-out comparisons, the DPO policy's implicit reward beta * log(pi / pi_ref)
ranks the preferred answer first far more often than the SFT model's own likelihood does; SimPO
(no reference model) learns too; the loss equals the formula on hand-made log-probabilities."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tests.train.preference_helpers import write_keyword_comparisons

from kvik.data.comparisons import ComparisonsConfig, prepare_comparisons
from kvik.train.config import train_config_from_dict
from kvik.train.dpo import preference_loss
from kvik.train.trainer import train


pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def comparisons_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dpo-prefs")
    source = write_keyword_comparisons(root / "labels.jsonl", 300, seed=1)
    return prepare_comparisons(ComparisonsConfig(str(source), str(root / "prepared"),
                                                 val_fraction=0.2)).output_dir


def dpo_config(out: Path, init_from: Path, comparisons: Path, **overrides) -> dict:
    config = {"output_dir": str(out), "task": "dpo", "model": {"init_from": str(init_from)},
              "data": {"comparisons": str(comparisons), "seq_len": 64}, "max_steps": 40,
              "micro_batch_size": 8, "optim": {"lr": 5e-4, "warmup_steps": 4, "weight_decay": 0.0},
              "checkpoint": {"every_steps": 0, "keep_last": 1}, "eval_every": 0,
              "dpo": {"beta": 0.1}, "tensorboard": False}
    config.update(overrides)
    return config


def _at_start(out: Path) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if r["step"] == 0)


def test_dpo_beats_the_sft_models_own_preference_on_held_out_pairs(tmp_path: Path, tiny_llama: Path,
                                                                   comparisons_dir: Path) -> None:
    out = tmp_path / "dpo"
    result = train(train_config_from_dict(dpo_config(out, tiny_llama, comparisons_dir)))
    start = _at_start(out)
    sft_accuracy = start["val_logp_accuracy"]  # the SFT model: is the chosen answer more likely?
    assert start["val_accuracy"] == 0.5  # policy == reference: every implicit reward ties
    assert result.evaluation["val_accuracy"] >= 0.85
    assert result.evaluation["val_accuracy"] >= sft_accuracy + 0.2
    assert result.evaluation["val_loss"] < math.log(2)


def test_simpo_needs_no_reference_and_learns(tmp_path: Path, tiny_llama: Path,
                                             comparisons_dir: Path) -> None:
    out = tmp_path / "simpo"
    config = dpo_config(out, tiny_llama, comparisons_dir, dpo={"loss": "simpo", "beta": 2.0,
                                                              "simpo_gamma": 0.5})
    result = train(train_config_from_dict(config))
    assert result.evaluation["val_accuracy"] >= 0.8


def test_loss_formulas() -> None:
    pc, pr = torch.tensor([-3.0]), torch.tensor([-5.0])
    rc, rr = torch.tensor([-4.0]), torch.tensor([-4.5])
    h = (pc - rc) - (pr - rr)  # 1.5
    loss, margin = preference_loss("sigmoid", 0.1, 0.0, pc, pr, rc, rr, torch.tensor([2]), torch.tensor([4]))
    assert float(loss) == pytest.approx(-math.log(1 / (1 + math.exp(-0.15))))
    assert float(margin) == pytest.approx(0.15)
    loss, _ = preference_loss("ipo", 0.1, 0.0, pc, pr, rc, rr, torch.tensor([2]), torch.tensor([4]))
    assert float(loss) == pytest.approx((float(h) - 5.0) ** 2)
    loss, margin = preference_loss("simpo", 2.0, 0.5, pc, pr, None, None, torch.tensor([2]),
                                   torch.tensor([4]))
    assert float(margin) == pytest.approx(2.0 * (-1.5 + 1.25))
    assert float(loss) == pytest.approx(-math.log(1 / (1 + math.exp(-(float(margin) - 0.5)))))
