"""GPTQ and AWQ checkpoints: written here from known integer codes with each format's packing, loaded
by kvik, and compared with the weights the codes stand for (scale * (code - zero)) and, through
HF transformers on those float weights, with greedy output.

transformers itself reads these formats only through optional kernel packages (gptqmodel, autoawq)
that need CUDA builds, so the reference dequantization is the formula, applied here to the integer
codes before they are packed; the packers below are written from the formats' definitions and share
no code with kvik's unpacking.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvik import LLM, SamplingParams
from kvik.core.errors import ConfigError, MissingWeightsError
from kvik.model.loader import load_model, load_model_config
from tests.reference import hf_greedy

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUP = 32
AWQ_COLUMN_OF_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds column 8w + this[j]


def pack_words(codes: np.ndarray, bits: int, axis: int, column_of=None) -> np.ndarray:
    """Pack unsigned `bits`-bit codes into int32 words along `axis`, value j at bit j * bits."""
    per_word = 32 // bits
    codes = np.moveaxis(codes.astype(np.int64), axis, -1)
    words = np.zeros(codes.shape[:-1] + (codes.shape[-1] // per_word,), np.int64)
    for w in range(words.shape[-1]):
        for j in range(per_word):
            column = w * per_word + (column_of[j] if column_of else j)
            words[..., w] |= codes[..., column] << (j * bits)
    return np.ascontiguousarray(np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis))


def quantized_copy(source, target, method: str, bits: int = 4, fmt: str = "gptq", act_order=False,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Copy the model at `source` to `target` with every decoder linear replaced by random codes in
    `method`'s layout; returns the float32 (out, in) weight each linear stands for."""
    rng = np.random.default_rng(seed)
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    expected: dict[str, torch.Tensor] = {}
    for name in [n for n in tensors if n.endswith(".weight") and n.rsplit(".", 1)[0].endswith(LINEARS)]:
        module = name.removesuffix(".weight")
        out_features, in_features = tensors.pop(name).shape
        groups = in_features // GROUP
        codes = rng.integers(0, 2**bits, size=(in_features, out_features))
        zeros = rng.integers(1, 2**bits, size=(groups, out_features))  # v1 GPTQ stores zero - 1 >= 0
        scales = rng.uniform(0.02, 0.06, size=(groups, out_features)).astype(np.float16)
        group_of = np.arange(in_features) // GROUP
        if act_order:
            group_of = rng.permutation(group_of)
        weight = scales.astype(np.float32)[group_of] * (codes - zeros[group_of])
        expected[name] = torch.from_numpy(weight.T.astype(np.float32))
        if method == "gptq":
            stored_zeros = zeros - 1 if fmt == "gptq" else zeros
            tensors[f"{module}.qweight"] = torch.from_numpy(pack_words(codes, bits, axis=0))
            tensors[f"{module}.qzeros"] = torch.from_numpy(pack_words(stored_zeros, bits, axis=1))
            tensors[f"{module}.g_idx"] = torch.from_numpy(group_of.astype(np.int32))
        else:
            tensors[f"{module}.qweight"] = torch.from_numpy(
                pack_words(codes, 4, axis=1, column_of=AWQ_COLUMN_OF_NIBBLE))
            tensors[f"{module}.qzeros"] = torch.from_numpy(
                pack_words(zeros, 4, axis=1, column_of=AWQ_COLUMN_OF_NIBBLE))
        tensors[f"{module}.scales"] = torch.from_numpy(scales)
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    if method == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": GROUP,
                                         "desc_act": act_order, "sym": False,
                                         "checkpoint_format": fmt}
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                         "zero_point": True, "version": "gemm"}
    (target / "config.json").write_text(json.dumps(config))
    return expected


def float_copy(source, target, weights: dict[str, torch.Tensor]) -> None:
    """The same model with the dequantized weights stored as floats: HF's reference input."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    tensors.update({name: w.contiguous() for name, w in weights.items()})
    save_file(tensors, str(target / "model.safetensors"))


def loaded_linear(model, name: str, config) -> torch.Tensor:
    """A checkpoint linear's rows out of kvik's fused parameters."""
    layer, _, leaf = name.partition(".self_attn.") if ".self_attn." in name else name.partition(".mlp.")
    params = dict(model.named_parameters())
    q, kv, inter = config.num_heads * config.head_dim, config.kv_dim, config.intermediate_size
    rows = {"q_proj": ("self_attn.qkv_proj", 0, q), "k_proj": ("self_attn.qkv_proj", q, kv),
            "v_proj": ("self_attn.qkv_proj", q + kv, kv), "gate_proj": ("mlp.gate_up_proj", 0, inter),
            "up_proj": ("mlp.gate_up_proj", inter, inter)}
    proj = leaf.removesuffix(".weight")
    if proj in rows:
        fused, start, size = rows[proj]
        return params[f"{layer}.{fused}.weight"][start:start + size]
    parent = "self_attn" if proj == "o_proj" else "mlp"
    return params[f"{layer}.{parent}.{proj}.weight"]


CASES = [("gptq", 4, "gptq", False), ("gptq", 4, "gptq", True), ("gptq", 8, "gptq", False),
         ("gptq", 4, "gptq_v2", False), ("awq", 4, "gemm", False)]


@pytest.mark.parametrize("method,bits,fmt,act_order", CASES,
                         ids=["gptq4", "gptq4-act-order", "gptq8", "gptq4-v2", "awq4"])
def test_loaded_weights_equal_the_reference_dequantization(tiny_llama, tmp_path, method, bits, fmt,
                                                           act_order):
    expected = quantized_copy(tiny_llama, tmp_path / "q", method, bits, fmt, act_order)
    config = load_model_config(tmp_path / "q")
    model = load_model(tmp_path / "q", config, torch.device("cpu"), torch.float32,
                       show_progress=False).model
    assert len(expected) == 7 * config.num_layers
    for name, weight in expected.items():
        assert torch.equal(loaded_linear(model, name, config), weight), name


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_greedy_output_equals_hf_on_the_dequantized_weights(tiny_llama, tmp_path, method):
    expected = quantized_copy(tiny_llama, tmp_path / "q", method, seed=5)
    float_copy(tiny_llama, tmp_path / "f", expected)
    llm = LLM(str(tmp_path / "q"), show_progress=False)
    ids = llm.engine.tokenizer.encode("The moon rose over the quiet hills")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert llm.generate([ids], params)[0].outputs[0].token_ids == hf_greedy(tmp_path / "f", ids, 10)[0]


def test_unsupported_quantization_configs_are_clear_errors(tiny_llama, tmp_path):
    quantized_copy(tiny_llama, tmp_path / "q", "gptq")
    path = tmp_path / "q"
    config = json.loads((path / "config.json").read_text())
    for change, message in [({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
                            ({"bits": 3}, "GPTQ with 3 bits"),
                            ({"checkpoint_format": "marlin"}, "'marlin' is not supported")]:
        (path / "config.json").write_text(json.dumps(
            {**config, "quantization_config": {**config["quantization_config"], **change}}))
        with pytest.raises(ConfigError, match=message):
            load_model(path, load_model_config(path), torch.device("cpu"), torch.float32,
                       show_progress=False)


def test_a_quantized_linear_missing_its_scales_is_reported(tiny_llama, tmp_path):
    quantized_copy(tiny_llama, tmp_path / "q", "gptq")
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.scales"]
    save_file(tensors, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(MissingWeightsError, match="model.layers.0.mlp.up_proj.*scales"):
        load_model(tmp_path / "q", load_model_config(tmp_path / "q"), torch.device("cpu"),
                   torch.float32, show_progress=False)
