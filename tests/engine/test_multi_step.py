"""Multi-step decoding (`num_scheduler_steps`): runs of forwards between scheduler passes give the
same tokens as single steps, stop where a single step would, and happen only where they may."""

from __future__ import annotations

import pytest

from kvik import LLM, SamplingParams
from kvik.core.config import EngineArgs
from kvik.core.errors import ConfigError
from kvik.core.sampling_params import StructuredOutputs
from kvik.engine import multi_step as multi_step_module
from kvik.engine.kv_manager import KVCacheManager
from kvik.engine.scheduler import Scheduler
from tests.engine.helpers import make_request


def decoding(scheduler: Scheduler, *requests) -> None:
    """Admit the requests and compute their prompts, so the next step decodes each."""
    for request in requests:
        scheduler.add(request)
    for chunk in scheduler.schedule().chunks:
        chunk.request.num_computed_tokens = chunk.end
        chunk.request.all_token_ids.append(7)


def fast_scheduler(blocks: int = 64, steps: int = 8) -> Scheduler:
    scheduler = Scheduler(KVCacheManager(blocks, 4), max_num_seqs=8, max_num_batched_tokens=64,
                          num_scheduler_steps=steps)
    scheduler.observe_step(0.001, 1)  # 1 ms a forward: the time cap allows 25
    return scheduler


def test_a_run_is_capped_by_max_tokens_and_gets_its_blocks_up_front():
    scheduler = fast_scheduler()
    short = make_request([1, 2, 3], SamplingParams(max_tokens=6))
    long = make_request([4, 5, 6, 7, 8], SamplingParams(max_tokens=100))
    decoding(scheduler, short, long)
    out = scheduler.schedule()
    # short has produced 1 of its 6 tokens: 5 more, so a run of 5 forwards.
    assert out.num_steps == 5 and [c.num_new_tokens for c in out.chunks] == [1, 1]
    for chunk in out.chunks:  # blocks for positions start .. start + 4
        assert len(chunk.block_ids) * 4 >= chunk.start + out.num_steps


def test_no_run_while_someone_waits_or_for_a_sequence_whose_sampling_reads_its_outputs():
    scheduler = fast_scheduler()
    decoding(scheduler, make_request([1, 2, 3]))
    scheduler.max_num_seqs = 1
    scheduler.add(make_request([4, 5]))  # waits for the running one's batch slot
    assert scheduler.schedule().num_steps == 1

    for params in (SamplingParams(repetition_penalty=1.2), SamplingParams(min_tokens=4),
                   SamplingParams(presence_penalty=0.5)):
        scheduler = fast_scheduler()
        decoding(scheduler, make_request([1, 2, 3]), make_request([4, 5], params))
        assert scheduler.schedule().num_steps == 1, params


def test_no_run_when_its_blocks_are_short_and_nobody_is_preempted_for_one():
    scheduler = fast_scheduler(blocks=3)  # 4 tokens a block
    a, b = make_request([1, 2, 3]), make_request([4, 5, 6])
    decoding(scheduler, a, b)  # one block each, a third free
    out = scheduler.schedule()
    assert out.num_steps == 1 and not out.preempted
    assert [c.request for c in out.chunks] == [a, b]


def test_slow_steps_get_no_runs():
    scheduler = fast_scheduler()
    decoding(scheduler, make_request([1, 2, 3]))
    scheduler.observe_step(0.030, 1)  # a forward takes longer than a run may
    assert scheduler.schedule().num_steps == 1
    scheduler.observe_step(0.010 * 4, 4)  # 10 ms a forward: 2 fit in 25 ms
    assert scheduler.schedule().num_steps == 2


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """The same model with single steps and with runs of up to 8 forwards."""
    return {steps: LLM(str(tiny_llama), show_progress=False, num_scheduler_steps=steps, seed=5)
            for steps in (1, 8)}


@pytest.fixture
def no_time_cap(monkeypatch):
    """Runs as long as num_scheduler_steps allows, however slow this machine is."""
    monkeypatch.setattr(multi_step_module, "MULTI_STEP_SECONDS", 1e9)


def forwards_counted(llm: LLM) -> list[int]:
    """Counts the forwards that continue a run (ModelRunner.decode_next) in a one-item list."""
    runner = llm.engine.core.runner
    count = [0]
    original = runner.decode_next

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    runner.decode_next = counted
    return count


def test_runs_give_the_tokens_and_logprobs_of_single_steps(engines, no_time_cap):
    prompts = ["The weather today", "Once upon a time", "12345 678", "Hello"]
    params = [SamplingParams(temperature=0, max_tokens=29, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=23, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias={5: 3.0}),
              SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=17, ignore_eos=True, logprobs=1)]
    count = forwards_counted(engines[8])
    single = engines[1].generate(prompts, params)
    runs = engines[8].generate(prompts, params)
    assert count[0] > 20  # most tokens came from runs
    for one, many in zip(single, runs):
        a, b = one.outputs[0], many.outputs[0]
        assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
        if a.logprobs is not None:
            assert [sorted(x) for x in b.logprobs] == [sorted(x) for x in a.logprobs]
            for x, y in zip(a.logprobs, b.logprobs):
                assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5) for t in x)


def test_a_run_stops_where_a_single_step_would(engines, no_time_cap):
    free = engines[1].generate(["The weather today"], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop_token = free.token_ids[9]
    first = free.token_ids.index(stop_token)
    stop_text = free.text[12:15]
    for llm in engines.values():
        out = llm.generate(["The weather today"], SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_token]))[0].outputs[0]
        assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"
        out = llm.generate(["The weather today"], SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, stop=[stop_text]))[0].outputs[0]
        assert out.text == free.text[:free.text.index(stop_text)] and out.stop_reason == stop_text
    # The run ended with the stop token: the next request starts from a consistent cache.
    again = engines[8].generate(["The weather today"], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    assert again.token_ids == free.token_ids


def test_greedy_runs_in_one_compiled_call_give_the_tokens_of_single_steps(engines, no_time_cap):
    """Runs of plain greedy rows go to the decode stack's greedy_steps (forwards, LM head and argmax
    in C++): the tokens of single steps, rows that stop early or at once included, and no more
    forwards than a run in Python makes."""
    llm = engines[8]
    runner = llm.engine.core.runner
    fused: list[list[list[int]]] = []
    original = runner.greedy_steps

    def recorded(*args, **kwargs):
        steps = original(*args, **kwargs)
        if steps is not None:
            fused.append(steps)
        return steps

    runner.greedy_steps = recorded
    prompts = ["The weather today", "Once upon a time", "12345 678", "Hello", "A", "Two words"]
    free = engines[1].generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    first = free[0].outputs[0].token_ids
    assert first.index(first[9]) > 1  # a stop inside a run, not on the first token
    # Row 0 stops at its 10th token's first appearance (inside a run), row 1 on its first token.
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[first[9]]),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[free[1].outputs[0].token_ids[0]]),
              *(SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 17, 5, 23))]
    try:
        single = engines[1].generate(prompts, params)
        runs = llm.generate(prompts, params)
    finally:
        runner.greedy_steps = original
    if runner._greedy_head is None or runner._greedy_head[1] is None:
        pytest.skip("no compiled decode stack here: runs take the Python path, tested above")
    assert fused and sum(len(steps) for steps in fused) > 20, fused
    for one, many in zip(single, runs):
        a, b = one.outputs[0], many.outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert runs[0].outputs[0].token_ids == first[:first.index(first[9]) + 1]
    assert len(runs[1].outputs[0].token_ids) == 1
    # Alone, a row that stops inside a run ends the run there: no forward past its stop token.
    fused.clear()
    runner.greedy_steps = recorded
    try:
        alone = llm.generate(prompts[:1], params[:1])[0].outputs[0]
    finally:
        runner.greedy_steps = original
    assert alone.token_ids == runs[0].outputs[0].token_ids
    assert fused and fused[-1][-1] == [first[9]], fused
    # Its inputs are checked: a block table that does not cover the run is an error, not a stray read.
    import torch

    body, head = runner.model.model, runner._greedy_head[1]
    one = torch.tensor([5])
    with pytest.raises(RuntimeError, match="does not cover the run"):
        body.greedy_steps(head, one, torch.tensor([15]), torch.tensor([[0]]), runner.block_size, 4,
                          torch.tensor([[-1]]), torch.tensor([True]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_runs_read_the_heads_int8_copy_and_give_the_tokens_of_single_steps(tiny_llama, no_time_cap, dtype):
    # The compiled runs pick each token from the head's int8 copy and the rows it cannot rule out
    # (kvik.model.transforms.screened_head); single steps take the full product.
    single, runs = (LLM(str(tiny_llama), show_progress=False, dtype=dtype, num_scheduler_steps=steps, seed=5)
                    for steps in (1, 8))
    prompts = ["The weather today", "Once upon a time", "12345 678", "Hello", "A", "Two words", "x y z"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 33, 17, 5, 40, 23, 40)]
    expected = single.generate(prompts, params)
    got = runs.generate(prompts, params)
    runner = runs.engine.core.runner
    if runner._greedy_head is None or runner._greedy_head[1] is None:
        pytest.skip("no compiled decode stack here: runs take the Python path")
    lm_head = runs.engine.core.model.lm_head
    if dtype == "bfloat16" or getattr(lm_head, "gemv_spec", lambda: None)() is not None:
        assert runner._greedy_head[1].screen is not None  # the copy was made and used
    for one, many in zip(expected, got):
        assert many.outputs[0].token_ids == one.outputs[0].token_ids


def test_a_structured_request_in_the_batch_keeps_every_step_single(engines, no_time_cap):
    llm = engines[8]
    count = forwards_counted(llm)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    outs = llm.generate(["Hello", "The weather today"], [
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputs(json=schema)),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)])
    assert outs[1].outputs[0].token_ids == engines[1].generate(["The weather today"], SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids
    # While the constrained request ran, nothing was run ahead; after it ended the other may have.
    assert count[0] <= 20 - len(outs[0].outputs[0].token_ids)


def test_config_refuses_runs_with_speculation_or_lora_and_out_of_range_counts(tiny_llama):
    for bad in (0, 65):
        with pytest.raises(ConfigError, match="num_scheduler_steps"):
            EngineArgs(model=str(tiny_llama), num_scheduler_steps=bad)
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        EngineArgs(model=str(tiny_llama), num_scheduler_steps=4, speculative_method="ngram")
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        EngineArgs(model=str(tiny_llama), num_scheduler_steps=4, enable_lora=True)
    assert EngineArgs(model=str(tiny_llama), num_scheduler_steps=1, speculative_method="ngram").scheduler_steps() == 1
    assert EngineArgs(model=str(tiny_llama), speculative_method="ngram").scheduler_steps() == 1
    assert EngineArgs(model=str(tiny_llama)).scheduler_steps() == 8
