"""Checkpoint formats: sharded safetensors with an index, the pre-transformers-5 config layout,
hub ids, and bf16 weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvik import LLM, SamplingParams
from kvik.model.config import model_config_from_hf
from kvik.model.loader import resolve_model_path
from tests.reference import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_sharded_checkpoint_loads_and_matches_hf(model_dir_factory):
    path = model_dir_factory("qwen3", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    llm = LLM(str(path), show_progress=False)
    ids = llm.engine.tokenizer.encode("The moon rose over the quiet hills")
    assert llm.generate([ids], GREEDY)[0].outputs[0].token_ids == hf_greedy(path, ids, 8)[0]


def test_legacy_config_layout_gives_the_same_model(tiny_llama, tmp_path):
    """Hub configs written before transformers 5 keep rope_theta at the top level and the scaling
    under rope_scaling with `type`."""
    target = tmp_path / "legacy"
    shutil.copytree(tiny_llama, target)
    config = json.loads((target / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    (target / "config.json").write_text(json.dumps(config))
    new = LLM(str(tiny_llama), show_progress=False).generate(["Hello"], GREEDY)
    old = LLM(str(target), show_progress=False).generate(["Hello"], GREEDY)
    assert new[0].outputs[0].token_ids == old[0].outputs[0].token_ids
    parsed = model_config_from_hf(config, "LlamaForCausalLM")
    assert parsed.rope_theta == 500000.0 and parsed.rope_scaling["rope_type"] == "llama3"


def test_bfloat16_checkpoint_matches_hf_in_float32(model_dir_factory):
    path = model_dir_factory("llama", dtype="bfloat16")
    llm = LLM(str(path), show_progress=False, dtype="float32")
    ids = llm.engine.tokenizer.encode("Questions and answers")
    assert llm.generate([ids], GREEDY)[0].outputs[0].token_ids == hf_greedy(path, ids, 8)[0]


def test_hub_id_is_downloaded_with_huggingface_hub(tiny_llama, monkeypatch):
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        calls.append((repo_id, revision))
        assert "*.safetensors" in allow_patterns
        return str(tiny_llama)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_path("someorg/tiny-model", "main") == tiny_llama
    assert calls == [("someorg/tiny-model", "main")]


def test_hub_download_failure_is_a_clear_error(monkeypatch):
    import huggingface_hub

    from kvik.core.errors import ConfigError

    def offline(**kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConfigError, match="could not download 'someorg/tiny-model'.*network"):
        resolve_model_path("someorg/tiny-model")


def test_dtype_auto_is_float32_on_cpu(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False)
    expected = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    assert llm.engine.core.dtype == expected
