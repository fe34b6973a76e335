"""Quantized weights and narrow KV caches on CUDA: plain PyTorch ops (no compiled kernels), the same
numbers as the CPU's PyTorch path. Skipped without a CUDA device; run on a GPU host with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from kvik import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("engine_args", [{"quantization": "int8"}, {"quantization": "int4"},
                                         {"quantization": "int4", "kv_cache_dtype": "int8"}])
def test_quantized_greedy_matches_the_cpu_pytorch_path(tiny_llama, monkeypatch, engine_args):
    prompts = [[5, 9, 13, 2, 7], [100, 3, 3, 41, 8, 9, 10, 11], [7] * 23]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    gpu = LLM(str(tiny_llama), show_progress=False, device="cuda", dtype="float32", **engine_args)
    monkeypatch.setenv("KVIK_CPU_KERNELS", "0")
    cpu = LLM(str(tiny_llama), show_progress=False, device="cpu", **engine_args)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    bf16 = LLM(str(tiny_llama), show_progress=False, device="cuda", **engine_args)
    assert all(len(o.outputs[0].token_ids) == 8 for o in bf16.generate(prompts, params))


def test_a_gptq_checkpoint_served_as_int4_on_cuda_matches_the_cpu_pytorch_path(tiny_llama, tmp_path, monkeypatch):
    """The loader builds the checkpoint's int4 layers on the GPU (float weights never allocated there)."""
    from tests.model.gptq_files import quantized_copy

    quantized_copy(tiny_llama, tmp_path / "q", "gptq", seed=5)
    prompts = [[5, 9, 13, 2, 7], [100, 3, 3, 41, 8, 9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    args = {"quantization": "int4", "dtype": "float32"}  # int4: keep the checkpoint's own layers
    gpu = LLM(str(tmp_path / "q"), show_progress=False, device="cuda", **args)
    assert gpu.engine.info.precision.startswith("weights int4 from the checkpoint (GPTQ")
    monkeypatch.setenv("KVIK_CPU_KERNELS", "0")
    cpu = LLM(str(tmp_path / "q"), show_progress=False, device="cpu", **args)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
