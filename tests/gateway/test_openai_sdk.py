"""The official `openai` SDK works against the gateway, errors included."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.harness import FAKE, Gateway

pytestmark = pytest.mark.timeout(120)


def sdk(gateway: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_openai_sdk_chat_stream_completions_models_and_errors(standard_gateway: Gateway) -> None:
    key = standard_gateway.create_key(name="sdk", rpm=5)
    client = sdk(standard_gateway, key)

    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 3

    pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="tiny-latest", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
        if chunk.choices]
    assert pieces and (not FAKE or len("".join(pieces).split()) == 4)

    usage_chunks = [chunk.usage for chunk in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True,
        stream_options={"include_usage": True}) if chunk.usage is not None]
    assert usage_chunks and 0 < usage_chunks[-1].completion_tokens <= 2  # asked for, so passed on

    assert client.completions.create(model="tiny", prompt="once", max_tokens=2).choices[0].text is not None
    assert {m.id for m in client.models.list()} == {"tiny", "other"}

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        sdk(standard_gateway, "kvik-wrong").models.list()
    with pytest.raises(openai.BadRequestError) as blocked:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "forbidden-topic"}])
    assert blocked.value.code == "content_filter"
    with pytest.raises(openai.RateLimitError) as limited:  # rpm 5: five calls above reached the limiter
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert limited.value.response.headers["retry-after"]
