"""`kvik serve --speculative-method ngram` through the official openai SDK: greedy output equal to
the offline engine without speculation (completions, chat, streaming, stop strings, logprobs), and
the acceptance counters on /metrics."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvik import LLM, SamplingParams
from tests.server.conftest import metric_value

SPEC_FLAGS = ("--speculative-method", "ngram", "--num-speculative-tokens", "4", "--prompt-lookup-min", "1",
              "--no-speculative-adaptive")
# Long enough for the tiny random model's greedy output to fall into runs the lookup predicts.
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def spec_server(server_factory):
    return server_factory(*SPEC_FLAGS)


@pytest.fixture(scope="module")
def client(spec_server):
    return openai.OpenAI(base_url=spec_server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(str(tiny_llama), show_progress=False, max_model_len=512)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def test_completions_equal_speculation_off_and_drafts_are_counted(client, offline, spec_server):
    prompts = ["Hello world", "The capital of France is", "1 2 3 4 1 2 3 4 1 2 3", "the the the the"]
    before = httpx.get(f"{spec_server.url}/metrics").text
    response = client.completions.create(model="tiny", prompt=prompts, temperature=0, max_tokens=MAX_TOKENS,
                                         logprobs=2, extra_body={"ignore_eos": True})
    expected = offline.generate(prompts, greedy(logprobs=2))
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [e.outputs[0].text for e in expected]
    for choice, reference in zip(choices, expected):
        assert len(choice.logprobs.tokens) == len(reference.outputs[0].token_ids)
        wanted = [entry[token].logprob for entry, token in zip(reference.outputs[0].logprobs,
                                                               reference.outputs[0].token_ids)]
        assert choice.logprobs.token_logprobs == pytest.approx(wanted, abs=1e-4)
    assert response.usage.completion_tokens == MAX_TOKENS * len(prompts)

    after = httpx.get(f"{spec_server.url}/metrics").text
    drafted = (metric_value(after, "kvik:spec_decode_num_draft_tokens_total")
               - metric_value(before, "kvik:spec_decode_num_draft_tokens_total"))
    accepted = (metric_value(after, "kvik:spec_decode_num_accepted_tokens_total")
                - metric_value(before, "kvik:spec_decode_num_accepted_tokens_total"))
    assert drafted > 0 and 0 < accepted <= drafted
    assert metric_value(after, "kvik:spec_decode_num_drafts_total") > 0
    assert 'kvik:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in after


def test_streaming_chat_with_a_stop_string_equals_speculation_off(client, offline):
    messages = [{"role": "user", "content": "Repeat after me: la la la la la la"}]
    full = offline.chat(messages, greedy())[0].outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expected = offline.chat(messages, greedy(stop=[stop]))[0].outputs[0]
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=MAX_TOKENS, stop=[stop], stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_seeded_sampling_is_reproducible_through_the_server(client):
    kwargs = dict(model="tiny", prompt="a b a b a b a b", temperature=1.0, top_p=0.9, seed=7,
                  max_tokens=24, extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first
