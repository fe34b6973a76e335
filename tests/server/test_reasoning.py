"""Reasoning models through a real `kvik serve`: a Qwen3-style random model whose vocabulary has
<think> and </think>. Thinking comes back in `reasoning_content`, the answer in `content`, and an
output constraint applies only once the thinking has ended.

The random model rarely writes </think> by itself; a logit bias on it (+5) ends its thinking after
a dozen or so tokens, which is all these tests need."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "How many moons?"}]
OPEN_THINKING = {"chat_template_kwargs": {"open_thinking": True}}  # the prompt opens <think>, as R1's does


@pytest.fixture(scope="module")
def client(hermes_thinking_server):
    return openai.OpenAI(base_url=hermes_thinking_server.base_url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def end_of_thinking(hermes_thinking_server) -> int:
    response = httpx.post(f"{hermes_thinking_server.url}/tokenize",
                          json={"prompt": "</think>", "add_special_tokens": False}).json()
    assert response["count"] == 1
    return response["tokens"][0]


def streamed(stream) -> tuple[str, str, str]:
    reasoning, content, finish = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


@pytest.mark.parametrize("seed", [0, 1])
def test_thinking_then_a_constrained_answer(client, end_of_thinking, seed):
    kwargs = dict(model="tiny", messages=MESSAGES, seed=seed, max_tokens=300, response_format=FORMAT,
                  logit_bias={str(end_of_thinking): 5}, extra_body=OPEN_THINKING)
    response = client.chat.completions.create(**kwargs)
    message = response.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    jsonschema.validate(json.loads(message.content), SCHEMA)  # the free-text thinking was not constrained
    assert response.choices[0].finish_reason == "stop"
    assert streamed(client.chat.completions.create(stream=True, **kwargs)) == (reasoning, message.content, "stop")


def test_enable_thinking_false_constrains_from_the_first_token(client):
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, seed=3, max_tokens=100, response_format=FORMAT,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"] is None
    jsonschema.validate(json.loads(message.content), SCHEMA)


def test_unfinished_thinking_is_all_reasoning(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=4, max_tokens=12,
                                              extra_body={**OPEN_THINKING, "ignore_eos": True})
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"] and message.content == ""
    assert response.choices[0].finish_reason == "length"


def test_forced_tool_call_after_thinking(client, end_of_thinking):
    tool = {"type": "function", "function": {"name": "count_moons", "parameters": SCHEMA}}
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, seed=0, max_tokens=300, tools=[tool], tool_choice="required",
        parallel_tool_calls=False, logit_bias={str(end_of_thinking): 5}, extra_body=OPEN_THINKING)
    choice = response.choices[0]
    assert choice.message.model_extra["reasoning_content"]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
