"""The inference passes as module swaps from one entry point, and the engine running every weight and
KV format: the compiled CPU path and plain PyTorch compute the same model (token for token)."""

from __future__ import annotations

import pytest
import torch

from kvik import LLM, SamplingParams
from kvik.core.config import EngineArgs
from kvik.core.errors import ConfigError
from kvik.model.layers.attention import PagedAttention
from kvik.model.layers.kv_cache import PagedKVCache
from kvik.model.layers.norm import RMSNorm
from kvik.model.loader import load_model, load_model_config
from kvik.model.quant import QuantScheme, WeightOnlyLinear, cpu_has_native_bf16
from kvik.model.transforms import bind_kv_cache, optimize_for_inference
from kvik.model.transforms.cpu_modules import CpuPagedAttention, FusedLlamaAttention, FusedRMSNorm
from kvik.model.transforms.decode_stack import DecodeStackModel

CPU = torch.device("cpu")


def loaded(path):
    cfg = load_model_config(path)
    return load_model(path, cfg, CPU, torch.float32, show_progress=False).model, cfg


def cache_for(cfg, dtype=torch.float32) -> PagedKVCache:
    return PagedKVCache.empty(cfg.num_layers, cfg.num_kv_heads, 16, 4, cfg.head_dim, dtype, CPU).zero_()


def test_passes_replace_modules_and_bind_the_decode_stack(model_dir_factory):
    model, cfg = loaded(model_dir_factory("llama"))
    report = optimize_for_inference(model, CPU, torch.float32, weights=QuantScheme("int4", group_size=32))
    if report.kernels is None:
        pytest.skip("no C++ toolchain")
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and isinstance(layer.self_attn, FusedLlamaAttention)
    assert isinstance(layer.self_attn.attn, CpuPagedAttention)
    assert isinstance(layer.self_attn.qkv_proj, WeightOnlyLinear) and layer.self_attn.qkv_proj.kind == "int4"
    assert model.lm_head.kind == "int8"  # the int4 scheme keeps the LM head at int8
    # 2 layers x (qkv, o, gate_up, down) + LM head; no float32 linear is left to pack.
    assert report.quantized_linears == 9 and report.packed_linears == 0
    assert report.kernel_isa in ("avx2", "avx2 (bfloat16 on avx-512)", "portable") or "vnni" in report.kernel_isa
    assert report.int8_activation_linears == (9 if "vnni" in report.kernel_isa else 0)
    # A tiny model's weights sit in cache: the prefetch distance is reported, not timed.
    assert report.weight_prefetch.source.startswith("kept") and report.weight_prefetch.bytes_ahead >= 0
    assert report.linear_weight_bytes < sum(m.in_features * m.out_features * 4 for m in model.modules()
                                            if isinstance(m, WeightOnlyLinear)) / 4
    binding = bind_kv_cache(model, cache_for(cfg, torch.int8))
    assert binding.compiled_attention and binding.decode_stack
    assert isinstance(model.model, DecodeStackModel) and model.model.decode_stack.num_layers == 2
    # Binding again (a new cache) rebuilds the stack instead of wrapping it twice.
    bind_kv_cache(model, cache_for(cfg))
    assert isinstance(model.model.inner, torch.nn.Module) and not isinstance(model.model.inner, DecodeStackModel)


def test_without_kernels_the_model_is_untouched_but_quantized(model_dir_factory):
    model, cfg = loaded(model_dir_factory("llama"))
    report = optimize_for_inference(model, CPU, torch.float32, weights=QuantScheme("int8"), kernels=None)
    assert report.kernels is None and report.swapped_modules == 0 and report.weight_prefetch is None
    assert type(model.model.layers[0].input_layernorm) is RMSNorm
    assert type(model.model.layers[0].self_attn.attn) is PagedAttention
    assert not bind_kv_cache(model, cache_for(cfg)).decode_stack


def test_qwen3_keeps_its_attention_and_has_no_decode_stack(model_dir_factory):
    model, cfg = loaded(model_dir_factory("qwen3"))
    report = optimize_for_inference(model, CPU, torch.float32)
    if report.kernels is None:
        pytest.skip("no C++ toolchain")
    attention = model.model.layers[0].self_attn
    assert not isinstance(attention, FusedLlamaAttention)
    assert isinstance(attention.q_norm, FusedRMSNorm) and isinstance(attention.attn, CpuPagedAttention)
    assert not bind_kv_cache(model, cache_for(cfg)).decode_stack


def test_engine_args_validate_quantization_and_kv_dtype():
    with pytest.raises(ConfigError, match="quantization: 'int3'"):
        EngineArgs(model="m", quantization="int3")
    with pytest.raises(ConfigError, match="quantization_group_size: 48"):
        EngineArgs(model="m", quantization="int4", quantization_group_size=48)
    with pytest.raises(ConfigError, match="kv_cache_dtype: 'fp16'"):
        EngineArgs(model="m", kv_cache_dtype="fp16")
    with pytest.raises(ConfigError, match="zero_point applies to quantization='int4' only"):
        EngineArgs(model="m", quantization="int8", quantization_zero_point=True)
    with pytest.raises(ConfigError, match="group_size applies to quantization='int4' or 'int8' only"):
        EngineArgs(model="m", dtype="bfloat16", quantization_group_size=32)
    with pytest.raises(ConfigError, match="0 \\(a scale per output channel\\) is for quantization='int8'"):
        EngineArgs(model="m", quantization="int4", quantization_group_size=0)
    # The group size's default is the format's: int4 64, int8 32 (0: a scale per output channel).
    assert EngineArgs(model="m", quantization="int8", quantization_group_size=0).quantization_group_size == 0
    from kvik.model.quant.scheme import QuantScheme

    assert (QuantScheme("int4").group_size, QuantScheme("int8").group_size) == (64, 32)
    assert QuantScheme("int8").describe() == "int8 (groups of 32)"
    assert QuantScheme("int8", group_size=0).describe() == "int8 (per output channel)"
    assert QuantScheme("int4", group_size=128).group_for("int8") == 32  # its LM head
    with pytest.raises(ConfigError, match="quantization_zero_point: expected true or false"):
        EngineArgs(model="m", quantization="int4", quantization_zero_point="yes")
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", "m", "--quantization", "int4", "--quantization-group-size", "128",
                              "--quantization-zero-point", "--kv-cache-dtype", "int8", "--activations", "float32"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.quantization, engine_args.quantization_group_size, engine_args.quantization_zero_point,
            engine_args.kv_cache_dtype, engine_args.activations) == ("int4", 128, True, "int8", "float32")
    assert EngineArgs.from_cli_args(parser.parse_args(["--model", "m"])).activations == "auto"
    with pytest.raises(SystemExit):  # argparse names the choices
        parser.parse_args(["--model", "m", "--activations", "int4"])
    with pytest.raises(ConfigError, match="activations: expected a string"):
        EngineArgs(model="m", activations=8)


PROMPTS = [[5, 9, 13, 2, 7], [100, 3, 3, 41, 8, 9, 10, 11, 12, 13, 14], [7] * 23, [1, 2, 3, 4, 5, 6, 7, 8, 9]]
CASES = [  # (engine arguments, the arch)
    # float32 inputs: on AVX512-BF16 CPUs batches of 12+ rows otherwise round theirs to bfloat16
    # (tested against its own reference in test_quant_kernels.py and by the next test).
    ({"dtype": "bfloat16", "activations": "float32"}, "llama"),
    ({"quantization": "int8"}, "llama"),
    ({"quantization": "int4", "quantization_group_size": 32}, "llama"),
    ({"quantization": "int4", "quantization_zero_point": True, "kv_cache_dtype": "int8"}, "qwen2"),
    ({"kv_cache_dtype": "int8"}, "llama"),
    ({"kv_cache_dtype": "fp8"}, "mistral"),
    ({"kv_cache_dtype": "bfloat16", "quantization": "int8"}, "qwen3"),
    ({"quantization": "int8", "kv_cache_dtype": "int8"}, "gpt2"),
]


@pytest.mark.parametrize("engine_args,arch", CASES)
def test_compiled_path_equals_pytorch_path(model_dir_factory, monkeypatch, engine_args, arch, float_activations):
    """The same quantized weights and KV format through the compiled kernels (single sequences on the
    decode stack, batches of four and seven on it too, eleven through the modules, chunked prefill) and through
    plain PyTorch (what CUDA runs): same greedy tokens, logprobs within float32 noise."""
    path = str(model_dir_factory(arch))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    prompts = PROMPTS + [[p + 1 for p in prompt] for prompt in PROMPTS] + PROMPTS[:3]
    compiled = LLM(path, show_progress=False, block_size=4, max_num_batched_tokens=16, **engine_args)
    if compiled.engine.core.cpu_kernels is None:
        pytest.skip("no C++ toolchain")
    runs = [compiled.generate([p], params)[0] for p in prompts[:2]]
    runs += compiled.generate(prompts[:4], params) + compiled.generate(prompts[:7], params)
    runs += compiled.generate(prompts, params)
    monkeypatch.setenv("KVIK_CPU_KERNELS", "0")
    plain = LLM(path, show_progress=False, block_size=4, **engine_args)
    assert plain.engine.core.cpu_kernels is None
    expected = plain.generate(prompts, params)
    by_prompt = {tuple(o.prompt_token_ids): o.outputs[0] for o in expected}
    for output in runs:
        want = by_prompt[tuple(output.prompt_token_ids)]
        assert output.outputs[0].token_ids == want.token_ids
        for got_step, want_step, token in zip(output.outputs[0].logprobs, want.logprobs, want.token_ids):
            assert abs(got_step[token].logprob - want_step[token].logprob) < 1e-3


def test_layers_a_loader_quantized_get_the_kernels(model_dir_factory, float_activations):
    """A loader of pre-quantized checkpoints builds WeightOnlyLinear from its own int4 values, scales
    and zero points (WeightOnlyLinear.from_int4); the entry point gives them the compiled kernels."""
    from kvik.model.quant.reference import quantize_int4

    model, cfg = loaded(model_dir_factory("llama"))
    mlp = model.model.layers[0].mlp
    original = mlp.down_proj
    mlp.down_proj = WeightOnlyLinear.from_int4(quantize_int4(original.weight, 32, zero_point=True))
    report = optimize_for_inference(model, CPU, torch.float32)
    if report.kernels is None:
        pytest.skip("no C++ toolchain")
    assert report.quantized_linears == 1 and mlp.down_proj.kernel_weight() is not None
    x = torch.randn(3, original.in_features)
    with torch.inference_mode():
        assert torch.allclose(mlp.down_proj(x), torch.nn.functional.linear(x, mlp.down_proj.dequantize()),
                              atol=1e-5)


def test_activations_argument_chooses_int8_or_float32_inputs(model_dir_factory):
    """--activations: auto rounds inputs to int8 for --quantization (where the CPU has AVX512-VNNI)
    and not for a checkpoint's own int4 layers; int8 / float32 force either; the precision line says
    which. Elsewhere every choice runs float32."""
    from kvik.model.quant import int8_activations

    assert int8_activations("auto", "int4") and int8_activations("auto", "int8")
    assert not int8_activations("auto", None) and int8_activations("int8", None)
    assert not int8_activations("float32", "int4")
    with pytest.raises(ConfigError, match="activations: 'int16'"):
        EngineArgs(model="m", activations="int16")
    path = str(model_dir_factory("llama"))
    counts = {}
    for activations in ("auto", "float32", "int8"):
        llm = LLM(path, show_progress=False, quantization="int4", quantization_group_size=32, activations=activations)
        core = llm.engine.core
        if core.cpu_kernels is None:
            pytest.skip("no C++ toolchain")
        counts[activations] = core.transforms.int8_activation_linears
        assert ("int8 per 32 inputs" in llm.engine.info.precision) == (counts[activations] > 0)
    assert counts["float32"] == 0
    if "vnni" in core.cpu_kernels.simd_isa():
        assert counts["auto"] == counts["int8"] == 9  # 2 layers x 4 linears + the LM head
    else:
        assert counts["auto"] == counts["int8"] == 0


def test_activations_argument_chooses_bfloat16_or_float32_inputs(model_dir_factory):
    """--dtype bfloat16 on a CPU with AVX512-BF16: auto rounds the inputs of batches of 12+ rows to
    bfloat16 (the kernel's tiles), float32 keeps every input float32, and the precision line says
    which; the two differ only by that rounding (a prompt of 40 tokens: same greedy tokens here,
    logprobs within the rounding's reach). Elsewhere both run float32."""
    path = str(model_dir_factory("llama"))
    prompt = [(7 * i + 3) % 200 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    counts, outputs = {}, {}
    for activations in ("auto", "float32"):
        llm = LLM(path, show_progress=False, dtype="bfloat16", activations=activations)
        core = llm.engine.core
        if core.cpu_kernels is None:
            pytest.skip("no C++ toolchain")
        counts[activations] = core.transforms.bf16_activation_linears
        assert ("bfloat16 into the bfloat16 linear layers" in llm.engine.info.precision) == (counts[activations] > 0)
        outputs[activations] = llm.generate([prompt], params)[0].outputs[0]
    assert counts["float32"] == 0
    probe = WeightOnlyLinear.from_linear(torch.nn.Linear(64, 16), "bfloat16")
    probe.enable_kernels(core.cpu_kernels, bf16_gemm=True)  # as the engine does where the CPU has bfloat16
    tiles = cpu_has_native_bf16() and probe.kernel_weight().bf16_prompt_tiles()
    assert counts["auto"] == (9 if tiles else 0)  # 2 layers x 4 linears + the LM head
    assert outputs["auto"].token_ids == outputs["float32"].token_ids
    for auto, exact, token in zip(outputs["auto"].logprobs, outputs["float32"].logprobs, outputs["auto"].token_ids):
        assert abs(auto[token].logprob - exact[token].logprob) < 0.05


@pytest.mark.parametrize("engine_args", [{"quantization": "int4", "kv_cache_dtype": "bfloat16"}, {}],
                         ids=["int4", "float32"])
def test_decode_team_computes_what_per_kernel_regions_do(model_dir_factory, engine_args):
    """A decode step's kernels on the team held for the step (decode_team.h) and each in its own
    OpenMP region: the same chunks, so the same tokens and the same logprobs, bit for bit; and an
    error inside a step's kernels (a block id past the pool) comes back as an exception, after which
    the team serves the next step."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # the tests' processes run one thread (conftest.py); a team needs two
    try:
        _check_decode_team(model_dir_factory, engine_args)
    finally:
        torch.set_num_threads(previous)


def _check_decode_team(model_dir_factory, engine_args):
    # No prefix caching: a second run of the prompt would prefill only its last token, and its
    # first logprobs would differ in rounding for that reason alone.
    llm = LLM(str(model_dir_factory("llama")), show_progress=False, block_size=4, enable_prefix_caching=False,
              **engine_args)
    kernels = llm.engine.core.cpu_kernels
    if kernels is None:
        pytest.skip("no C++ toolchain")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = {}
    try:
        for team in (True, False):
            kernels.set_decode_team(team)
            runs[team] = llm.generate([PROMPTS[1]], params)[0].outputs[0]
    finally:
        kernels.set_decode_team(True)
    assert runs[True].token_ids == runs[False].token_ids
    assert runs[True].logprobs == runs[False].logprobs

    body = llm.engine.core.model.model
    assert isinstance(body, DecodeStackModel)
    inner = body.inner
    rotary, norm = inner.rotary[0], inner.norm
    ids, positions, slots = torch.tensor([5]), torch.tensor([3]), torch.tensor([3])
    with pytest.raises(RuntimeError, match="block id out of range"):
        body.decode_stack.forward_tokens(ids, positions, inner.embed_tokens.weight, rotary.cos, rotary.sin,
                                         norm.weight, norm.eps, slots, torch.tensor([[10**9]]), torch.tensor([4]))
    assert llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids == runs[True].token_ids
