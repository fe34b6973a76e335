"""The official openai SDK against a real server: every feature the issue lists, and greedy output
equal to the offline engine's."""

from __future__ import annotations

import openai
import pytest

from kvik import LLM, SamplingParams


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(str(tiny_llama), show_progress=False, max_model_len=512)


GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def test_chat_greedy_equals_offline_chat(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is rain?"}]
    response = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert response.choices[0].message.content == expected[0].outputs[0].text
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens == len(expected[0].prompt_token_ids)
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")


def test_completion_greedy_equals_offline_generate(client, offline):
    prompts = ["Hello world", "The capital of France is"]
    response = client.completions.create(model="tiny", prompt=prompts, **GREEDY)
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == \
        [e.outputs[0].text for e in expected]
    assert response.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)


def test_streaming_chat_adds_up_and_ends_with_usage(client):
    messages = [{"role": "user", "content": "Tell me about the sea"}]
    full = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion_adds_up(client):
    full = client.completions.create(model="tiny", prompt="Once upon a time", **GREEDY)
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_gives_two_indexed_choices(client):
    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, temperature=1.0, seed=3,
        max_tokens=10, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 20
    stream = client.completions.create(model="tiny", prompt="hi", n=2, temperature=1.0, max_tokens=5,
                                       stream=True, extra_body={"ignore_eos": True})
    assert {c.choices[0].index for c in stream} == {0, 1}


def test_stop_string_cuts_text(client):
    full = client.completions.create(model="tiny", prompt="The weather today", **GREEDY).choices[0].text
    stop = full[4:7]
    response = client.completions.create(model="tiny", prompt="The weather today", stop=[stop], **GREEDY)
    assert response.choices[0].text == full[:full.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_seed_reproducibility(client):
    def sample():
        return client.completions.create(model="tiny", prompt="Numbers matter", temperature=1.0,
                                         seed=1234, max_tokens=16,
                                         extra_body={"ignore_eos": True}).choices[0].text
    first = sample()
    assert sample() == first


def test_chat_logprobs_and_top_logprobs(client):
    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3,
        **GREEDY)
    content = response.choices[0].logprobs.content
    assert len(content) == 12
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.logprob <= 0


def test_token_id_prompts(client, offline):
    ids = offline.engine.tokenizer.encode("Hello world")
    single = client.completions.create(model="tiny", prompt=ids, **GREEDY)
    batch = client.completions.create(model="tiny", prompt=[ids, ids[:1]], **GREEDY)
    expected = offline.generate([ids, ids[:1]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert single.choices[0].text == expected[0].outputs[0].text
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [e.outputs[0].text for e in expected]


def test_echo_logprobs_are_one_to_one_with_prompt_ids(client, offline, tiny_llama):
    """lm-evaluation-harness's loglikelihood request, verbatim."""
    from tests.reference import hf_prompt_logprobs

    ids = offline.engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    response = client.completions.create(model="tiny", prompt=[ids], max_tokens=1, logprobs=1,
                                         echo=True, temperature=0)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = hf_prompt_logprobs(tiny_llama, ids)
    for position in range(1, len(ids)):
        assert logprobs.token_logprobs[position] == pytest.approx(
            reference[position - 1, ids[position]].item(), abs=1e-4)
    assert response.choices[0].text.startswith(offline.engine.tokenizer.decode(ids, skip_special_tokens=False))
    # max_tokens 0 with echo scores the prompt only.
    scored = client.completions.create(model="tiny", prompt=[ids], max_tokens=0, logprobs=1, echo=True)
    assert len(scored.choices[0].logprobs.tokens) == len(ids)
    assert scored.usage.completion_tokens == 0


def test_models_and_tokenizer_routes(client, server):
    import httpx

    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 512


def test_prefix_cache_hits_show_in_usage(client):
    system = "You are a helpful assistant who answers every question briefly and politely. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
