"""AsyncEngine: streamed deltas add up to the offline result; abort frees blocks at once; a bad
request fails alone."""

from __future__ import annotations

import asyncio

import pytest

from kvik import SamplingParams
from kvik.core.config import EngineArgs
from kvik.core.errors import InvalidRequestError
from kvik.core.sampling_params import OutputKind
from kvik.engine.async_engine import AsyncEngine
from kvik.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = AsyncEngine(LLMEngine(EngineArgs(model=str(tiny_llama), show_progress=False)))
    engine.start()
    yield engine
    engine.shutdown()


def collect(engine, request_id, prompt, params):
    async def run():
        pieces, tokens, final = [], [], None
        async for output in engine.generate(request_id, prompt, params):
            pieces.append(output.outputs[0].text)
            tokens += output.outputs[0].token_ids
            final = output
        return "".join(pieces), tokens, final
    return run()


def test_concurrent_streams_match_offline(engine, tiny_llama):
    from kvik import LLM

    prompts = ["Hello", "The capital of France is", "Once upon a time", "12345"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, output_kind=OutputKind.DELTA)

    async def main():
        return await asyncio.gather(*(collect(engine, f"s{i}", p, params) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    offline = LLM(str(tiny_llama), show_progress=False).generate(prompts, params.clone(output_kind=OutputKind.CUMULATIVE))
    for (text, tokens, final), reference in zip(results, offline):
        assert tokens == reference.outputs[0].token_ids
        assert text == reference.outputs[0].text
        assert final.finished and final.outputs[0].finish_reason == "length"


def test_consumer_that_stops_early_aborts_and_frees_blocks(engine):
    params = SamplingParams(max_tokens=500, ignore_eos=True, output_kind=OutputKind.DELTA)

    async def main():
        stream = engine.generate("leaving", "Tell me a long story", params)
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):  # the engine thread applies the abort before its next step
            stats = engine.stats()
            if stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks:
                return stats
            await asyncio.sleep(0.02)
        return engine.stats()

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_bad_request_fails_alone(engine):
    async def main():
        with pytest.raises(InvalidRequestError):
            async for _ in engine.generate("bad", [], SamplingParams()):
                pass
        return await collect(engine, "good", "Hello", SamplingParams(max_tokens=3, ignore_eos=True))

    text, tokens, final = asyncio.run(main())
    assert final.finished and len(final.outputs[0].token_ids) == 3
