"""The Responses API's shapes, mapped to and from the chat API's.

A Responses request becomes the chat request that means the same (`chat_fields`): input items become
chat messages (`input_messages`), function tools and `tool_choice` move their `name` under
`function`, `text.format` becomes `response_format`. A chat completion (or its chunks) becomes
output items (`output_items`): reasoning, the assistant message as `output_text`, each tool call as a
`function_call` item. Ids follow OpenAI's prefixes (resp_, msg_, fc_, rs_).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

from kvik.core.errors import InvalidRequestError
from kvik.protocol.responses import ResponsesRequest

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_ROLES = ("user", "assistant", "system", "developer")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content: must be a string or a list of content parts",
                                  param="input")
    texts = []
    for position, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text", part.get("refusal")), str):
            raise InvalidRequestError(
                f"{where}.content[{position}]: part type {kind!r} is not supported; kvik serves text-only "
                f"models, send input_text parts (output_text for assistant messages)", param="input")
        texts.append(part.get("text", part.get("refusal")))
    return "".join(texts) if role == "assistant" else "\n".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for the request's `input`: a string is one user message."""
    if isinstance(items, str):
        if not items:
            raise InvalidRequestError("input: is empty; send text or a list of input items", param="input")
        return [{"role": "user", "content": items}]
    if not items:
        raise InvalidRequestError("input: is empty; send text or a list of input items", param="input")
    messages: list[dict[str, Any]] = []
    for position, item in enumerate(items):
        where = f"input[{position}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidRequestError(f"{where}.role: must be one of {', '.join(_ROLES)}", param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), where, role)})
        elif kind == "function_call":
            call = _required(item, where, ("call_id", "name", "arguments"))
            tool_call = {"id": call["call_id"], "type": "function",
                         "function": {"name": call["name"], "arguments": call["arguments"]}}
            previous = messages[-1] if messages else None
            if previous is not None and previous["role"] == "assistant":
                previous.setdefault("tool_calls", []).append(tool_call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            output = _required(item, where, ("call_id",))
            text = item.get("output")
            text = text if isinstance(text, str) else _text_of(text, where, "tool")
            messages.append({"role": "tool", "tool_call_id": output["call_id"], "content": text})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise InvalidRequestError(
                f"{where}.type: {kind!r} is not supported; send message, function_call or "
                "function_call_output items", param="input")
    return messages


def _required(item: dict[str, Any], where: str, names: tuple[str, ...]) -> dict[str, str]:
    for name in names:
        if not isinstance(item.get(name), str) or (name != "arguments" and not item[name]):
            raise InvalidRequestError(f"{where}.{name}: required (a string)", param="input")
    return item


def chat_tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Responses function tools ({type, name, description, parameters, strict}) in chat's shape."""
    if not body.tools:
        return None
    tools = []
    for position, tool in enumerate(body.tools):
        if tool.get("type") != "function":
            raise InvalidRequestError(
                f"tools[{position}].type: {tool.get('type')!r} is not supported; kvik runs function tools "
                "(the client executes them)", param="tools")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidRequestError(f"tools[{position}].name: required", param="tools")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                    if tool.get(key) is not None}
        tools.append({"type": "function", "function": function})
    return tools


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise InvalidRequestError("tool_choice: must be auto, none, required or a function",
                                      param="tool_choice")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidRequestError('tool_choice: only {"type": "function", "name": ...} is supported '
                                  "among tool choice objects", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    text_format = body.text.format if body.text else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if not text_format.name or text_format.schema_ is None:
        raise InvalidRequestError("text.format: json_schema needs a name and a schema", param="text.format")
    schema = {"name": text_format.name, "schema": text_format.schema_}
    if text_format.strict is not None:
        schema["strict"] = text_format.strict
    if text_format.description:
        schema["description"] = text_format.description
    return {"type": "json_schema", "json_schema": schema}


def chat_fields(body: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request that means the same as `body` over `messages`. Refuses (400) what the chat
    API does not implement here rather than letting it be ignored."""
    if body.background:
        raise InvalidRequestError("background: is not supported by this server", param="background")
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "temperature": body.temperature,
                              "top_p": body.top_p, "max_completion_tokens": body.max_output_tokens,
                              "seed": body.seed, "user": body.user, "cache_salt": body.cache_salt,
                              "priority": body.priority, "tenant": body.tenant, "tenant_weight": body.tenant_weight}
    tools = chat_tools(body)
    if tools:
        fields["tools"] = tools
        fields["tool_choice"] = chat_tool_choice(body.tool_choice)
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    elif body.tool_choice not in (None, "none", "auto"):
        raise InvalidRequestError("tool_choice: is only allowed when tools are given", param="tool_choice")
    fields["response_format"] = chat_response_format(body)
    return {key: value for key, value in fields.items() if value is not None}


def output_items(message: dict[str, Any], finish_reason: str | None) -> list[dict[str, Any]]:
    """The output items of a chat completion's message."""
    status = "incomplete" if finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning))
    if message.get("content") or not message.get("tool_calls"):
        items.append(message_item(new_id("msg"), message.get("content") or "", status))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        items.append(function_call_item(new_id("fc"), call.get("id") or new_id("call"),
                                        function.get("name", ""), function.get("arguments", ""), "completed"))
    return items


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat message a later turn shows for this turn's output items."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    if calls:
        message["tool_calls"] = calls
    return message


def conversation_items(response_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a stored conversation as the Responses API's items, oldest first (for
    `GET /v1/responses/{id}/input_items`): user and system messages as `input_text`, assistant
    messages as `output_text` and `function_call` items, tool results as `function_call_output`.
    Ids are derived from the response id and the position, so they are the same on every read
    (the `after` cursor relies on that)."""
    items: list[dict[str, Any]] = []

    def item_id(prefix: str) -> str:
        return f"{prefix}_{hashlib.sha256(f'{response_id}/{len(items)}'.encode()).hexdigest()[:32]}"

    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "tool":
            items.append({"id": item_id("fco"), "type": "function_call_output", "call_id": message.get("tool_call_id"),
                          "output": content, "status": "completed"})
        elif role == "assistant":
            if content or not message.get("tool_calls"):
                items.append(message_item(item_id("msg"), content, "completed"))
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                items.append(function_call_item(item_id("fc"), call.get("id", ""), function.get("name", ""),
                                                function.get("arguments", ""), "completed"))
        else:
            items.append({"id": item_id("msg"), "type": "message", "role": role, "status": "completed",
                          "content": [{"type": "input_text", "text": content}]})
    return items


def response_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def response_object(body: ResponsesRequest, response_id: str, model: str, created_at: float, *,
                    status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    text_format = body.text.format if body.text and body.text.format else None
    return {
        "id": response_id, "object": "response", "created_at": int(created_at), "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                 else {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": body.truncation or "disabled",
        "usage": usage, "user": body.user, "metadata": body.metadata or {},
    }
