"""Token-exact greedy parity with HF transformers for every architecture, batched, with chunked
prefill, prefix-cache hits and preemption; prompt and sample logprobs within 1e-4."""

from __future__ import annotations

import pytest
import torch

from kvik import LLM, SamplingParams
from tests.conftest import ARCHS
from tests.reference import hf_greedy, hf_prompt_logprobs

MAX_NEW = 12
PROMPTS = [
    "Hello",
    "The capital of France is",
    "Once upon a time there was a small village by the sea, where the bakers rose before the sun",
    "a b c d e f g",
    "Throughput counts how many tokens are produced each second; latency counts how long one person "
    "waits. The engineer measured the latency of every request and plotted the results.",
    "12345",
    "Spring follows winter, summer follows spring",
    "What is the weather today? The weather today is sunny with a light breeze from the west;",
    "def add(a, b): return a + b",
]
SHARED_PREFIX = ("You are a helpful assistant. Answer briefly and precisely, and never make things up. "
                 "Users send messages to the assistant, the assistant answers. ")


def token_prompts(llm: LLM, texts: list[str]) -> list[list[int]]:
    return [llm.engine.tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, model_dir_factory):
    """(arch, path, prompt ids, HF greedy tokens and step logprobs per prompt)."""
    path = model_dir_factory(request.param)
    llm = LLM(str(path), show_progress=False)
    prompts = token_prompts(llm, PROMPTS + [SHARED_PREFIX + "What is rain?",
                                            SHARED_PREFIX + "How do I make tea?"])
    reference = [hf_greedy(path, ids, MAX_NEW) for ids in prompts]
    return request.param, path, llm, prompts, reference


def greedy(max_tokens: int = MAX_NEW, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def assert_matches(outputs, reference, check_logprobs: bool = False) -> None:
    for index, (output, (ref_tokens, ref_logprobs)) in enumerate(zip(outputs, reference)):
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt {index}"
        if check_logprobs:
            for step, (entry, ref) in enumerate(zip(completion.logprobs, ref_logprobs)):
                token = completion.token_ids[step]
                assert abs(entry[token].logprob - ref[token].item()) < 1e-4
                # The top alternatives are HF's top tokens with HF's values.
                top = torch.topk(ref, 3)
                for value, alt in zip(top.values.tolist(), top.indices.tolist()):
                    assert abs(entry[alt].logprob - value) < 1e-4


def test_batched_greedy_matches_hf(arch_case):
    _, _, llm, prompts, reference = arch_case
    outputs = llm.generate(prompts, greedy(logprobs=3))
    assert_matches(outputs, reference, check_logprobs=True)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_small_batches_match_hf(arch_case):
    """Steps of 1-4 decodes take the small-batch path: the GEMV on packed weights and, for the
    Llama family without q/k norm, the compiled stack of all layers in one call."""
    arch, _, llm, prompts, reference = arch_case
    if llm.engine.core.cpu_kernels is not None and arch in ("llama", "qwen2", "mistral"):
        assert llm.engine.core.model.model.decode_stack is not None
    for group in ([0], [2, 4, 6], [1, 3, 5, 7]):
        outputs = llm.generate([prompts[i] for i in group], greedy(logprobs=3))
        assert_matches(outputs, [reference[i] for i in group], check_logprobs=True)


def test_plain_pytorch_path_matches_hf(arch_case, monkeypatch):
    """The same batch without oneDNN packing and compiled kernels (KVIK_CPU_KERNELS=0)."""
    _, path, _, prompts, reference = arch_case
    monkeypatch.setenv("KVIK_CPU_KERNELS", "0")
    llm = LLM(str(path), show_progress=False)
    assert llm.engine.core.cpu_kernels is None
    assert_matches(llm.generate(prompts, greedy()), reference)


def test_chunked_prefill_matches_hf(arch_case):
    _, path, _, prompts, reference = arch_case
    # A 7-token budget splits every longer prompt across several steps, mixed with decodes.
    llm = LLM(str(path), show_progress=False, max_num_batched_tokens=7, block_size=4)
    outputs = llm.generate(prompts, greedy())
    assert_matches(outputs, reference)


def test_small_continuation_chunks_match_hf(arch_case):
    """A 3-token budget cuts every prompt into pieces of at most 3 tokens after the first: those
    run as decode rows (one per token, through the paged KV; ModelRunner._as_decode_rows), batched
    with the other sequences' decodes, prompt logprobs included."""
    _, path, _, prompts, reference = arch_case
    llm = LLM(str(path), show_progress=False, max_num_batched_tokens=3, block_size=4)
    runner = llm.engine.core.runner
    assert runner.has_kv_cache
    outputs = llm.generate(prompts, greedy(logprobs=3))
    assert_matches(outputs, reference, check_logprobs=True)
    ids = prompts[0]
    output = llm.generate([ids], greedy(max_tokens=1, prompt_logprobs=1))[0]
    expected = hf_prompt_logprobs(path, ids)
    for position in range(1, len(ids)):
        assert abs(output.prompt_logprobs[position][ids[position]].logprob
                   - expected[position - 1, ids[position]].item()) < 1e-4


def test_prefix_cache_hits_match_hf(arch_case):
    _, path, _, prompts, reference = arch_case
    llm = LLM(str(path), show_progress=False, block_size=4)
    llm.generate(prompts[-2:], greedy())  # warms the cache with the shared prefix
    before = llm.engine.core.kv.prefix_cache_hits
    outputs = llm.generate(prompts, greedy())
    assert llm.engine.core.kv.prefix_cache_hits - before >= len(prompts[-1]) // 4 * 4 - 4
    assert_matches(outputs, reference)
    assert outputs[-1].num_cached_tokens > 0


def test_preemption_matches_hf(arch_case):
    _, path, _, prompts, reference = arch_case
    # 10 blocks of 4 tokens: one 40-token sequence fits, the batch does not; sequences are
    # preempted and recomputed, and not one token may change.
    llm = LLM(str(path), show_progress=False, block_size=4, max_model_len=40,
              kv_cache_memory=10 * _block_bytes(path, 4))
    short = [(p, r) for p, r in zip(prompts, reference) if len(p) + MAX_NEW <= 40]
    outputs = llm.generate([p for p, _ in short], greedy())
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_matches(outputs, [r for _, r in short])
    llm.engine.core.kv.pool.check_invariants()


def test_prompt_logprobs_match_hf(arch_case):
    _, path, llm, prompts, _ = arch_case
    outputs = llm.generate(prompts[:4], greedy(max_tokens=1, prompt_logprobs=2))
    for ids, output in zip(prompts[:4], outputs):
        assert len(output.prompt_logprobs) == len(ids)
        assert output.prompt_logprobs[0] is None
        reference = hf_prompt_logprobs(path, ids)
        for position in range(1, len(ids)):
            entry = output.prompt_logprobs[position]
            token = ids[position]
            assert abs(entry[token].logprob - reference[position - 1, token].item()) < 1e-4
            assert entry[token].rank == int((reference[position - 1] > reference[position - 1, token]).sum()) + 1


def _block_bytes(path, block_size: int) -> int:
    from kvik.model.loader import load_model_config

    cfg = load_model_config(path)
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * 4
