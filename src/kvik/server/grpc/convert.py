"""Protobuf messages to the server's OpenAI request models, and its OpenAI answers back to protobuf.

A gRPC request becomes the same `ChatCompletionRequest` / `CompletionRequest` an HTTP request does
(built from a plain dict, so pydantic checks every bound the HTTP path checks), and from there runs
through the same preprocessing (`kvik.server.serving.preprocess`). Answers are read from the dicts
the HTTP path sends as JSON (`ChatServing.completion_body`, `ChatServing.chunk_stream`), so both
transports say the same thing.
"""

from __future__ import annotations

import json
from typing import Any

from kvik.core.errors import InvalidRequestError
from kvik.protocol.grpc import inference_pb2 as pb
from kvik.protocol.openai import ChatCompletionRequest, CompletionRequest

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "min_tokens", "ignore_eos", "n",
                    "include_stop_str_in_output", "skip_special_tokens")
_SCHEDULING_FIELDS = ("priority", "tenant", "tenant_weight", "cache_salt")


def _present(message: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(message, name) for name in names if message.HasField(name)}


def _sampling(sampling: pb.SamplingParams, scheduling: pb.Scheduling) -> dict[str, Any]:
    fields = _present(sampling, _SAMPLING_FIELDS)
    if sampling.stop:
        fields["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        fields["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.logit_bias:
        fields["logit_bias"] = dict(sampling.logit_bias)
    fields.update(_present(scheduling, _SCHEDULING_FIELDS))
    return fields


def completion_request(request: pb.GenerateRequest, *, stream: bool) -> CompletionRequest:
    """The completions request a GenerateRequest stands for; pydantic's ValidationError if a field
    is out of bounds (the caller turns it into INVALID_ARGUMENT naming the field)."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt: set `text` or `token_ids`", param="prompt")
    prompt: Any = request.text if kind == "text" else list(request.token_ids.ids)
    body = {"model": request.model or None, "prompt": prompt, "stream": stream,
            **_sampling(request.sampling, request.scheduling)}
    if request.sampling.HasField("max_tokens"):
        body["max_tokens"] = request.sampling.max_tokens
    return CompletionRequest.model_validate(body)


def _tool_call_dict(call: pb.ToolCall) -> dict[str, Any]:
    out: dict[str, Any] = _present(call, ("index", "id", "type"))
    if call.HasField("function"):
        out["function"] = _present(call.function, ("name", "arguments"))
    return out


def _message_dict(message: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role}
    kind = message.WhichOneof("content")
    if kind == "text":
        out["content"] = message.text
    elif kind == "parts":
        out["content"] = [{"type": part.type, "text": part.text} for part in message.parts.parts]
    out.update(_present(message, ("name", "tool_call_id", "reasoning_content")))
    if message.tool_calls:
        out["tool_calls"] = [_tool_call_dict(call) for call in message.tool_calls]
    return out


def _tool_dict(tool: pb.Tool, position: int) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name,
                                **_present(tool.function, ("description", "strict"))}
    if tool.function.HasField("parameters_json"):
        try:
            function["parameters"] = json.loads(tool.function.parameters_json)
        except ValueError as exc:
            raise InvalidRequestError(f"tools[{position}].function.parameters_json: not valid JSON ({exc})",
                                      param=f"tools.{position}.function.parameters_json") from None
    return {"type": tool.type, "function": function}


def chat_request(request: pb.ChatRequest, *, stream: bool) -> ChatCompletionRequest:
    """The chat request a ChatRequest stands for (see `completion_request`)."""
    body: dict[str, Any] = {
        "model": request.model or None, "stream": stream,
        "messages": [_message_dict(m) for m in request.messages],
        **_sampling(request.sampling, request.scheduling)}
    if request.sampling.HasField("max_tokens"):
        body["max_completion_tokens"] = request.sampling.max_tokens
    if stream:
        body["stream_options"] = {"include_usage": True}  # the final message carries the usage
    if request.tools:
        body["tools"] = [_tool_dict(tool, i) for i, tool in enumerate(request.tools)]
    choice = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    if choice == "mode":
        body["tool_choice"] = request.tool_choice.mode
    elif choice == "function_name":
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.function_name}}
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls
    return ChatCompletionRequest.model_validate(body)


# -- answers --


def usage(usage_dict: dict[str, Any]) -> pb.Usage:
    details = usage_dict.get("prompt_tokens_details") or {}
    return pb.Usage(prompt_tokens=usage_dict["prompt_tokens"], completion_tokens=usage_dict["completion_tokens"],
                    cached_tokens=details.get("cached_tokens") or 0)


def stop_reason(value: int | str | None) -> pb.StopReason | None:
    if value is None:
        return None
    if isinstance(value, str):
        return pb.StopReason(stop_string=value)
    return pb.StopReason(stop_token_id=value)


def _tool_call(entry: dict[str, Any]) -> pb.ToolCall:
    call = pb.ToolCall(**{k: entry[k] for k in ("index", "id", "type") if entry.get(k) is not None})
    function = entry.get("function")
    if function is not None:
        call.function.CopyFrom(pb.FunctionCall(**{k: function[k] for k in ("name", "arguments")
                                                  if function.get(k) is not None}))
    return call


def chat_message(message: dict[str, Any]) -> pb.ChatMessage:
    out = pb.ChatMessage(role=message["role"])
    if message.get("content") is not None:
        out.text = message["content"]
    if message.get("reasoning_content") is not None:
        out.reasoning_content = message["reasoning_content"]
    out.tool_calls.extend(_tool_call(call) for call in message.get("tool_calls") or [])
    return out


def chat_response(body: dict[str, Any]) -> pb.ChatResponse:
    """From `ChatServing.completion_body`'s chat.completion object."""
    response = pb.ChatResponse(id=body["id"], model=body["model"], created=body["created"],
                               usage=usage(body["usage"]))
    for choice in body["choices"]:
        response.choices.append(pb.ChatChoice(index=choice["index"], message=chat_message(choice["message"]),
                                              finish_reason=choice["finish_reason"] or "",
                                              stop_reason=stop_reason(choice.get("stop_reason"))))
    return response


def chat_stream_response(chunk: dict[str, Any]) -> pb.ChatStreamResponse:
    """From one of `ChatServing.chunk_stream`'s chat.completion.chunk objects."""
    message = pb.ChatStreamResponse(id=chunk["id"], model=chunk["model"], created=chunk["created"])
    if chunk.get("usage"):
        message.usage.CopyFrom(usage(chunk["usage"]))
    for choice in chunk["choices"]:
        delta = choice["delta"]
        out = pb.ChatDelta(**{k: delta[k] for k in ("role", "content", "reasoning_content")
                              if delta.get(k) is not None})
        out.tool_calls.extend(_tool_call(call) for call in delta.get("tool_calls") or [])
        message.choices.append(pb.ChatStreamChoice(index=choice["index"], delta=out,
                                                   finish_reason=choice["finish_reason"] or ""))
    return message
