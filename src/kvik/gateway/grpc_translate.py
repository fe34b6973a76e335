"""OpenAI JSON to kvik's gRPC messages and back, for replicas reached at `grpc://` URLs.

A request body becomes a `ChatRequest` or `GenerateRequest` (kvik/protocol/grpc/inference.proto);
the replica validates the values as it does over HTTP (its INVALID_ARGUMENT comes back as the same
400). What the gateway checks here is only what the protobuf cannot hold: a value of the wrong type,
and the features the gRPC API does not carry. Those are refused with a 400 that names the field,
never dropped: kvik serve would act on them over HTTP (`logprobs`, structured outputs, `echo`, ...),
so leaving them out would be a silently different answer. Fields kvik serve ignores over HTTP (those
it does not know, `user`) are ignored here too.

Answers come back as the exact JSON kvik serve's HTTP API sends: the chat.completion /
text_completion object, or the chunks of its event stream (`data: {...}`, the usage chunk when
`stream_options.include_usage` asked for it, `data: [DONE]`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvik.core.errors import InvalidRequestError
from kvik.protocol.grpc import inference_pb2 as pb
from kvik.protocol.sse import sse_frame

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "seed", "min_tokens", "ignore_eos", "n", "include_stop_str_in_output",
             "skip_special_tokens")
_SCHEDULING = ("priority", "tenant", "tenant_weight", "cache_salt")

# Fields kvik serve acts on that the gRPC API does not carry, with the value that means "not used".
_NOT_CARRIED_CHAT = {"logprobs": (None, False), "top_logprobs": (None, 0), "response_format": (None,),
                     "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,),
                     "guided_choice": (None,), "guided_grammar": (None,), "guided_whitespace_pattern": (None,),
                     "chat_template": (None,), "chat_template_kwargs": (None, {}),
                     "add_generation_prompt": (None, True)}
_NOT_CARRIED_COMPLETIONS = {**{k: v for k, v in _NOT_CARRIED_CHAT.items()
                               if not k.startswith(("chat_", "add_", "top_"))},
                            "logprobs": (None,), "echo": (None, False), "suffix": (None, "")}


class NotCarriedError(InvalidRequestError):
    """A request the gRPC API cannot carry; raised only when no HTTP replica could take it instead."""

    code = "not_supported_over_grpc"


@dataclass(slots=True)
class GrpcPlan:
    """One request, translated: which RPC, its message, and how to write the answer."""

    chat: bool
    request: pb.ChatRequest | pb.GenerateRequest
    include_usage: bool  # the stream ends with the usage chunk (the gateway asks for it itself)


def plan(path: str, body: dict[str, Any], stream: bool) -> GrpcPlan:
    """The gRPC request for an OpenAI body; `NotCarriedError` naming the field otherwise."""
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    if path == CHAT_PATH:
        _refuse_not_carried(body, _NOT_CARRIED_CHAT)
        return GrpcPlan(True, _chat_request(body), include_usage)
    if path == COMPLETIONS_PATH:
        _refuse_not_carried(body, _NOT_CARRIED_COMPLETIONS)
        return GrpcPlan(False, _generate_request(body), include_usage)
    raise NotCarriedError(f"{path} is not carried by kvik's gRPC API; this model's replicas are gRPC-only. "
                          "Give the model an http:// replica for it.")


def _refuse_not_carried(body: dict[str, Any], fields: dict[str, tuple[Any, ...]]) -> None:
    for name, unused in fields.items():
        if name in body and not any(body[name] == value and type(body[name]) is type(value) for value in unused):
            if name == "response_format" and isinstance(body[name], dict) and body[name].get("type") == "text":
                continue  # free text: the default
            raise _not_carried(name)
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):  # kvik serve answers best_of == n only
        raise _not_carried("best_of")


def _not_carried(name: str) -> NotCarriedError:
    return NotCarriedError(
        f"{name}: this model is served by gRPC replicas (grpc:// in the gateway's config), whose API does not "
        f"carry `{name}`; leave it out, or ask the operator to add an http:// replica of the model, which gets "
        "such requests", param=name)


def _set(message: Any, name: str, value: Any, where: str) -> None:
    try:
        setattr(message, name, value)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{where}: has the wrong type or is out of range ({value!r:.60})",
                                  param=where) from None


def _sampling(body: dict[str, Any], sampling: pb.SamplingParams, scheduling: pb.Scheduling,
              max_tokens: Any) -> None:
    for name in _SAMPLING:
        if body.get(name) is not None:
            _set(sampling, name, body[name], name)
    if max_tokens is not None:
        _set(sampling, "max_tokens", max_tokens, "max_tokens")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list):
            raise InvalidRequestError("stop: send a string or a list of strings", param="stop")
        _extend(sampling.stop, stops, "stop")
    if body.get("stop_token_ids") is not None:
        _extend(sampling.stop_token_ids, body["stop_token_ids"], "stop_token_ids")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise InvalidRequestError("logit_bias: send an object of token id -> bias", param="logit_bias")
        for key, value in bias.items():
            try:
                sampling.logit_bias[key] = value
            except (TypeError, ValueError):
                raise InvalidRequestError(f"logit_bias.{key}: the bias must be a number",
                                          param="logit_bias") from None
    for name in _SCHEDULING:
        if body.get(name) is not None:
            _set(scheduling, name, body[name], name)


def _extend(field: Any, values: Any, where: str) -> None:
    try:
        field.extend(values)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{where}: has the wrong type ({values!r:.60})", param=where) from None


def _generate_request(body: dict[str, Any]) -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    _set(request, "model", body["model"], "model")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        _extend(request.token_ids.ids, prompt, "prompt")
        request.token_ids.SetInParent()  # an empty list is still a (refused) prompt, not a missing one
    elif isinstance(prompt, list):
        raise NotCarriedError("prompt: this model is served by gRPC replicas (grpc:// in the gateway's config), "
                              "whose API takes one prompt per request; send the prompts as separate requests, "
                              "or ask the operator to add an http:// replica of the model", param="prompt")
    else:
        raise InvalidRequestError("prompt: send a string, or a list of token ids", param="prompt")
    _sampling(body, request.sampling, request.scheduling, body.get("max_tokens"))
    return request


def _chat_request(body: dict[str, Any]) -> pb.ChatRequest:
    request = pb.ChatRequest()
    _set(request, "model", body["model"], "model")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequestError("messages: send a list of messages", param="messages")
    for position, message in enumerate(messages):
        request.messages.append(_message(message, f"messages.{position}"))
    max_tokens = body.get("max_completion_tokens")
    _sampling(body, request.sampling, request.scheduling,
              max_tokens if max_tokens is not None else body.get("max_tokens"))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequestError("tools: send a list of tools", param="tools")
        for position, tool in enumerate(tools):
            request.tools.append(_tool(tool, f"tools.{position}"))
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        request.tool_choice.mode = choice
    elif isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError('tool_choice: send "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        request.tool_choice.function_name = function["name"]
    elif choice is not None:
        raise InvalidRequestError("tool_choice: has the wrong type", param="tool_choice")
    if body.get("parallel_tool_calls") is not None:
        _set(request, "parallel_tool_calls", body["parallel_tool_calls"], "parallel_tool_calls")
    return request


def _message(message: Any, where: str) -> pb.ChatMessage:
    if not isinstance(message, dict):
        raise InvalidRequestError(f"{where}: send an object with `role` and `content`", param=where)
    out = pb.ChatMessage()
    _set(out, "role", message.get("role") or "", f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        out.text = content
    elif isinstance(content, list):
        out.parts.SetInParent()
        for index, part in enumerate(content):
            if not isinstance(part, dict):
                raise InvalidRequestError(f"{where}.content.{index}: send a content part object",
                                          param=f"{where}.content")
            entry = out.parts.parts.add()
            _set(entry, "type", part.get("type") or "", f"{where}.content.{index}.type")
            if part.get("text") is not None:
                _set(entry, "text", part["text"], f"{where}.content.{index}.text")
    elif content is not None:
        raise InvalidRequestError(f"{where}.content: send a string or a list of content parts",
                                  param=f"{where}.content")
    for name in ("name", "tool_call_id", "reasoning_content"):
        if message.get(name) is not None:
            _set(out, name, message[name], f"{where}.{name}")
    for index, call in enumerate(message.get("tool_calls") or []):
        out.tool_calls.append(_tool_call(call, f"{where}.tool_calls.{index}"))
    return out


def _tool_call(call: Any, where: str) -> pb.ToolCall:
    if not isinstance(call, dict):
        raise InvalidRequestError(f"{where}: send a tool call object", param=where)
    out = pb.ToolCall()
    for name in ("id", "type"):
        if call.get(name) is not None:
            _set(out, name, call[name], f"{where}.{name}")
    function = call.get("function")
    if isinstance(function, dict):
        out.function.SetInParent()
        for name in ("name", "arguments"):
            value = function.get(name)
            if value is not None:
                # Arguments are JSON text in OpenAI's API; an object (some clients send one) is written out.
                _set(out.function, name, value if isinstance(value, str) or name == "name" else json.dumps(value),
                     f"{where}.function.{name}")
    return out


def _tool(tool: Any, where: str) -> pb.Tool:
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise InvalidRequestError(f'{where}: send {{"type": "function", "function": {{"name": ...}}}}', param=where)
    out = pb.Tool()
    _set(out, "type", tool.get("type") or "", f"{where}.type")
    function = tool["function"]
    _set(out.function, "name", function.get("name") or "", f"{where}.function.name")
    for name in ("description", "strict"):
        if function.get(name) is not None:
            _set(out.function, name, function[name], f"{where}.function.{name}")
    if function.get("parameters") is not None:
        out.function.parameters_json = json.dumps(function["parameters"])
    return out


# -- answers: the JSON kvik serve's HTTP API sends --


def _usage(usage: pb.Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _stop_reason(reason: pb.StopReason) -> int | str | None:
    kind = reason.WhichOneof("reason")
    return None if kind is None else getattr(reason, kind)


def _tool_call_json(call: pb.ToolCall) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(call, name) for name in ("index", "id", "type") if call.HasField(name)}
    if call.HasField("function"):
        out["function"] = {name: getattr(call.function, name) for name in ("name", "arguments")
                           if call.function.HasField(name)}
    return out


def _header(reply: Any, kind: str) -> dict[str, Any]:
    return {"id": reply.id, "object": kind, "created": reply.created, "model": reply.model,
            "system_fingerprint": None}


def _chat_message(message: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role,
                           "content": message.text if message.WhichOneof("content") == "text" else None}
    if message.HasField("reasoning_content"):
        out["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        out["tool_calls"] = [_tool_call_json(call) for call in message.tool_calls]
    return out


def answer_json(grpc_plan: GrpcPlan, reply: pb.ChatResponse | pb.GenerateResponse) -> bytes:
    """The chat.completion or text_completion object, encoded as kvik serve encodes it."""
    if grpc_plan.chat:
        choices = [{"index": c.index, "message": _chat_message(c.message), "logprobs": None,
                    "finish_reason": c.finish_reason or None, "stop_reason": _stop_reason(c.stop_reason)}
                   for c in reply.choices]
        body = {**_header(reply, "chat.completion"), "choices": choices, "usage": _usage(reply.usage)}
    else:
        choices = [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason or None,
                    "stop_reason": _stop_reason(c.stop_reason)} for c in reply.choices]
        body = {**_header(reply, "text_completion"), "choices": choices, "usage": _usage(reply.usage)}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def stream_frames(grpc_plan: GrpcPlan, reply: pb.ChatStreamResponse | pb.GenerateStreamResponse) -> bytes:
    """The SSE event(s) of one streamed message: a chunk per choice delta, or the usage chunk."""
    kind = "chat.completion.chunk" if grpc_plan.chat else "text_completion"
    header = _header(reply, kind)
    if not reply.choices:
        if reply.HasField("usage") and grpc_plan.include_usage:
            return sse_frame({**header, "choices": [], "usage": _usage(reply.usage)})
        return b""
    frames = []
    for choice in reply.choices:
        if grpc_plan.chat:
            delta: dict[str, Any] = {name: getattr(choice.delta, name)
                                     for name in ("role", "content", "reasoning_content")
                                     if choice.delta.HasField(name)}
            if choice.delta.tool_calls:
                delta["tool_calls"] = [_tool_call_json(call) for call in choice.delta.tool_calls]
            entry: dict[str, Any] = {"index": choice.index, "delta": delta, "logprobs": None,
                                     "finish_reason": choice.finish_reason or None}
        else:
            entry = {"index": choice.index, "text": choice.text, "logprobs": None,
                     "finish_reason": choice.finish_reason or None, "stop_reason": _stop_reason(choice.stop_reason)}
        chunk: dict[str, Any] = {**header, "choices": [entry]}
        if grpc_plan.include_usage:
            chunk["usage"] = None
        frames.append(sse_frame(chunk))
    return b"".join(frames)

