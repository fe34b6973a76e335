"""GPTQ and AWQ checkpoints: written here from known integer codes with each format's packing, loaded
by kvik, and compared with the weights the codes stand for (scale * (code - zero)) and, through
HF transformers on those float weights, with greedy output. Loaded both ways: dequantized to float,
and (the engine's default for such a checkpoint) as int4 layers built from the checkpoint's own codes,
with the layers that cannot be int4 falling back to the exact dequantization.

transformers itself reads these formats only through optional kernel packages (gptqmodel, autoawq)
that need CUDA builds, so the reference dequantization is the formula, applied to the integer codes
before they are packed; the packers (tests/model/gptq_files.py) are written from the formats'
definitions and share no code with kvik's unpacking.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvik import LLM, SamplingParams
from kvik.core.errors import ConfigError, MissingWeightsError
from kvik.model.loader import load_model, load_model_config
from kvik.model.quant import WeightOnlyLinear
from kvik.model.weights import FLOAT_PIECE
from tests.model.gptq_files import GROUP, float_copy, quantized_copy
from tests.reference import hf_greedy

def loaded_module(model, name: str, config) -> tuple[torch.nn.Module, slice]:
    """The (possibly fused) module a checkpoint linear was loaded into, and its rows there."""
    layer, _, leaf = name.partition(".self_attn.") if ".self_attn." in name else name.partition(".mlp.")
    q, kv, inter = config.num_heads * config.head_dim, config.kv_dim, config.intermediate_size
    rows = {"q_proj": ("self_attn.qkv_proj", 0, q), "k_proj": ("self_attn.qkv_proj", q, kv),
            "v_proj": ("self_attn.qkv_proj", q + kv, kv), "gate_proj": ("mlp.gate_up_proj", 0, inter),
            "up_proj": ("mlp.gate_up_proj", inter, inter)}
    proj = leaf.removesuffix(".weight")
    if proj in rows:
        fused, start, size = rows[proj]
        return model.get_submodule(f"{layer}.{fused}"), slice(start, start + size)
    parent = "self_attn" if proj == "o_proj" else "mlp"
    module = model.get_submodule(f"{layer}.{parent}.{proj}")
    return module, slice(0, module.out_features)


def loaded_linear(model, name: str, config) -> torch.Tensor:
    """A checkpoint linear's rows out of kvik's (fused) modules, float or int4 (dequantized)."""
    module, rows = loaded_module(model, name, config)
    weight = module.dequantize() if isinstance(module, WeightOnlyLinear) else module.weight
    return weight[rows]


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


@pytest.mark.parametrize("method,arch,dtype", [("gptq", "llama", "auto"), ("awq", "llama", "auto"),
                                               ("gptq", "qwen2", "auto"), ("gptq", "llama", "float32")],
                         ids=["gptq-int4", "awq-int4", "gptq-int4-qwen2-bias", "gptq-dequantized"])
def test_greedy_output_equals_hf_on_the_dequantized_weights(model_dir_factory, tmp_path, method, arch, dtype,
                                                            float_activations):
    """Served as int4 from the checkpoint's codes (dtype auto; Qwen2 has q/k/v biases to carry over)
    and dequantized (an explicit --dtype float32), greedy output equals HF on the float weights."""
    source = model_dir_factory(arch)
    expected = quantized_copy(source, tmp_path / "q", method, seed=5)
    float_copy(source, tmp_path / "f", expected)
    llm = LLM(str(tmp_path / "q"), show_progress=False, dtype=dtype)
    direct = llm.engine.info.precision.startswith(f"weights int4 from the checkpoint ({method.upper()}, "
                                                  "groups of 32, zero points; 8 linear layers)")
    assert direct == (dtype == "auto"), llm.engine.info.precision
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


# Rounding to the nearest float16 is off by at most this fraction of the value (normal range).
FP16_UNIT_ROUNDOFF = 2.0**-11


def load_int4(path):
    return load_model(path, load_model_config(path), torch.device("cpu"), torch.float32,
                      show_progress=False, keep_int4=True)


@pytest.mark.parametrize("method,fmt,symmetric", [("gptq", "gptq", False), ("gptq", "gptq_v2", False),
                                                  ("gptq", "gptq", True), ("awq", "gemm", False)],
                         ids=["gptq4", "gptq4-v2", "gptq4-symmetric", "awq4"])
def test_int4_checkpoints_become_int4_layers_from_their_own_codes(tiny_llama, tmp_path, method, fmt,
                                                                   symmetric):
    zero_times_scale: dict[str, torch.Tensor] = {}
    expected = quantized_copy(tiny_llama, tmp_path / "q", method, fmt=fmt, symmetric=symmetric,
                              zero_times_scale=zero_times_scale)
    loaded = load_int4(tmp_path / "q")
    config = loaded.config
    linears = [m for m in loaded.model.modules() if isinstance(m, WeightOnlyLinear)]
    assert len(linears) == 4 * config.num_layers  # qkv, o, gate_up, down in each layer
    assert all(m.kind == "int4" and m.group_size == GROUP for m in linears)
    # Zero points all 8 are kvik's symmetric layout: no offsets stored, and the weights are exact.
    assert all((m.offsets is None) == symmetric for m in linears)
    summary = loaded.checkpoint_int4
    assert (summary.layers, summary.dequantized, summary.sources) == (8, 0, {method.upper()})
    # 4-bit codes plus a float16 scale (and offset) per group of 32: 0.625 (0.5625) bytes per weight.
    weights = sum(m.in_features * m.out_features for m in linears)
    assert sum(m.nbytes for m in linears) / weights == 0.5 + (2 if symmetric else 4) / GROUP
    for name, weight in expected.items():
        got = loaded_linear(loaded.model, name, config)
        # The one rounding: offset = float16(-zero * scale), off by <= 2**-11 |zero * scale|, which
        # is at most scale / 128 (zero <= 16).
        error = (got - weight).abs()
        assert (error <= FP16_UNIT_ROUNDOFF * zero_times_scale[name]).all(), (name, error.max())
        assert torch.equal(got, weight) or not symmetric
    # load_model counts the packed bytes, not float copies that were never allocated.
    dequantized = load_model(tmp_path / "q", config, torch.device("cpu"), torch.float32, show_progress=False)
    assert loaded.weight_bytes == dequantized.weight_bytes - 4 * weights + sum(m.nbytes for m in linears)


@pytest.mark.parametrize("change,reason,modules", [
    ({"act_order": True}, "the checkpoint stores them as GPTQ with act-order (g_idx reorders the groups)", 8),
    ({"bits": 8}, "the checkpoint stores them as GPTQ with 8-bit codes", 8),
    ({"group": 16}, "the checkpoint stores them as GPTQ with group size 16 (kvik's int4 kernels take "
                    "groups of 32, 64, 128)", 8),
    ({"keep_float": ("self_attn.k_proj",)}, FLOAT_PIECE, 2),
], ids=["act-order", "8-bit", "group-16", "fused-with-a-float-piece"])
def test_layers_that_cannot_be_int4_fall_back_to_the_exact_dequantization(tiny_llama, tmp_path, caplog,
                                                                          change, reason, modules):
    expected = quantized_copy(tiny_llama, tmp_path / "q", "gptq", **change)
    with caplog.at_level(logging.INFO, logger="kvik.model"):
        loaded = load_int4(tmp_path / "q")
    fell_back = set()
    for name, weight in expected.items():
        module, _ = loaded_module(loaded.model, name, loaded.config)
        if not isinstance(module, WeightOnlyLinear):
            fell_back.add(module)
            assert torch.equal(loaded_linear(loaded.model, name, loaded.config), weight), name
    assert len(fell_back) == modules and loaded.checkpoint_int4.dequantized == modules
    assert loaded.checkpoint_int4.layers == 8 - modules
    # One log line per reason, however many modules it covers.
    lines = [r.getMessage() for r in caplog.records if "instead of int4" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"pre-quantized weights: {modules} linear module(s)")
    assert f"because {reason} (e.g. model.layers.0." in lines[0]


@pytest.mark.parametrize("engine_args,precision", [
    ({"quantization": "int8"}, "weights int8 (groups of 32), "),
    ({"dtype": "bfloat16"}, "weights bfloat16, "),
    ({"quantization": "int4", "quantization_group_size": 128},
     "weights int4 from the checkpoint (GPTQ, groups of 32, zero points; 8 linear layers), other linear "
     "layers int4 (groups of 128, symmetric; LM head int8), "),
], ids=["int8", "bfloat16", "int4"])
def test_another_requested_format_dequantizes_first(tiny_llama, tmp_path, engine_args, precision):
    """int8 and bfloat16 are applied to the dequantized weights, as for a float model; int4 keeps the
    checkpoint's own layers and quantizes the rest (here the LM head) with the requested groups."""
    quantized_copy(tiny_llama, tmp_path / "q", "gptq")
    llm = LLM(str(tmp_path / "q"), show_progress=False, **engine_args)
    assert llm.engine.info.precision.startswith(precision), llm.engine.info.precision
    int4_groups = {m.group_size for m in llm.engine.core.model.modules()
             if isinstance(m, WeightOnlyLinear) and m.kind == "int4"}
    assert int4_groups == ({32} if "quantization_group_size" in engine_args else set())
