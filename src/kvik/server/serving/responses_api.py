"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat path.

A Responses request is turned into the chat request that means the same (`responses_items`) and
prepared, admitted and run exactly as chat is; its output is read from the chat completion (or its
chunks) and reshaped into output items, or into the Responses API's typed stream events:

    response.created, response.in_progress,
    per item: response.output_item.added, [response.content_part.added,
              response.output_text.delta..., response.output_text.done, response.content_part.done |
              response.function_call_arguments.delta..., response.function_call_arguments.done],
              response.output_item.done,
    response.completed (or response.incomplete when max_output_tokens ran out, response.failed)

`store` keeps the response and its conversation in SQLite (`response_store`); `previous_response_id`
continues it. The new prompt is rendered from the whole conversation, and when the template renders
the earlier turns unchanged, it is built from the previous turn's exact prompt and output token ids
followed by the tokens of the new text: the previous turn's KV blocks are then found in the prefix
cache. As OpenAI does, a previous response's `instructions` are not carried over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from kvik.core.errors import ContextLengthExceededError, InvalidRequestError, KvikError, NotFoundError
from kvik.core.outputs import RequestOutput
from kvik.engine.async_llm import AsyncLLM
from kvik.engine.input_processor import text_size
from kvik.engine.preprocess_pool import RenderedPrompt
from kvik.protocol.openai import ChatCompletionRequest
from kvik.protocol.responses import ResponsesRequest
from kvik.protocol.sse import sse_frame
from kvik.server.serving import responses_items as items
from kvik.server.serving.chat import ChatServing
from kvik.server.serving.preprocess import PreparedRequest, messages_for_template, prepare_chat
from kvik.server.serving.response_store import ResponseStore, StoredConversation, StoredResponse
from kvik.server.serving.streams import SSEResponse, unless_disconnected
from kvik.server.serving.tools import template_tools
from kvik.server.serving.tracking import Admission, tracked_generate
from kvik.server.state import ServerState


@dataclass(slots=True)
class EngineText:
    """What the engine produced, before the chat layer reads it (tool-call parsing may change the
    text): the exact tokens and their text, for the next turn's prompt."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


async def recorded(stream: AsyncIterator[RequestOutput], sink: EngineText) -> AsyncIterator[RequestOutput]:
    try:
        async for output in stream:
            for completion in output.outputs:
                sink.token_ids.extend(completion.token_ids)
                sink.text.append(completion.text)
            yield output
    finally:
        await stream.aclose()


@dataclass(slots=True)
class Turn:
    """One Responses call on its way through the chat path."""

    body: ResponsesRequest
    chat: ChatCompletionRequest
    history: list[dict[str, Any]]  # chat messages of the conversation, without instructions
    prepared: PreparedRequest
    response_id: str = field(default_factory=lambda: items.new_id("resp"))


class ResponsesServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.store = ResponseStore(state.config.responses_store, state.config.responses_retention_s)

    # -- GET / DELETE --

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = await self.store.load(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return stored.response

    async def input_items(self, response_id: str, *, after: str | None, limit: int, order: str) -> dict[str, Any]:
        """The items that made up a stored response's input (its whole conversation before the
        answer), newest first unless `order` is asc, `limit` at a time after the item `after`."""
        stored = await self.store.load(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        every = items.conversation_items(response_id, stored.conversation.messages[:-1])  # the last: the answer
        if order == "desc":
            every.reverse()
        start = 0
        if after is not None:
            ids = [item["id"] for item in every]
            if after not in ids:
                raise InvalidRequestError(f"after: {after[:64]!r} is not an input item of {response_id}; send the "
                                          f"id of an item of an earlier page (its last_id)", param="after")
            start = ids.index(after) + 1
        page = every[start:start + limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(every)}

    async def delete(self, response_id: str) -> dict[str, Any]:
        if not await self.store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    # -- POST --

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        turn = await self._prepare(body)
        if body.stream:
            admission, stream, engine_text = self._start(turn, raw)
            return SSEResponse(self._events(turn, stream, engine_text, admission), on_close=admission.release)
        return JSONResponse(await self._complete(turn, raw))

    async def response_body(self, body: ResponsesRequest) -> dict[str, Any]:
        """The response object of a non-streamed request with no client connection (a batch line)."""
        return await self._complete(await self._prepare(body), None)

    def _start(self, turn: Turn, raw: Request | None = None
               ) -> tuple[Admission, AsyncIterator[RequestOutput], EngineText]:
        prompt = turn.prepared.prompts[0]
        admission = Admission(self.state, 1, request_id=turn.response_id, endpoint="responses",
                              model=turn.prepared.model, arrival=turn.prepared.arrival,
                              records=[prompt.record], stream=turn.body.stream, prompt=prompt.text,
                              reserve=raw is not None)
        engine_text = EngineText()
        stream = recorded(tracked_generate(self.state, turn.prepared.engine, prompt.request, prompt.text,
                                           prompt.record), engine_text)
        return admission, stream, engine_text

    async def _complete(self, turn: Turn, raw: Request | None) -> dict[str, Any]:
        """`raw` is the client's connection; None for a batch line."""
        admission, stream, engine_text = self._start(turn, raw)
        try:
            choices = await unless_disconnected(raw, ChatServing.collect(stream))
        except Exception as exc:
            admission.fail(getattr(exc, "http_status", 500), str(exc))
            raise
        finally:
            admission.release()
        completion = ChatServing.completion_body(turn.chat, turn.prepared, choices)
        choice = completion["choices"][0]
        output = items.output_items(choice["message"], choice["finish_reason"])
        response = self._response(turn, "incomplete" if choice["finish_reason"] == "length" else "completed",
                                  output)
        await self._store(turn, response, output, engine_text)
        return response

    async def _prepare(self, body: ResponsesRequest) -> Turn:
        engine, _ = await self.state.engine_for(body.model)
        engine.input_processor.check_task("generate")
        previous = await self._previous(body)
        history = (previous.conversation.messages if previous else []) + items.input_messages(body.input)
        try:
            return await self._prepare_history(body, history, engine, previous)
        except ContextLengthExceededError as exc:
            if body.truncation != "auto":
                raise
            error = exc
        # truncation "auto": drop the fewest whole turns from the start of the conversation (a turn
        # starts at a user message; the current input is never dropped) that make it fit, found by
        # bisection over the turn boundaries, so a long conversation is rendered a few times only.
        starts = [i for i, message in enumerate(history) if message["role"] == "user" and i > 0]
        low, high, fitted = 0, len(starts) - 1, None
        while low <= high:
            middle = (low + high) // 2
            try:
                fitted = await self._prepare_history(body, history[starts[middle]:], engine, None)
                high = middle - 1
            except ContextLengthExceededError as exc:
                low, error = middle + 1, exc
        if fitted is None:  # even the current input alone (the last probe) is too long: its error says so
            raise error
        return fitted

    async def _prepare_history(self, body: ResponsesRequest, history: list[dict[str, Any]], engine: AsyncLLM,
                               previous: StoredResponse | None) -> Turn:
        """The turn over `history` (without instructions); `previous`: continue its exact tokens."""
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
        try:
            chat = ChatCompletionRequest.model_validate(items.chat_fields(body, messages))
        except ValidationError as exc:
            raise _chat_validation_error(exc) from None
        rendered = None
        if previous is not None:
            rendered = await continuation(engine, previous.conversation, messages_for_template(chat.messages),
                                          template_tools(chat))
        try:
            prepared = await prepare_chat(self.state, chat, rendered=rendered)
        except InvalidRequestError as exc:
            # The chat path's names for what the Responses API calls input and max_output_tokens.
            for chat_name, name in (("messages", "input"), ("max_tokens", "max_output_tokens"),
                                    ("response_format.json_schema", "text.format"),
                                    ("response_format", "text.format")):
                exc.message = exc.message.replace(chat_name, name)
                if exc.param is not None and (exc.param == chat_name or exc.param.startswith(chat_name + ".")):
                    exc.param = name + exc.param[len(chat_name):]
            raise
        return Turn(body, chat, history, prepared)

    async def _previous(self, body: ResponsesRequest) -> StoredResponse | None:
        if body.previous_response_id is None:
            return None
        previous = await self.store.load(body.previous_response_id)
        # Another tenant's response (the gateway salts each tenant's requests) is not there for you.
        if previous is None or previous.conversation.cache_salt != body.cache_salt:
            raise _not_found(body.previous_response_id, "previous_response_id")
        return previous

    def _response(self, turn: Turn, status: str, output: list[dict[str, Any]],
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        record = turn.prepared.prompts[0].record
        usage = items.response_usage(record.prompt_tokens, record.completion_tokens, record.cached_tokens)
        return items.response_object(turn.body, turn.response_id, turn.prepared.model, turn.prepared.arrival,
                                     status=status, output=output,
                                     usage=usage if status != "in_progress" else None, error=error)

    async def _store(self, turn: Turn, response: dict[str, Any], output: list[dict[str, Any]],
                     engine_text: EngineText) -> None:
        if not turn.body.store:
            return
        prompt = turn.prepared.prompts[0]
        conversation = StoredConversation(
            messages=turn.history + [items.assistant_message(output)], prompt_text=prompt.text or "",
            prompt_token_ids=list(prompt.token_ids), output_text="".join(engine_text.text),
            output_token_ids=engine_text.token_ids, cache_salt=turn.body.cache_salt,
            instructions=turn.body.instructions)
        await self.store.save(StoredResponse(turn.response_id, response, conversation))

    # -- streaming --

    async def _events(self, turn: Turn, stream: AsyncIterator[RequestOutput], engine_text: EngineText,
                      admission: Admission) -> AsyncIterator[bytes]:
        events = StreamEvents()
        yield events.frame("response.created", response=self._response(turn, "in_progress", []))
        yield events.frame("response.in_progress", response=self._response(turn, "in_progress", []))
        finish_reason = None
        try:
            async for chunk in ChatServing.chunk_stream(turn.chat, turn.prepared, stream):
                for choice in chunk["choices"]:
                    for frame in events.delta(choice.get("delta") or {}):
                        yield frame
                    finish_reason = choice.get("finish_reason") or finish_reason
        except Exception as exc:  # noqa: BLE001 - the engine failed mid-stream: the response failed
            status, error = _failure(exc)
            admission.fail(status, error["message"])
            yield events.frame("response.failed",
                               response=self._response(turn, "failed", events.output, error))
            return
        for frame in events.close_all("incomplete" if finish_reason == "length" else "completed"):
            yield frame
        status = "incomplete" if finish_reason == "length" else "completed"
        response = self._response(turn, status, events.output)
        await self._store(turn, response, events.output, engine_text)
        yield events.frame(f"response.{status}", response=response)


class StreamEvents:
    """Turns chat chunk deltas into the Responses API's item events, numbering every event."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items as they stand
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        self.tool_items: dict[int, dict[str, Any]] = {}  # chat tool-call index -> function_call item

    def frame(self, kind: str, **payload: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\n" + sse_frame(event)

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        frames: list[bytes] = []
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            frames += self._text_delta("reasoning", reasoning)
        if delta.get("content"):
            frames += self._text_delta("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            frames += self._tool_delta(call)
        return frames

    def _start(self, item: dict[str, Any]) -> list[bytes]:
        frames = self._close_open("completed")
        self.output.append(item)
        self.open = item
        frames.append(self.frame("response.output_item.added", output_index=len(self.output) - 1, item=item))
        return frames

    def _text_delta(self, kind: str, text: str) -> list[bytes]:
        frames: list[bytes] = []
        item = self.open
        if item is None or item["type"] != kind:
            new = (items.message_item(items.new_id("msg"), None, "in_progress") if kind == "message"
                   else items.reasoning_item(items.new_id("rs"), None))
            frames += self._start(new)
            item = new
            part = items.output_text_part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
            item["content"].append(part)
            frames.append(self.frame("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.output) - 1, content_index=0, part=dict(part)))
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        frames.append(self.frame(name, item_id=item["id"], output_index=self.output.index(item),
                                 content_index=0, delta=text, **extra))
        return frames

    def _tool_delta(self, call: dict[str, Any]) -> list[bytes]:
        frames: list[bytes] = []
        function = call.get("function") or {}
        item = self.tool_items.get(call.get("index", 0))
        if item is None:
            item = items.function_call_item(items.new_id("fc"), call.get("id") or items.new_id("call"),
                                            function.get("name") or "", "", "in_progress")
            self.tool_items[call.get("index", 0)] = item
            frames += self._start(item)
        elif function.get("name"):
            item["name"] += function["name"]
        piece = function.get("arguments")
        if piece:
            item["arguments"] += piece
            frames.append(self.frame("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=piece))
        return frames

    def _close_open(self, status: str) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        frames = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            if item["type"] == "message":
                frames.append(self.frame("response.output_text.done", item_id=item["id"], output_index=index,
                                         content_index=0, text=part["text"], logprobs=[]))
            else:
                frames.append(self.frame("response.reasoning_text.done", item_id=item["id"],
                                         output_index=index, content_index=0, text=part["text"]))
            frames.append(self.frame("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=dict(part)))
            if item["type"] == "message":
                item["status"] = status
        else:
            item["status"] = "completed"
            frames.append(self.frame("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        frames.append(self.frame("response.output_item.done", output_index=index, item=item))
        return frames

    def close_all(self, status: str) -> list[bytes]:
        if not self.output:  # nothing was generated: still one (empty) message, as non-streaming has
            frames = self._start(items.message_item(items.new_id("msg"), None, "in_progress"))
            item = self.output[0]
            item["content"].append(items.output_text_part(""))
            frames.append(self.frame("response.content_part.added", item_id=item["id"], output_index=0,
                                     content_index=0, part=items.output_text_part("")))
            return frames + self._close_open(status)
        return self._close_open(status)


async def continuation(engine: AsyncLLM, previous: StoredConversation, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None) -> RenderedPrompt:
    """The prompt for a turn that continues `previous`: rendered from the whole conversation, and
    when that text starts with the previous prompt and answer exactly, made of the previous turn's
    own token ids (minus its closing end-of-turn token, which the template writes again) and the
    new text's tokens, so the previous turn's KV blocks hit the prefix cache."""
    size = text_size(messages)
    rendered = await engine.render_chat(messages, tools=tools, input_bytes=size)
    tokenizer = engine.tokenizer
    output_ids = list(previous.output_token_ids)
    stop_ids = set(engine.info.eos_token_ids) | tokenizer.special_ids
    while output_ids and output_ids[-1] in stop_ids:
        output_ids.pop()
    prefix = previous.prompt_text + previous.output_text
    if (not previous.prompt_token_ids or not rendered.text.startswith(prefix)
            or tokenizer.decode(output_ids, skip_special_tokens=False) != previous.output_text):
        return rendered
    rest = tokenizer.encode(rendered.text[len(prefix):], add_special_tokens=False)
    return RenderedPrompt(rendered.text, previous.prompt_token_ids + output_ids + rest)


# Chat fields a Responses request fills from its own fields of another name.
_RESPONSES_NAMES = {"tools": "tools", "tool_choice": "tool_choice", "response_format": "text.format",
                    "parallel_tool_calls": "parallel_tool_calls"}


def _chat_validation_error(exc: ValidationError) -> InvalidRequestError:
    """A 400 naming the Responses field behind the chat field that failed validation: a bad tool
    definition names `tools`, a bad schema `text.format`, anything else the conversation (`input`)."""
    first = exc.errors()[0]
    loc = tuple(first.get("loc", ()))
    where = ".".join(map(str, loc))
    name = _RESPONSES_NAMES.get(str(loc[0])) if loc else None
    if name is None:
        return InvalidRequestError(f"input: {first.get('msg')} (at {where} of the conversation)", param="input")
    return InvalidRequestError(f"{name}: {first.get('msg')} (at {where} of the equivalent chat request)",
                               param=name)


def _failure(exc: BaseException) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, KvikError):
        return exc.http_status, {"code": exc.code or exc.error_type, "message": exc.message}
    return 500, {"code": "server_error", "message": f"generation failed: {type(exc).__name__}"}


def _not_found(response_id: str, param: str) -> NotFoundError:
    return NotFoundError(f"Response with id {response_id!r} not found (it was not stored, was deleted, "
                         "or belongs to someone else).", param=param)
