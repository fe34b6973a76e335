"""Multi-step decoding (on by default) behind the API server: a stream's tokens arrive in groups,
the text equals single steps' offline, and the latency metrics still count tokens."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvik import LLM, SamplingParams
from tests.server.conftest import metric_value


@pytest.fixture(scope="module")
def single_steps(tiny_llama):
    return LLM(str(tiny_llama), show_progress=False, max_model_len=512, num_scheduler_steps=1)


def test_a_stream_from_runs_equals_single_steps_and_counts_every_token(server, single_steps):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    before = httpx.get(f"{server.url}/metrics").text
    # 300: the API process merges into the first chunk whatever the engine made before the client's
    # first read (41 of 60 tokens in one clean-clone run on a fast machine), so a short answer can
    # leave too few later tokens to tell a count per token from a count per chunk.
    tokens = 300
    stream = client.completions.create(model="tiny", prompt="Once upon a time", temperature=0,
                                       max_tokens=tokens, stream=True, logprobs=1,
                                       extra_body={"ignore_eos": True})
    chunks = [c.choices[0] for c in stream if c.choices and c.choices[0].logprobs]
    expected = single_steps.generate(["Once upon a time"], SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True))[0].outputs[0]
    assert "".join(c.text for c in chunks) == expected.text
    assert sum(len(c.logprobs.tokens) for c in chunks) == tokens
    assert len(chunks) < tokens // 2  # most chunks carry a run's several tokens
    after = httpx.get(f"{server.url}/metrics").text
    name = 'kvik:inter_token_latency_seconds_count{model_name="tiny"}'
    observed = metric_value(after, name) - (metric_value(before, name) if name in before else 0)
    # One gap per token after the first output (the first token's, plus any the API process merged
    # into it when the client read slower than the engine made them), however they were grouped.
    assert observed == tokens - len(chunks[0].logprobs.tokens)
    assert observed >= tokens // 2
    # Per token, not per chunk: the chunks after the first carry runs of several tokens each.
    assert observed > 2 * (len(chunks) - 1)
