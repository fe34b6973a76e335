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
        return {
            "id": prepared.request_id, "object": "chat.completion", "created": int(prepared.arrival),
            "model": prepared.model, "system_fingerprint": None,
            "choices": [{
                "index": index,
                "message": {"role": "assistant", "content": "".join(choice.text)},
                "logprobs": chat_logprobs(choice.logprobs, choice.token_ids, top_k) if body.logprobs else None,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            } for index, choice in sorted(choices.items())],
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
        finally:
            await stream.aclose()
        if include_usage:
            yield {**header, "choices": [],
                   "usage": usage(record.prompt_tokens, record.completion_tokens, record.cached_tokens)}
