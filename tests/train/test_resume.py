"""Checkpoints: a run stopped at step k and resumed ends bit-identical to an uninterrupted one; a
crash in the middle of a save leaves the last good checkpoint usable; only the last K are kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.train.helpers import pretrain_config
from safetensors.torch import load_file

from kvik.train import checkpoint as ckpt
from kvik.train.config import train_config_from_dict
from kvik.train.trainer import train

# Gradient accumulation and an odd stop step: the resumed run must replay micro-batches exactly.
SETTINGS = {"max_steps": 10, "grad_accum_steps": 2, "micro_batch_size": 4, "eval_every": 5,
            "checkpoint": {"every_steps": 4, "keep_last": 2}}


def _losses(out: Path) -> list[tuple[int, str, float]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], key, r[key]) for r in records for key in ("loss", "val_loss") if key in r]


@pytest.fixture(scope="module")
def uninterrupted(shards_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    train(train_config_from_dict(pretrain_config(out, shards_dir, **SETTINGS)))
    return out


def test_stopped_and_resumed_run_equals_the_uninterrupted_one(uninterrupted: Path, shards_dir: Path,
                                                              tmp_path: Path) -> None:
    config = train_config_from_dict(pretrain_config(tmp_path, shards_dir, **SETTINGS))
    first = train(config, stop_after_steps=3)
    assert first.step == 3 and not first.finished
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step-00000003"]
    second = train(config)
    assert second.step == 10 and second.finished

    expected = load_file(uninterrupted / "model.safetensors")
    resumed = load_file(tmp_path / "model.safetensors")
    assert expected.keys() == resumed.keys()
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), name
    # The loss curve after the resume continues the one before it, value for value.
    assert _losses(tmp_path) == _losses(uninterrupted)


def test_a_crash_while_saving_keeps_the_last_good_checkpoint(shards_dir: Path, tmp_path: Path,
                                                            monkeypatch) -> None:
    config = train_config_from_dict(pretrain_config(tmp_path, shards_dir, **SETTINGS))
    train(config, stop_after_steps=4)  # checkpoint at step 4
    real_save = ckpt._save

    def crash_on_optimizer(obj, path: Path) -> None:
        if path.name == "optimizer.pt":
            path.write_bytes(b"half written")
            raise OSError("disk full")
        real_save(obj, path)

    monkeypatch.setattr(ckpt, "_save", crash_on_optimizer)
    with pytest.raises(OSError, match="disk full"):
        train(config, stop_after_steps=4)  # dies saving step 8
    monkeypatch.setattr(ckpt, "_save", real_save)

    root = tmp_path / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-00000004"]
    assert (root / ".tmp-step-00000008").exists()  # the debris is ignored, then cleared
    result = train(config)
    assert result.finished and result.step == 10
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-00000008", "step-00000010"]
    assert not (root / ".tmp-step-00000008").exists()
