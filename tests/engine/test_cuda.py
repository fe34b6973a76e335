"""The CUDA path: device and dtype chosen by themselves, greedy parity with HF on the GPU, decode
steps replayed as CUDA graphs with the eager engine's tokens, speculative decoding on the GPU.
Skipped on machines without a CUDA device (CI); run on a GPU host with `pytest -m gpu`. The padding
that graphs rely on is tested without a GPU in tests/engine/test_decode_graphs.py."""

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
    graphs = llm.engine.core.runner.graphs
    assert graphs is not None and graphs.graphs and graphs.replays > 0  # the decode steps replayed


STAGGERED = [[5, 9, 13, 2, 7], [100, 3, 3, 41, 8, 9, 10, 11], [7] * 23, [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2],
             list(range(40, 77))]


def _tokens(model, prompts, params, **engine_args):
    llm = LLM(str(model), show_progress=False, device="cuda", kv_cache_memory=2**28, **engine_args)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm.engine.core


@pytest.mark.parametrize("engine_args", [{"dtype": "float32"},
                                         {"dtype": "float32", "kv_cache_dtype": "int8"},
                                         {"dtype": "float32", "kv_cache_dtype": "fp8"},
                                         {"dtype": "float32", "quantization": "int4"},
                                         {"dtype": "float32", "speculative_method": "ngram"},
                                         {"dtype": "float32", "speculative_method": "draft",
                                          "speculative_quantization": "int8"},
                                         {"dtype": "bfloat16"}])
def test_cuda_graph_decode_steps_give_the_eager_tokens(tiny_llama, engine_args):
    # Sequences end at different steps: 5 rows (a graph of 8), then 4, 2 and 1, each shape
    # recorded once and replayed; block tables widen as sequences grow.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 40, 9, 14, 6)]
    eager, _ = _tokens(tiny_llama, STAGGERED, params, enforce_eager=True, **engine_args)
    replayed, core = _tokens(tiny_llama, STAGGERED, params, **engine_args)
    assert replayed == eager
    graphs = core.runner.graphs
    assert graphs.replays > 0
    if "speculative_method" not in engine_args:
        assert {rows for rows, _ in graphs.graphs} == {8, 4, 2, 1}
    elif engine_args["speculative_method"] == "draft":
        assert core.spec.proposer.runner.graphs.replays > 0


def test_speculative_decoding_on_gpu_keeps_the_greedy_output(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain, _ = _tokens(tiny_llama, STAGGERED, params, dtype="float32")
    for args in ({"speculative_method": "ngram"},
                 {"speculative_method": "draft", "speculative_quantization": "int8"}):
        speculated, core = _tokens(tiny_llama, STAGGERED, params, dtype="float32", speculative_adaptive=False,
                                   **args)
        assert speculated == plain, args
        assert core.spec.stats.num_drafts > 0


def test_seeded_sampling_on_gpu_ignores_batch(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False, device="cuda")
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The moon"], params)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(["a", "The moon", "b c d"], [noise, params, noise])
    assert batch[1].outputs[0].token_ids == alone
