"""The engine's spans of a request (kvik.engine.request_spans), collected in-process with the
SDK's in-memory exporter: AsyncLLM and the core in one process (the core on a thread), so no
process boundary is crossed here; tests/gateway/test_tracing_e2e.py covers the real processes."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvik.core import tracing
from kvik.core.config import EngineArgs
from kvik.core.sampling_params import OutputKind, SamplingParams
from kvik.engine.async_llm import AsyncLLM
from kvik.engine.preprocess_pool import PreprocessConfig

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

PHASES = ["queue", "prefill", "decode", "detokenize"]


@pytest.fixture
def exporter():
    memory = InMemorySpanExporter()
    tracing.configure(tracing.TracingConfig("http://127.0.0.1:9/v1/traces"), exporter=memory)
    yield memory
    tracing.shutdown()


def run_engine(tiny_llama, work):
    async def main():
        llm = AsyncLLM(EngineArgs(model=str(tiny_llama), show_progress=False), engine_in_thread=True,
                       preprocess=PreprocessConfig(workers=0))
        await llm.start()
        try:
            return await work(llm)
        finally:
            await llm.shutdown()

    return asyncio.new_event_loop().run_until_complete(main())


def request(llm, request_id, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=OutputKind.DELTA)
    return llm.input_processor.make_request(request_id, llm.tokenizer.encode("Once upon a time"), params,
                                            time.time())


def test_finished_request_has_its_phases_in_order_under_generate(exporter, tiny_llama):
    async def work(llm):
        core_request = request(llm, "r1", 6)
        async for _ in llm.generate(core_request):
            pass
        return len(core_request.prompt_token_ids)

    num_prompt_tokens = run_engine(tiny_llama, work)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) >= {"generate", *PHASES}
    generate = spans["generate"]
    assert generate.parent is None  # no current span here: generate is a root
    for name in PHASES:
        assert spans[name].parent.span_id == generate.context.span_id
        assert spans[name].context.trace_id == generate.context.trace_id
    assert spans["queue"].end_time <= spans["prefill"].start_time + 1
    assert spans["prefill"].end_time <= spans["decode"].start_time + 1
    assert generate.start_time <= spans["queue"].start_time and spans["decode"].end_time <= generate.end_time
    assert generate.attributes["kvik.request_id"] == "r1"
    assert generate.attributes["gen_ai.usage.input_tokens"] == num_prompt_tokens
    assert generate.attributes["gen_ai.usage.output_tokens"] == 6
    assert list(generate.attributes["gen_ai.response.finish_reasons"]) == ["length"]
    assert spans["detokenize"].attributes["kvik.detokenize.busy_s"] > 0


def test_request_closed_early_is_recorded_as_aborted(exporter, tiny_llama):
    async def work(llm):
        stream = llm.generate(request(llm, "r2", 200))
        async for output in stream:
            if output.outputs and output.outputs[0].token_ids:
                break
        await stream.aclose()

    run_engine(tiny_llama, work)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    generate = spans["generate"]
    assert list(generate.attributes["gen_ai.response.finish_reasons"]) == ["abort"]
    assert 0 < generate.attributes["gen_ai.usage.output_tokens"] < 200
    assert {"queue", "prefill", "decode"} <= set(spans)
