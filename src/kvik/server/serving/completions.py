"""POST /v1/completions: one or many prompts (text or token ids), echo, legacy logprobs.

With `echo` and `logprobs`, the prompt's tokens come back one-to-one with the prompt ids (the first
has no logprob), which is how lm-evaluation-harness scores log-likelihoods. `max_tokens: 0` with
`echo` scores the prompt without generating (one token is computed and dropped).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvik.core.outputs import Logprob, PromptLogprobs, RequestOutput
from kvik.protocol.openai import CompletionRequest
from kvik.protocol.sse import DONE_FRAME, sse_frame
from kvik.server.serving.logprobs import completion_logprobs
from kvik.server.serving.preprocess import PreparedRequest, prepare_completion
from kvik.server.serving.streams import (ChoiceAccumulator, SSEResponse, failure_frame, merged,
                                         unless_disconnected)
from kvik.server.serving.tracking import Admission, records_usage, tracked_generate
from kvik.server.state import ServerState


class CompletionServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        state = self.state
        prepared = await prepare_completion(state, body)
        records = [p.record for p in prepared.prompts]
        admission = Admission(state, prepared.num_sequences, request_id=prepared.request_id,
                              endpoint="completions", model=prepared.model, arrival=prepared.arrival,
                              records=records, stream=body.stream, prompt=[p.text for p in prepared.prompts])
        streams = [tracked_generate(state, prepared.engine, p.request, p.text, p.record)
                   for p in prepared.prompts]
        if body.stream:
            return SSEResponse(self._stream(body, prepared, streams, admission), on_close=admission.release)
        try:
            result = await unless_disconnected(raw, self.collect(streams))
        except Exception as exc:
            admission.fail(getattr(exc, "http_status", 500), str(exc))
            raise
        finally:
            admission.release()
        return JSONResponse(self.completion_body(body, prepared, *result))

    @staticmethod
    def _score_only(body: CompletionRequest) -> bool:
        return body.echo and body.max_tokens == 0

    @staticmethod
    async def collect(streams: list[AsyncIterator[RequestOutput]]
                       ) -> tuple[dict[tuple[int, int], ChoiceAccumulator], dict[int, PromptLogprobs]]:
        choices: dict[tuple[int, int], ChoiceAccumulator] = {}
        prompt_logprobs: dict[int, PromptLogprobs] = {}
        async for prompt_index, output in merged(streams):
            if output.prompt_logprobs is not None:
                prompt_logprobs[prompt_index] = output.prompt_logprobs
            for delta in output.outputs:
                choices.setdefault((prompt_index, delta.index), ChoiceAccumulator()).add(delta)
        return choices, prompt_logprobs

    def completion_body(self, body: CompletionRequest, prepared: PreparedRequest,
                  choices: dict[tuple[int, int], ChoiceAccumulator],
                  prompt_logprobs: dict[int, PromptLogprobs]) -> dict[str, Any]:
        score_only = self._score_only(body)
        tokenizer = prepared.engine.tokenizer
        out = []
        for (prompt_index, index), choice in sorted(choices.items()):
            prompt = prepared.prompts[prompt_index]
            generated_text, token_ids, entries = "".join(choice.text), choice.token_ids, choice.logprobs
            if score_only:
                generated_text, token_ids, entries = "", [], []
            full_text = (prompt.text if body.echo else "") + generated_text
            logprobs = None
            if body.logprobs is not None:
                all_ids: list[int] = list(token_ids)
                all_entries: list[dict[int, Logprob] | None] = list(entries)
                if body.echo:
                    all_ids = prompt.token_ids + all_ids
                    all_entries = (list(prompt_logprobs.get(prompt_index) or [None] * len(prompt.token_ids))
                                   + all_entries)
                logprobs = completion_logprobs(tokenizer, body.logprobs, all_ids, all_entries, 0)
            out.append({"index": prompt_index * body.n + index, "text": full_text, "logprobs": logprobs,
                        "finish_reason": "length" if score_only else choice.finish_reason,
                        "stop_reason": choice.stop_reason})
        return {"id": prepared.request_id, "object": "text_completion", "created": int(prepared.arrival),
                "model": prepared.model, "system_fingerprint": None, "choices": out,
                "usage": records_usage([p.record for p in prepared.prompts], not score_only)}

    async def _stream(self, body: CompletionRequest, prepared: PreparedRequest,
                      streams: list[AsyncIterator[RequestOutput]], admission: Admission) -> AsyncIterator[bytes]:
        include_usage = body.include_usage_chunk
        score_only = self._score_only(body)
        tokenizer = prepared.engine.tokenizer
        echoed: set[tuple[int, int]] = set()
        offsets: dict[tuple[int, int], int] = {}
        header = {"id": prepared.request_id, "object": "text_completion", "created": int(prepared.arrival),
                  "model": prepared.model, "system_fingerprint": None}

        def chunk(choice: dict[str, Any]) -> bytes:
            payload: dict[str, Any] = {**header, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return sse_frame(payload)

        try:
            async for prompt_index, output in merged(streams):
                prompt = prepared.prompts[prompt_index]
                for delta in output.outputs:
                    key = (prompt_index, delta.index)
                    piece, token_ids = delta.text, list(delta.token_ids)
                    entries: list[dict[int, Logprob] | None] = list(delta.logprobs or [])
                    if score_only:
                        piece, token_ids, entries = "", [], []
                    if body.echo and key not in echoed:
                        echoed.add(key)
                        piece = prompt.text + piece
                        token_ids = prompt.token_ids + token_ids
                        entries = list(output.prompt_logprobs or [None] * len(prompt.token_ids)) + entries
                    if not piece and not delta.finish_reason and not token_ids:
                        continue
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = completion_logprobs(tokenizer, body.logprobs, token_ids, entries,
                                                       offsets.get(key, 0))
                        offsets[key] = offsets.get(key, 0) + sum(len(t) for t in logprobs["tokens"])
                    finish = delta.finish_reason
                    if score_only and finish is not None:
                        finish = "length"
                    yield chunk({"index": prompt_index * body.n + delta.index, "text": piece,
                                 "logprobs": logprobs, "finish_reason": finish,
                                 "stop_reason": delta.stop_reason})
        except Exception as exc:  # noqa: BLE001 - the engine failed mid-stream: say so, no [DONE]
            yield failure_frame(exc, admission)
            return
        if include_usage:
            yield sse_frame({**header, "choices": [],
                             "usage": records_usage([p.record for p in prepared.prompts], not score_only)})
        yield DONE_FRAME
