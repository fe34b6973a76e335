"""Decode steps through static, padded buffers (kvik.engine.cuda_graphs), on the CPU.

A CUDA graph replays what ran through the static buffers when it was recorded; everything but the
recording itself (padding rows and block-table columns, the spare block the padding writes to,
buffers reused by a smaller step after a larger one) runs here without capture and must give the
eager engine's tokens. Capture and replay on a GPU are tested in tests/engine/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from kvik import LLM, SamplingParams
from kvik.core.config import EngineArgs
from kvik.core.errors import ConfigError
from kvik.engine import cuda_graphs
from kvik.engine.cuda_graphs import DecodeGraphs, GraphSettings, decode_graph_settings

PROMPTS = [[5, 9, 13, 2, 7], [100, 3, 3, 41, 8, 9, 10, 11], [7] * 23, [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2],
           list(range(40, 77))]


@pytest.fixture
def padded_decodes(monkeypatch):
    """Engines built in this test run their decode-only steps through DecodeGraphs without capture."""
    def settings(device, *, enforce_eager, max_model_len, max_rows):
        if enforce_eager:
            return None
        return GraphSettings(max_rows=max_rows, max_model_len=max_model_len, capture=False)

    monkeypatch.setattr(cuda_graphs, "decode_graph_settings", settings)


def _generate(model, prompts, params, **engine_args):
    llm = LLM(str(model), show_progress=False, kv_cache_memory=2**24, **engine_args)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return tokens, llm.engine.core


@pytest.mark.parametrize("engine_args", [{}, {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8"}, {"dtype": "bfloat16"},
                                         {"speculative_method": "ngram"}])
def test_padded_decode_steps_give_the_eager_tokens(tiny_llama, padded_decodes, engine_args):
    # Different lengths: sequences finish at different steps, so the batch shrinks from 5 rows
    # (padded to 8) to 4, 2 and 1, reusing buffers a larger step filled.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 20, 9, 14, 6)]
    eager, eager_core = _generate(tiny_llama, PROMPTS, params, enforce_eager=True, **engine_args)
    padded, core = _generate(tiny_llama, PROMPTS, params, **engine_args)
    assert eager_core.runner.graphs is None
    assert core.runner.graphs is not None and core.runner.graphs.replays > 0
    assert padded == eager


def test_a_seeded_sample_is_the_same_padded_or_not(tiny_llama, padded_decodes):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    eager, _ = _generate(tiny_llama, PROMPTS[:3], params, enforce_eager=True)
    padded, _ = _generate(tiny_llama, PROMPTS[:3], params)
    assert padded == eager


def test_a_quantized_self_draft_replays_its_own_decode_steps(tiny_llama, padded_decodes):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    args = {"speculative_method": "draft", "speculative_quantization": "int8"}
    eager, _ = _generate(tiny_llama, PROMPTS[:3], params, enforce_eager=True, **args)
    padded, core = _generate(tiny_llama, PROMPTS[:3], params, **args)
    assert padded == eager
    assert core.spec.proposer.runner.graphs.replays > 0


def test_padding_rows_write_only_the_spare_block(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False, kv_cache_memory=2**22, enforce_eager=True)
    runner = llm.engine.core.runner
    cache = runner.kv_cache
    num_blocks, block_size = cache.data.shape[3], cache.data.shape[4]
    # A spare block past the pool's, as ModelRunner allocates when graphs are on.
    spare = torch.zeros_like(cache.data[:, :, :, :1])
    cache.data = torch.cat([cache.data, spare], dim=3)
    from kvik.model.transforms import bind_kv_cache

    bind_kv_cache(llm.engine.core.model, cache)
    graphs = DecodeGraphs(llm.engine.core.model, GraphSettings(max_rows=8, max_model_len=64, capture=False),
                          block_size=block_size, pad_slot=num_blocks * block_size, device=torch.device("cpu"))
    before = cache.data.clone()
    # Three real rows (padded to 4): blocks 2, 5 and 6, at positions 0, 17 and 3.
    tables = torch.tensor([[2, 0], [1, 5], [6, 0]])
    positions = torch.tensor([0, 17, 3])
    slots = torch.tensor([2 * block_size, 5 * block_size + 1, 6 * block_size + 3])
    with torch.inference_mode():
        hidden = graphs.run(torch.tensor([4, 5, 6]), positions, slots, tables, positions + 1)
    assert hidden.shape[0] == 3 and graphs.shape_for(3, 2) == (4, 2)
    changed = (cache.data != before).flatten(0, 2).any(dim=0).any(dim=-1)  # (blocks, block_size)
    written = {(int(b), int(o)) for b, o in changed.nonzero()}
    assert written == {(2, 0), (5, 1), (6, 3), (num_blocks, 0)}


def test_step_shapes_round_up_to_captured_sizes():
    settings = GraphSettings(max_rows=40, max_model_len=100, capture=False)
    graphs = DecodeGraphs(torch.nn.Identity(), settings, block_size=16, pad_slot=0, device=torch.device("cpu"))
    assert graphs.batch_sizes == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graphs.widths == [1, 2, 4, 7]  # 100 tokens need 7 blocks of 16
    assert graphs.shape_for(1, 1) == (1, 1)
    assert graphs.shape_for(17, 3) == (24, 4)
    assert graphs.shape_for(40, 7) == (40, 7)
    assert graphs.shape_for(41, 1) is None and graphs.shape_for(3, 8) is None


def test_graphs_only_on_cuda_and_not_when_eager():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decode_graph_settings(cpu, enforce_eager=False, max_model_len=64, max_rows=8) is None
    assert decode_graph_settings(cuda, enforce_eager=True, max_model_len=64, max_rows=8) is None
    assert decode_graph_settings(cuda, enforce_eager=False, max_model_len=64, max_rows=8000) == \
        GraphSettings(max_rows=512, max_model_len=64)
    with pytest.raises(ValueError, match="max_rows"):
        GraphSettings(max_rows=513, max_model_len=64)
    with pytest.raises(ConfigError, match="enforce_eager"):
        EngineArgs(model="m", enforce_eager="yes")
