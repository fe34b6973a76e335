"""AsyncLLM: streamed deltas add up to the offline result; abort frees blocks at once; a bad
request fails alone; the core runs in a thread or in its own process alike."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvik import LLM, SamplingParams
from kvik.core.config import EngineArgs
from kvik.core.sampling_params import OutputKind
from kvik.engine.async_llm import AsyncLLM, GenerationError
from kvik.engine.messages import EngineCoreRequest
from kvik.engine.preprocess_pool import PreprocessConfig


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request, tiny_llama):
    async def start():
        llm = AsyncLLM(EngineArgs(model=str(tiny_llama), show_progress=False),
                       engine_in_thread=request.param == "thread", preprocess=PreprocessConfig(workers=0))
        await llm.start()
        return llm

    loop = asyncio.new_event_loop()
    llm = loop.run_until_complete(start())
    llm.loop = loop
    yield llm
    loop.run_until_complete(llm.shutdown())
    loop.close()


def core_request(engine, request_id, prompt, params):
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    return engine.input_processor.make_request(request_id, ids, params, time.time())


async def collect(engine, request_id, prompt, params):
    pieces, tokens, final = [], [], None
    async for output in engine.generate(core_request(engine, request_id, prompt, params)):
        pieces.append(output.outputs[0].text)
        tokens += output.outputs[0].token_ids
        final = output
    return "".join(pieces), tokens, final


def test_concurrent_streams_match_offline(engine, tiny_llama):
    prompts = ["Hello", "The capital of France is", "Once upon a time", "12345"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, output_kind=OutputKind.DELTA)

    async def main():
        return await asyncio.gather(*(collect(engine, f"s{i}", p, params) for i, p in enumerate(prompts)))

    results = engine.loop.run_until_complete(main())
    offline = LLM(str(tiny_llama), show_progress=False).generate(prompts, params.clone(output_kind=OutputKind.CUMULATIVE))
    for (text, tokens, final), reference in zip(results, offline):
        assert tokens == reference.outputs[0].token_ids
        assert text == reference.outputs[0].text
        assert final.finished and final.outputs[0].finish_reason == "length"


def test_a_consumer_that_falls_behind_gets_the_backlog_merged(engine, tiny_llama):
    """A slow reader gets fewer outputs carrying several tokens each, not a backlog of one-token
    ones; together they are exactly the stream a fast reader gets (text, ids, logprobs, finish)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, output_kind=OutputKind.DELTA)

    async def main():
        outputs = []
        async for output in engine.generate(core_request(engine, "slow", "Once upon a time", params)):
            outputs.append(output)
            await asyncio.sleep(0.05)  # several engine steps while this reader sleeps
        return outputs

    outputs = engine.loop.run_until_complete(main())
    reference = LLM(str(tiny_llama), show_progress=False).generate(
        ["Once upon a time"], params.clone(output_kind=OutputKind.CUMULATIVE))[0].outputs[0]
    assert len(outputs) < 24 and max(len(o.outputs[0].token_ids) for o in outputs) > 1
    assert [t for o in outputs for t in o.outputs[0].token_ids] == reference.token_ids
    assert "".join(o.outputs[0].text for o in outputs) == reference.text
    logprobs = [step for o in outputs for step in o.outputs[0].logprobs]
    assert [sorted(step) for step in logprobs] == [sorted(step) for step in reference.logprobs]
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[-1].outputs[0].finish_reason == "length"


def test_stop_string_ends_the_sequence_in_the_core_too(engine):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind=OutputKind.DELTA)

    async def main():
        text, _, _ = await collect(engine, "probe", "Hello", params)
        stop = text[10:13]
        cut, tokens, final = await collect(engine, "stopped", "Hello", params.clone(stop=[stop]))
        for _ in range(100):
            if engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.02)
        return text, stop, cut, final, engine.stats()

    text, stop, cut, final, stats = engine.loop.run_until_complete(main())
    assert cut == text[:text.index(stop)]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_consumer_that_stops_early_aborts_and_frees_blocks(engine):
    params = SamplingParams(max_tokens=500, ignore_eos=True, output_kind=OutputKind.DELTA)

    async def main():
        stream = engine.generate(core_request(engine, "leaving", "Tell me a long story", params))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):  # the core applies the abort before its next step
            stats = engine.stats()
            if stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks:
                return stats
            await asyncio.sleep(0.02)
        return engine.stats()

    stats = engine.loop.run_until_complete(main())
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_request_the_core_refuses_fails_alone(engine):
    async def main():
        bad = EngineCoreRequest("bad", [10**9], SamplingParams(), 4, time.time())  # skipped validation
        with pytest.raises(GenerationError, match="outside the vocabulary"):
            async for _ in engine.generate(bad):
                pass
        return await collect(engine, "good", "Hello", SamplingParams(max_tokens=3, ignore_eos=True))

    text, tokens, final = engine.loop.run_until_complete(main())
    assert final.finished and len(final.outputs[0].token_ids) == 3
