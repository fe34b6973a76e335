"""POST /v1/chat/completions: messages through the model's chat template, then the engine."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvik.core.errors import InvalidRequestError
from kvik.core.outputs import Logprob, RequestOutput
from kvik.protocol.openai import ChatCompletionRequest, ChatMessage
from kvik.protocol.sse import DONE_FRAME, sse_frame
from kvik.server.serving_common import (Admission, CallRecord, ChoiceAccumulator, SSEResponse,
                                        resolve_max_tokens, sampling_params, top_alternatives,
                                        tracked_generate, unless_disconnected, usage)
from kvik.server.state import ServerState


def messages_for_template(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the chat template; text parts joined, `developer` treated as `system`
    (most templates know only the latter)."""
    converted = []
    for position, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"messages[{position}].content: part type {part.type!r} is not supported; "
                        "kvik serves text-only models, send text parts", param=f"messages.{position}.content")
                texts.append(part.text)
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                 "content": content or ""}
        for extra in ("name", "tool_call_id", "tool_calls"):
            value = getattr(message, extra)
            if value is not None:
                entry[extra] = value
        converted.append(entry)
    return converted


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], k: int) -> dict[str, Any]:
    content = []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        text = chosen.decoded_token or ""
        content.append({
            "token": text, "logprob": chosen.logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                              "bytes": list((lp.decoded_token or "").encode())}
                             for _, lp in top_alternatives(entry, k)],
        })
    return {"content": content}


class ChatServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        state = self.state
        engine = state.require_engine()
        model = state.resolve_model(body.model)
        llm = engine.engine
        tokenizer = llm.tokenizer
        template_kwargs = dict(body.chat_template_kwargs or {})
        text = tokenizer.apply_chat_template(messages_for_template(body.messages),
                                             add_generation_prompt=body.add_generation_prompt,
                                             tools=body.tools, **template_kwargs)
        try:
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        except Exception as exc:  # e.g. lone surrogates the tokenizer cannot encode
            raise InvalidRequestError(f"messages: could not be tokenized ({exc})", param="messages")
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if requested == 0:
            raise InvalidRequestError("max_tokens: must be at least 1 for chat", param="max_tokens")
        # The context check first, so an over-long conversation names `messages`, not `prompt`.
        max_tokens = resolve_max_tokens(requested, len(prompt_ids), llm.max_model_len, "messages")
        llm.validate_prompt(prompt_ids)
        top_k = body.top_logprobs or 0
        params = sampling_params(body, max_tokens, llm.model_config.vocab_size,
                                 logprobs=top_k if body.logprobs else None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        record = CallRecord(prompt_tokens=len(prompt_ids))
        admission = Admission(state, params.n, request_id=request_id, endpoint="chat", model=model,
                              arrival=arrival, records=[record], stream=body.stream, prompt=text)
        stream = tracked_generate(state, request_id, prompt_ids, params, arrival, record)
        if body.stream:
            return SSEResponse(self._stream(body, stream, request_id, model, int(arrival), record, top_k),
                               on_close=admission.release)
        try:
            result = await unless_disconnected(raw, self._collect(stream))
        finally:
            admission.release()
        return JSONResponse(self._response(body, result, request_id, model, int(arrival), record, top_k))

    @staticmethod
    async def _collect(stream: AsyncIterator[RequestOutput]) -> dict[int, ChoiceAccumulator]:
        choices: dict[int, ChoiceAccumulator] = {}
        try:
            async for output in stream:
                for delta in output.outputs:
                    choices.setdefault(delta.index, ChoiceAccumulator()).add(delta)
        finally:
            await stream.aclose()
        return choices

    @staticmethod
    def _response(body: ChatCompletionRequest, choices: dict[int, ChoiceAccumulator], request_id: str,
                  model: str, created: int, record: CallRecord, top_k: int) -> dict[str, Any]:
        return {
            "id": request_id, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{
                "index": index,
                "message": {"role": "assistant", "content": "".join(choice.text)},
                "logprobs": chat_logprobs(choice.logprobs, choice.token_ids, top_k) if body.logprobs else None,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            } for index, choice in sorted(choices.items())],
            "usage": usage(record.prompt_tokens, record.completion_tokens, record.cached_tokens),
        }

    @staticmethod
    async def _stream(body: ChatCompletionRequest, stream: AsyncIterator[RequestOutput], request_id: str,
                      model: str, created: int, record: CallRecord, top_k: int) -> AsyncIterator[bytes]:
        include_usage = body.include_usage_chunk

        def chunk(choices: list[dict[str, Any]]) -> bytes:
            payload: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk",
                                       "created": created, "model": model, "system_fingerprint": None,
                                       "choices": choices}
            if include_usage:
                payload["usage"] = None
            return sse_frame(payload)

        for index in range(body.n):
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        try:
            async for output in stream:
                for delta in output.outputs:
                    if not delta.text and not delta.finish_reason and not (body.logprobs and delta.token_ids):
                        continue
                    logprobs = (chat_logprobs(delta.logprobs or [], delta.token_ids, top_k)
                                if body.logprobs else None)
                    yield chunk([{"index": delta.index,
                                  "delta": {"content": delta.text} if delta.text else {},
                                  "logprobs": logprobs, "finish_reason": delta.finish_reason}])
        except Exception as exc:  # the engine failed mid-stream; tell the client in-band
            yield sse_frame({"error": {"message": f"generation failed: {exc}", "type": "server_error",
                                       "param": None, "code": None}})
        finally:
            await stream.aclose()
        if include_usage:
            yield sse_frame({"id": request_id, "object": "chat.completion.chunk", "created": created,
                             "model": model, "system_fingerprint": None, "choices": [],
                             "usage": usage(record.prompt_tokens, record.completion_tokens,
                                            record.cached_tokens)})
        yield DONE_FRAME
