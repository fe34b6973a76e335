"""Checkpoint formats: sharded safetensors with an index, the pre-transformers-5 config layout,
hub ids, and bf16 weights; the weight loader joining pre-quantized int4 pieces of a fused module."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from kvik import LLM, SamplingParams
from kvik.model.config import model_config_from_hf
from kvik.model.loader import resolve_model_path
from kvik.model.quant import WeightOnlyLinear
from kvik.model.quant.prequantized import PrequantizedWeight
from kvik.model.quant.reference import dequantize_int4, quantize_int4
from kvik.model.weights import FusedPiece, WeightLoader
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


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 48, bias=True)  # fused from a (32 rows) and b (16 rows)


class _Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()


def _piece(rows: int, group: int, zero_point: bool, seed: int) -> PrequantizedWeight:
    weight = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed))
    q = quantize_int4(weight, group, zero_point)
    return PrequantizedWeight("test", (rows, 64), q, "", lambda: dequantize_int4(q))


def _load_fused(a: PrequantizedWeight, b: PrequantizedWeight, transform=None) -> _Fused:
    model = _Fused()
    loader = WeightLoader(model, [FusedPiece("a", "proj", 0, 32), FusedPiece("b", "proj", 32, 16)], transform)
    loader.enable_int4(torch.device("cpu"))
    with torch.no_grad():
        loader.load("block.a.weight", a)
        loader.load("block.b.weight", b)
        # The bias arrives after the int4 layer is assembled; finish() carries it over.
        assert loader.load("block.a.bias", torch.arange(32.0)) and loader.load("block.b.bias", -torch.ones(16))
        loader.finish("test checkpoint")
    return model


def test_fused_int4_pieces_join_along_rows_or_fall_back_together():
    a, b = _piece(32, 32, True, 0), _piece(16, 32, False, 1)  # zero points + symmetric
    expected = torch.cat([dequantize_int4(a.int4), dequantize_int4(b.int4)])
    bias = torch.cat([torch.arange(32.0), -torch.ones(16)])
    joined = _load_fused(a, b).block.proj
    assert isinstance(joined, WeightOnlyLinear) and joined.kind == "int4" and joined.group_size == 32
    # The symmetric piece's offsets become -8 * scale, exact in float16: the same weights.
    assert torch.equal(joined.dequantize(), expected) and torch.equal(joined.bias, bias)
    for a, b, transform in [(_piece(32, 32, True, 0), _piece(16, 64, True, 1), None),  # group sizes differ
                            (_piece(32, 32, True, 0), _piece(16, 32, True, 1), lambda name, t: t)]:
        fell_back = _load_fused(a, b, transform).block.proj
        assert type(fell_back) is nn.Linear and fell_back.weight.device.type == "cpu"
        assert torch.equal(fell_back.weight, torch.cat([a.dequantize(), b.dequantize()]))
        assert torch.equal(fell_back.bias, bias)
