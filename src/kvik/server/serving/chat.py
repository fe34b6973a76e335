"""POST /v1/chat/completions: a prepared request streamed as chunks or collected into one object.

`collect` + `completion_body` (one chat.completion object) and `chunk_stream` (chat.completion.chunk
objects as dicts) are also what the Responses API builds on (`kvik.server.serving.responses`): a
Responses request is a chat request, and its output is read from the chat objects.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvik.core.outputs import RequestOutput
from kvik.protocol.openai import ChatCompletionRequest
from kvik.protocol.sse import DONE_FRAME, sse_frame
from kvik.server.serving.logprobs import chat_logprobs
from kvik.server.serving.preprocess import PreparedRequest, prepare_chat
from kvik.server.serving.streams import (ChoiceAccumulator, SSEResponse, failure_frame,
                                         unless_disconnected)
from kvik.server.serving.tracking import Admission, CallRecord, tracked_generate, usage
from kvik.server.state import ServerState


class ChatServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        state = self.state
        prepared = await prepare_chat(state, body)
        prompt = prepared.prompts[0]
        admission = Admission(state, prepared.num_sequences, request_id=prepared.request_id,
                              endpoint="chat", model=prepared.model, arrival=prepared.arrival,
                              records=[prompt.record], stream=body.stream, prompt=prompt.text)
        stream = tracked_generate(state, prepared.engine, prompt.request, prompt.text, prompt.record)
        if body.stream:
            return SSEResponse(self._stream(body, prepared, stream, admission), on_close=admission.release)
        try:
            choices = await unless_disconnected(raw, self.collect(stream))
        except Exception as exc:
            admission.fail(getattr(exc, "http_status", 500), str(exc))
            raise
        finally:
            admission.release()
        return JSONResponse(self.completion_body(body, prepared, choices))

    @staticmethod
    async def collect(stream: AsyncIterator[RequestOutput]) -> dict[int, ChoiceAccumulator]:
        choices: dict[int, ChoiceAccumulator] = {}
        try:
            async for output in stream:
                for delta in output.outputs:
                    choices.setdefault(delta.index, ChoiceAccumulator()).add(delta)
        finally:
            await stream.aclose()
        return choices

    @staticmethod
    def completion_body(body: ChatCompletionRequest, prepared: PreparedRequest,
                        choices: dict[int, ChoiceAccumulator]) -> dict[str, Any]:
        record: CallRecord = prepared.prompts[0].record
        top_k = body.top_logprobs or 0
        out = []
        for index, choice in sorted(choices.items()):
            message, finish_reason = prepared.assistant.message("".join(choice.text), choice.finish_reason)
            out.append({
                "index": index, "message": message,
                "logprobs": chat_logprobs(choice.logprobs, choice.token_ids, top_k) if body.logprobs else None,
                "finish_reason": finish_reason, "stop_reason": choice.stop_reason,
            })
        return {
            "id": prepared.request_id, "object": "chat.completion", "created": int(prepared.arrival),
            "model": prepared.model, "system_fingerprint": None, "choices": out,
            "usage": usage(record.prompt_tokens, record.completion_tokens, record.cached_tokens),
        }

    @classmethod
    async def _stream(cls, body: ChatCompletionRequest, prepared: PreparedRequest,
                      stream: AsyncIterator[RequestOutput], admission: Admission) -> AsyncIterator[bytes]:
        try:
            async for chunk in cls.chunk_stream(body, prepared, stream):
                yield sse_frame(chunk)
        except Exception as exc:  # noqa: BLE001 - the engine failed mid-stream: say so, no [DONE]
            yield failure_frame(exc, admission)
            return
        yield DONE_FRAME

    @staticmethod
    async def chunk_stream(body: ChatCompletionRequest, prepared: PreparedRequest,
                           stream: AsyncIterator[RequestOutput]) -> AsyncIterator[dict[str, Any]]:
        """The chat.completion.chunk objects of a stream, as dicts; raises if the engine fails."""
        include_usage = body.include_usage_chunk
        record = prepared.prompts[0].record
        top_k = body.top_logprobs or 0
        header = {"id": prepared.request_id, "object": "chat.completion.chunk",
                  "created": int(prepared.arrival), "model": prepared.model, "system_fingerprint": None}

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            payload: dict[str, Any] = {**header, "choices": choices}
            if include_usage:
                payload["usage"] = None
            return payload

        choices = [prepared.assistant.stream() for _ in range(body.n)]
        for index in range(body.n):
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        try:
            async for output in stream:
                for delta in output.outputs:
                    finished = delta.finish_reason is not None
                    pieces = choices[delta.index].feed(delta.text, finished)
                    logprobs = (chat_logprobs(delta.logprobs or [], delta.token_ids, top_k)
                                if body.logprobs else None)
                    if not pieces and (finished or (body.logprobs and delta.token_ids)):
                        pieces = [{}]
                    finish = choices[delta.index].finish_reason(delta.finish_reason) if finished else None
                    for position, piece in enumerate(pieces):
                        last = position == len(pieces) - 1
                        yield chunk([{"index": delta.index, "delta": piece,
                                      "logprobs": logprobs if position == 0 else None,
                                      "finish_reason": finish if last else None}])
        finally:
            await stream.aclose()
        if include_usage:
            yield {**header, "choices": [],
                   "usage": usage(record.prompt_tokens, record.completion_tokens, record.cached_tokens)}
