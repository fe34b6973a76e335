"""ModelRunner's plain-decode step (every chunk one token that then samples) against its general
path: the same tokens and logprobs, and the steps it must leave to the general path."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kvik import LLM, SamplingParams  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7, 3], [8, 1, 2], [11] * 20, [3, 4, 5, 6, 7, 8, 9, 10, 12]]


def generate(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[tuple[list[int], list]]:
    outputs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def counting(runner) -> list[bool]:
    """Record, step by step, whether the plain path took the step."""
    taken: list[bool] = []
    plain = runner._plain_decode

    def spy(chunks):
        result = plain(chunks)
        taken.append(result is not None)
        return result

    runner._plain_decode = spy
    return taken


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    # block_size 4: tables of several blocks, padded to different widths within a batch. No prefix
    # cache: a repeated prompt would then be computed by other kernels (its tail as decode rows),
    # whose float rounding differs from a full prefill's. Single steps: every decode step is one
    # execute (runs of forwards are tested in test_multi_step.py).
    return LLM(str(tiny_llama), show_progress=False, block_size=4, seed=0, enable_prefix_caching=False,
               num_scheduler_steps=1)


def test_plain_decode_steps_equal_the_general_path(llm, monkeypatch) -> None:
    runner = llm.engine.core.runner
    cases = [SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)]
    for params in cases:
        taken = counting(runner)
        fast = generate(llm, params)
        assert sum(taken) >= params.max_tokens - 1  # every decode step of the batch
        monkeypatch.setattr(runner, "_plain_decode", lambda chunks: None)
        assert generate(llm, params) == fast
        monkeypatch.undo()
        # one sequence alone, as single-stream decoding runs
        taken = counting(runner)
        fast = generate(llm, params, PROMPTS[:1])
        assert all(taken[1:]) and len(taken) == params.max_tokens
        monkeypatch.setattr(runner, "_plain_decode", lambda chunks: None)
        assert generate(llm, params, PROMPTS[:1]) == fast
        monkeypatch.undo()


def test_steps_the_plain_path_leaves_to_the_general_one(llm, monkeypatch) -> None:
    runner = llm.engine.core.runner
    taken = counting(runner)
    # Prompt logprobs: every step of that request goes the general way.
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1))[0]
    assert len(out.prompt_logprobs) == len(PROMPTS[0]) and not any(taken)
    taken.clear()
    # A prompt (several tokens) is never a plain decode, nor is a step that mixes one in.
    llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=1))
    assert taken == [False]


def test_two_threads_decode_what_one_does(llm) -> None:
    """The suite runs on one thread (tests/conftest.py); a server splits every kernel of the
    decode stack over its cores. Same tokens, same logprobs to float rounding."""
    import torch

    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    single = generate(llm, params)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        double = generate(llm, params)
    finally:
        torch.set_num_threads(threads)
    for (tokens_one, logprobs_one), (tokens_two, logprobs_two) in zip(single, double):
        assert tokens_one == tokens_two
        for one, two in zip(logprobs_one, logprobs_two):
            assert one.keys() == two.keys()
            assert all(abs(one[t].logprob - two[t].logprob) < 1e-4 for t in one)
