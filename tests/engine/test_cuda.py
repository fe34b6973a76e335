"""The CUDA path: device and dtype chosen by themselves, greedy parity with HF on the GPU.
Skipped on machines without a CUDA device (CI); run on a GPU host with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from kvik import LLM, SamplingParams
from tests.conftest import ARCHS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["Hello", "The capital of France is", "Once upon a time there was a small village by the sea"]


def test_auto_picks_cuda_and_half_precision(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False)
    assert llm.engine.core.device.type == "cuda"
    assert llm.engine.core.dtype in (torch.bfloat16, torch.float16)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_greedy_parity_on_gpu(arch, model_dir_factory):
    import transformers

    path = model_dir_factory(arch)
    llm = LLM(str(path), show_progress=False, dtype="float32", device="cuda", block_size=4,
              max_num_batched_tokens=9)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for output in outputs:
        ids = torch.tensor([output.prompt_token_ids], device="cuda")
        ref = hf.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
        assert output.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()


def test_seeded_sampling_on_gpu_ignores_batch(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False, device="cuda")
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The moon"], params)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(["a", "The moon", "b c d"], [noise, params, noise])
    assert batch[1].outputs[0].token_ids == alone
