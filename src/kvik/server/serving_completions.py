"""POST /v1/completions: one or many prompts (text or token ids), echo, legacy logprobs.

With `echo` and `logprobs`, the prompt's tokens come back one-to-one with the prompt ids (the first
has no logprob), which is how lm-evaluation-harness scores log-likelihoods. `max_tokens: 0` with
`echo` scores the prompt without generating (one token is computed and dropped).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvik.core.errors import InvalidRequestError
from kvik.core.outputs import Logprob, PromptLogprobs, RequestOutput
from kvik.core.tokenizer import Tokenizer
from kvik.protocol.openai import CompletionRequest
from kvik.protocol.sse import DONE_FRAME, sse_frame
from kvik.server.serving_common import (Admission, CallRecord, ChoiceAccumulator, SSEResponse,
                                        merged, resolve_max_tokens, sampling_params,
                                        top_alternatives, tracked_generate, unless_disconnected,
                                        usage)
from kvik.server.state import ServerState

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the completions API


def normalize_prompts(prompt: Any, tokenizer: Tokenizer) -> list[tuple[str, list[int]]]:
    """(text, token ids) per prompt, from any of the four accepted shapes."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise InvalidRequestError("prompt: is empty", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    result = []
    for item in prompt:
        if isinstance(item, str):
            try:
                ids = tokenizer.encode(item)
            except Exception as exc:  # e.g. lone surrogates
                raise InvalidRequestError(f"prompt: could not be tokenized ({exc})", param="prompt")
            result.append((item, ids))
        else:
            result.append((tokenizer.decode(list(item), skip_special_tokens=False), list(item)))
    return result


def completion_logprobs(tokenizer: Tokenizer, k: int, token_ids: list[int],
                        entries: list[dict[int, Logprob] | None], offset: int) -> dict[str, Any]:
    """The legacy shape: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        text = tokenizer.token_text(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:  # the first prompt token: nothing precedes it
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(entry[token].logprob)
        tops.append({lp.decoded_token or "": lp.logprob for _, lp in top_alternatives(entry, k)})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


class CompletionServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        state = self.state
        engine = state.require_engine()
        model = state.resolve_model(body.model)
        llm = engine.engine
        tokenizer = llm.tokenizer
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequestError("best_of: only best_of == n is supported", param="best_of")
        score_only = body.echo and body.max_tokens == 0
        if body.max_tokens == 0 and not body.echo:
            raise InvalidRequestError("max_tokens: must be at least 1 (0 only with echo)",
                                      param="max_tokens")
        prompts = normalize_prompts(body.prompt, tokenizer)
        k = body.logprobs
        calls = []
        for index, (text, ids) in enumerate(prompts):
            try:
                llm.validate_prompt(ids)
            except InvalidRequestError as exc:
                if len(prompts) > 1:
                    exc.message = f"prompt {index}: {exc.message}"
                raise
            if score_only:
                max_tokens = resolve_max_tokens(1, len(ids), llm.max_model_len, "prompt")
            elif body.max_tokens is None:
                room = llm.max_model_len - len(ids)
                max_tokens = resolve_max_tokens(min(DEFAULT_MAX_TOKENS, room), len(ids),
                                                llm.max_model_len, "prompt")
            else:
                max_tokens = resolve_max_tokens(body.max_tokens, len(ids), llm.max_model_len, "prompt")
            params = sampling_params(body, max_tokens, llm.model_config.vocab_size, logprobs=k,
                                     prompt_logprobs=k if body.echo and k is not None else None)
            calls.append((text, ids, params, CallRecord(prompt_tokens=len(ids))))

        request_id = f"cmpl-{uuid.uuid4().hex}"
        total = body.n * len(calls)
        admission = Admission(state, total, request_id=request_id, endpoint="completions", model=model,
                              arrival=arrival, records=[c[3] for c in calls], stream=body.stream,
                              prompt=[c[0] for c in calls])
        streams = [tracked_generate(state, f"{request_id}-{i}", ids, params, arrival, record)
                   for i, (_, ids, params, record) in enumerate(calls)]
        context = _Context(body, tokenizer, request_id, model, int(arrival), calls, score_only)
        if body.stream:
            return SSEResponse(self._stream(context, streams), on_close=admission.release)
        try:
            result = await unless_disconnected(raw, self._collect(streams))
        finally:
            admission.release()
        return JSONResponse(self._response(context, *result))

    @staticmethod
    async def _collect(streams: list[AsyncIterator[RequestOutput]]
                       ) -> tuple[dict[tuple[int, int], ChoiceAccumulator], dict[int, PromptLogprobs]]:
        choices: dict[tuple[int, int], ChoiceAccumulator] = {}
        prompt_logprobs: dict[int, PromptLogprobs] = {}
        async for prompt_index, output in merged(streams):
            if output.prompt_logprobs is not None:
                prompt_logprobs[prompt_index] = output.prompt_logprobs
            for delta in output.outputs:
                choices.setdefault((prompt_index, delta.index), ChoiceAccumulator()).add(delta)
        return choices, prompt_logprobs

    @staticmethod
    def _response(ctx: _Context, choices: dict[tuple[int, int], ChoiceAccumulator],
                  prompt_logprobs: dict[int, PromptLogprobs]) -> dict[str, Any]:
        body = ctx.body
        out = []
        for (prompt_index, index), choice in sorted(choices.items()):
            text, ids, _, _ = ctx.calls[prompt_index]
            generated_text, token_ids, entries = "".join(choice.text), choice.token_ids, choice.logprobs
            if ctx.score_only:
                generated_text, token_ids, entries = "", [], []
            full_text = (text if body.echo else "") + generated_text
            logprobs = None
            if body.logprobs is not None:
                all_ids: list[int] = list(token_ids)
                all_entries: list[dict[int, Logprob] | None] = list(entries)
                if body.echo:
                    all_ids = ids + all_ids
                    all_entries = list(prompt_logprobs.get(prompt_index) or [None] * len(ids)) + all_entries
                logprobs = completion_logprobs(ctx.tokenizer, body.logprobs, all_ids, all_entries, 0)
            out.append({"index": prompt_index * body.n + index, "text": full_text, "logprobs": logprobs,
                        "finish_reason": "length" if ctx.score_only else choice.finish_reason,
                        "stop_reason": choice.stop_reason})
        records = [c[3] for c in ctx.calls]
        completion_tokens = 0 if ctx.score_only else sum(r.completion_tokens for r in records)
        return {"id": ctx.request_id, "object": "text_completion", "created": ctx.created,
                "model": ctx.model, "system_fingerprint": None, "choices": out,
                "usage": usage(sum(r.prompt_tokens for r in records), completion_tokens,
                               sum(r.cached_tokens for r in records))}

    @staticmethod
    async def _stream(ctx: _Context, streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[bytes]:
        body = ctx.body
        include_usage = body.include_usage_chunk
        echoed: set[tuple[int, int]] = set()
        offsets: dict[tuple[int, int], int] = {}

        def chunk(choice: dict[str, Any]) -> bytes:
            payload: dict[str, Any] = {"id": ctx.request_id, "object": "text_completion",
                                       "created": ctx.created, "model": ctx.model,
                                       "system_fingerprint": None, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return sse_frame(payload)

        try:
            async for prompt_index, output in merged(streams):
                text, ids, _, _ = ctx.calls[prompt_index]
                for delta in output.outputs:
                    key = (prompt_index, delta.index)
                    piece, token_ids = delta.text, list(delta.token_ids)
                    entries: list[dict[int, Logprob] | None] = list(delta.logprobs or [])
                    if ctx.score_only:
                        piece, token_ids, entries = "", [], []
                    if body.echo and key not in echoed:
                        echoed.add(key)
                        piece = text + piece
                        token_ids = ids + token_ids
                        entries = list(output.prompt_logprobs or [None] * len(ids)) + entries
                    if not piece and not delta.finish_reason and not token_ids:
                        continue
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = completion_logprobs(ctx.tokenizer, body.logprobs, token_ids, entries,
                                                       offsets.get(key, 0))
                        offsets[key] = offsets.get(key, 0) + sum(len(t) for t in logprobs["tokens"])
                    finish = delta.finish_reason
                    if ctx.score_only and finish is not None:
                        finish = "length"
                    yield chunk({"index": prompt_index * body.n + delta.index, "text": piece,
                                 "logprobs": logprobs, "finish_reason": finish,
                                 "stop_reason": delta.stop_reason})
        except Exception as exc:  # the engine failed mid-stream; tell the client in-band
            yield sse_frame({"error": {"message": f"generation failed: {exc}", "type": "server_error",
                                       "param": None, "code": None}})
        if include_usage:
            records = [c[3] for c in ctx.calls]
            completion_tokens = 0 if ctx.score_only else sum(r.completion_tokens for r in records)
            yield sse_frame({"id": ctx.request_id, "object": "text_completion", "created": ctx.created,
                             "model": ctx.model, "system_fingerprint": None, "choices": [],
                             "usage": usage(sum(r.prompt_tokens for r in records), completion_tokens,
                                            sum(r.cached_tokens for r in records))})
        yield DONE_FRAME


class _Context:
    """What the response builders need about one completions request."""

    __slots__ = ("body", "tokenizer", "request_id", "model", "created", "calls", "score_only")

    def __init__(self, body: CompletionRequest, tokenizer: Tokenizer, request_id: str, model: str,
                 created: int, calls: list[tuple[str, list[int], Any, CallRecord]],
                 score_only: bool) -> None:
        self.body, self.tokenizer, self.request_id, self.model = body, tokenizer, request_id, model
        self.created, self.calls, self.score_only = created, calls, score_only
