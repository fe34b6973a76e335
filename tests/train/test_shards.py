"""Training refuses shards whose bytes differ from the manifest."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tests.train.helpers import pretrain_config

from kvik.cli.main import main
from kvik.train.config import train_config_from_dict
from kvik.train.shards import ShardChecksumError, open_dataset
from kvik.train.trainer import train


def _copy(shards_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(shards_dir, tmp_path / "shards"))


def test_intact_shards_open_and_hold_the_manifest_counts(shards_dir: Path) -> None:
    dataset = open_dataset(shards_dir)
    for name, split in dataset.manifest["splits"].items():
        assert len(dataset.splits[name]) == split["tokens"] > 0
    stream = dataset.splits["train"]
    assert stream.read(len(stream) - 1, 1).tolist() == [dataset.eos_token_id]


def test_a_changed_byte_makes_training_refuse_the_shard(shards_dir: Path, tmp_path: Path,
                                                        capsys) -> None:
    shards = _copy(shards_dir, tmp_path)
    shard = shards / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))

    with pytest.raises(ShardChecksumError, match="train-00000.bin: sha256 differs"):
        open_dataset(shards)
    config = train_config_from_dict(pretrain_config(tmp_path / "run", shards))
    with pytest.raises(ShardChecksumError):
        train(config)
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any step

    (tmp_path / "train.yaml").write_text(
        f"output_dir: {tmp_path / 'run'}\ndata: {{shards: {shards}}}\nmodel: {{config: "
        "{hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2}}\n")
    assert main(["train", "--config", str(tmp_path / "train.yaml")]) == 2
    assert "sha256 differs from manifest.json" in capsys.readouterr().err


def test_a_replaced_tokenizer_or_missing_shard_is_refused(shards_dir: Path, tmp_path: Path) -> None:
    shards = _copy(shards_dir, tmp_path)
    tokenizer = shards / "tokenizer" / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace("<|endoftext|>", "<|end_of_text|>"))
    with pytest.raises(ShardChecksumError, match="tokenizer"):
        open_dataset(shards)
    shutil.copyfile(shards_dir / "tokenizer" / "tokenizer.json", tokenizer)
    (shards / "val-00000.bin").unlink()
    with pytest.raises(ShardChecksumError, match="val-00000.bin"):
        open_dataset(shards)
