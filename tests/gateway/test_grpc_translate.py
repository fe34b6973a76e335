"""The gateway's OpenAI JSON <-> kvik gRPC translation (kvik.gateway.grpc_translate), and grpc://
replica URLs in the config. The end-to-end behaviour against real replicas is in
test_e2e_kvik_serve.py (its BOTH_TRANSPORTS tests)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("grpc")

from kvik.core.errors import ConfigError, InvalidRequestError  # noqa: E402
from kvik.gateway.config import parse_config  # noqa: E402
from kvik.gateway.grpc_translate import (CHAT_PATH, COMPLETIONS_PATH, NotCarriedError, answer_json,  # noqa: E402
                                         plan, stream_frames)
from kvik.protocol.grpc import inference_pb2 as pb  # noqa: E402


def chat(**extra):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_every_carried_chat_field_reaches_the_protobuf() -> None:
    body = chat(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}],
        max_tokens=9, max_completion_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, n=2,
        stop="END", stop_token_ids=[1, 2], logit_bias={"5": -100}, ignore_eos=True, presence_penalty=0.5,
        priority=-10, tenant="t1", tenant_weight=2.0, cache_salt="salt", user="ignored by kvik serve too",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minimum": 1}}}],
        tool_choice={"type": "function", "function": {"name": "f"}}, parallel_tool_calls=False,
        stream=True, stream_options={"include_usage": True}, logprobs=False, response_format={"type": "text"})
    translated = plan(CHAT_PATH, body, stream=True)
    request = translated.request
    assert translated.chat and translated.include_usage
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool"]
    assert [p.text for p in request.messages[1].parts.parts] == ["a", "b"]
    assert request.messages[2].WhichOneof("content") is None  # null content stays null
    assert request.messages[2].tool_calls[0].function.arguments == "{\"x\": 1}"
    assert request.messages[3].tool_call_id == "call_1"
    sampling = request.sampling
    assert sampling.max_tokens == 7  # max_completion_tokens wins, as in kvik serve
    assert (sampling.temperature, sampling.top_k, sampling.seed, sampling.n) == (0.5, 5, 3, 2)
    assert list(sampling.stop) == ["END"] and list(sampling.stop_token_ids) == [1, 2]
    assert dict(sampling.logit_bias) == {"5": -100.0} and sampling.ignore_eos
    assert (request.scheduling.priority, request.scheduling.tenant, request.scheduling.cache_salt) == (
        -10, "t1", "salt")
    assert json.loads(request.tools[0].function.parameters_json) == {"type": "object", "minimum": 1}
    assert request.tool_choice.function_name == "f" and request.parallel_tool_calls is False


def test_a_single_prompt_as_text_or_token_ids() -> None:
    assert plan(COMPLETIONS_PATH, {"model": "m", "prompt": ["once"]}, False).request.text == "once"
    by_ids = plan(COMPLETIONS_PATH, {"model": "m", "prompt": [[1, 2, 3]], "max_tokens": 4}, False).request
    assert list(by_ids.token_ids.ids) == [1, 2, 3] and by_ids.sampling.max_tokens == 4
    assert not by_ids.sampling.HasField("temperature")  # unset: the replica's default applies


@pytest.mark.parametrize(("path", "extra", "param"), [
    (CHAT_PATH, {"logprobs": True}, "logprobs"),
    (CHAT_PATH, {"top_logprobs": 3}, "top_logprobs"),
    (CHAT_PATH, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT_PATH, {"guided_regex": "a+"}, "guided_regex"),
    (CHAT_PATH, {"chat_template": "{{ messages }}"}, "chat_template"),
    (CHAT_PATH, {"add_generation_prompt": False}, "add_generation_prompt"),
    (COMPLETIONS_PATH, {"echo": True}, "echo"),
    (COMPLETIONS_PATH, {"logprobs": 0}, "logprobs"),
    (COMPLETIONS_PATH, {"best_of": 3}, "best_of"),
    (COMPLETIONS_PATH, {"prompt": ["one", "two"]}, "prompt"),
])
def test_what_grpc_cannot_carry_is_refused_naming_the_field(path, extra, param) -> None:
    body = {**(chat() if path == CHAT_PATH else {"model": "m", "prompt": "p"}), **extra}
    with pytest.raises(NotCarriedError) as caught:
        plan(path, body, False)
    assert caught.value.param == param and caught.value.http_status == 400
    assert caught.value.code == "not_supported_over_grpc" and "http://" in caught.value.message


@pytest.mark.parametrize(("extra", "param"), [
    ({"temperature": "hot"}, "temperature"), ({"max_tokens": -1}, "max_tokens"), ({"n": 2**40}, "n"),
    ({"stop": 5}, "stop"), ({"messages": "hi"}, "messages"), ({"messages": [{"role": 5}]}, "messages.0.role"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"), ({"logit_bias": {"1": "x"}}, "logit_bias"),
])
def test_values_the_protobuf_cannot_hold_are_a_400_naming_the_field(extra, param) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        plan(CHAT_PATH, chat(**extra), False)
    assert caught.value.param == param and not isinstance(caught.value, NotCarriedError)


def test_answers_come_back_as_kvik_serves_json() -> None:
    translated = plan(CHAT_PATH, chat(stream=True, stream_options={"include_usage": True}), True)
    usage = pb.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    first = pb.ChatStreamResponse(id="chatcmpl-1", model="tiny", created=7, choices=[pb.ChatStreamChoice(
        index=0, delta=pb.ChatDelta(role="assistant", content=""))])
    last = pb.ChatStreamResponse(id="chatcmpl-1", model="tiny", created=7, usage=usage)
    assert stream_frames(translated, first) == (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"tiny",'
        b'"system_fingerprint":null,"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        b'"logprobs":null,"finish_reason":null}],"usage":null}\n\n')
    assert json.loads(stream_frames(translated, last)[6:])["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}}
    without_usage = plan(CHAT_PATH, chat(stream=True), True)
    assert stream_frames(without_usage, last) == b""  # the client did not ask for the usage chunk

    generate = plan(COMPLETIONS_PATH, {"model": "tiny", "prompt": "p"}, False)
    reply = pb.GenerateResponse(id="cmpl-1", model="tiny", created=7, usage=usage, choices=[pb.GenerateChoice(
        index=0, text="ab", finish_reason="stop", stop_reason=pb.StopReason(stop_string="END"))])
    assert json.loads(answer_json(generate, reply))["choices"] == [
        {"index": 0, "text": "ab", "logprobs": None, "finish_reason": "stop", "stop_reason": "END"}]


def test_grpc_replica_urls_in_the_config() -> None:
    config = parse_config({"models": [{"name": "m", "replicas": [{"url": "grpc://127.0.0.1:50051/"}]}]})
    assert config.models[0].replicas[0].url == "grpc://127.0.0.1:50051"
    for bad in ("grpc://127.0.0.1", "grpc://127.0.0.1:50051/v1", "grpc://:50051"):
        with pytest.raises(ConfigError, match=r"models\[0\]\.replicas\[0\]\.url: .*grpc://HOST:PORT"):
            parse_config({"models": [{"name": "m", "replicas": [{"url": bad}]}]})
    with pytest.raises(ConfigError, match=r"batches\.upstream: .*HTTP only"):
        parse_config({"models": [{"name": "m", "replicas": [{"url": "http://127.0.0.1:1"}]}],
                      "batches": {"upstream": {"url": "grpc://127.0.0.1:50051"}}})


def test_kvik_serves_chat_objects_survive_the_grpc_round_trip() -> None:
    """What kvik serve's HTTP API would send (tool calls, reasoning, usage) comes out of the gateway
    unchanged after the replica's conversion to protobuf (kvik.server.grpc.convert) and the
    gateway's conversion back."""
    from kvik.server.grpc import convert

    header = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 11, "model": "tiny",
              "system_fingerprint": None}

    def chunk(delta, finish=None):
        return {**header, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                "usage": None}

    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "let me see"}),
              chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "get_time", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"zone\": \"Europe/Oslo\"}"}}]}),
              chunk({}, "tool_calls"),
              {**header, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
                                                  "prompt_tokens_details": {"cached_tokens": 0}}}]
    translated = plan(CHAT_PATH, chat(stream=True, stream_options={"include_usage": True}), True)
    for sent in chunks:
        frame = stream_frames(translated, convert.chat_stream_response(sent))
        assert json.loads(frame.removeprefix(b"data: ")) == sent

    body = {"id": "chatcmpl-9", "object": "chat.completion", "created": 11, "model": "tiny",
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "reasoning_content": "hm",
                                                 "tool_calls": [{"id": "call_1", "type": "function", "function": {
                                                     "name": "get_time", "arguments": "{}"}}]},
                         "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None},
                        {"index": 1, "message": {"role": "assistant", "content": "plain"}, "logprobs": None,
                         "finish_reason": "stop", "stop_reason": 7}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
                      "prompt_tokens_details": {"cached_tokens": 3}}}
    assert json.loads(answer_json(plan(CHAT_PATH, chat(), False), convert.chat_response(body))) == body
