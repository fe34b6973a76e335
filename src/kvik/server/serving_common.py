"""Logic shared by the chat and completions endpoints: request -> SamplingParams, context checks,
a tracked engine call (metrics, admission release, request log), disconnect handling."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvik.core.errors import ContextLengthExceededError, InvalidRequestError
from kvik.core.outputs import CompletionOutput, Logprob, RequestOutput
from kvik.core.sampling_params import OutputKind, SamplingParams
from kvik.protocol.openai import _SamplingFields
from kvik.server.state import ServerState

request_log = logging.getLogger("kvik.server.requests")
T = TypeVar("T")


def resolve_max_tokens(requested: int | None, prompt_tokens: int, max_model_len: int,
                       where: str) -> int:
    """Output tokens to allow: the request's max_tokens if the context has room, else a 400 that
    names the limit and the counts (OpenAI's wording)."""
    room = max_model_len - prompt_tokens
    if room <= 0 or (requested is not None and requested > room):
        asked = prompt_tokens + (requested or 0)
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{asked} tokens ({prompt_tokens} in the {where}, {requested or 0} in the completion). "
            "Please reduce the length of the prompt or of max_tokens.",
            param="max_tokens" if room > 0 else where)
    return requested if requested is not None else room


def logit_bias_ids(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    parsed = {int(key): value for key, value in bias.items()}
    bad = [t for t in parsed if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                                  f"[0, {vocab_size})", param="logit_bias")
    return parsed


def sampling_params(req: _SamplingFields, max_tokens: int, vocab_size: int, *, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """OpenAI defaults where the request is silent: temperature 1, top_p 1."""
    return SamplingParams(
        n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
        min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty or 1.0,
        logit_bias=logit_bias_ids(req.logit_bias, vocab_size), seed=req.seed, max_tokens=max_tokens,
        min_tokens=min(req.min_tokens, max_tokens), stop=list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
        output_kind=OutputKind.DELTA,
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def top_alternatives(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of a logprob entry, most likely first."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda x: x[1].rank)[:k]


@dataclass(slots=True)
class ChoiceAccumulator:
    """Collects a choice's deltas for a non-streaming response."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass(slots=True)
class CallRecord:
    """What the request log line and the usage numbers need from one engine call."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_time: float | None = None
    finish_reasons: list[str] = field(default_factory=list)


async def tracked_generate(state: ServerState, request_id: str, prompt_ids: list[int],
                           params: SamplingParams, arrival: float, record: CallRecord
                           ) -> AsyncIterator[RequestOutput]:
    """The engine's output stream for one prompt, observed for metrics."""
    metrics = state.metrics
    last: float | None = None
    async for output in state.engine.generate(request_id, prompt_ids, params, arrival_time=arrival):
        now = time.time()
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        if new_tokens:
            if last is None:
                metrics.time_to_first_token.observe(now - arrival)
                record.first_token_time = now
            else:
                metrics.inter_token_latency.observe(now - last)
            last = now
        record.completion_tokens += new_tokens
        record.cached_tokens = output.num_cached_tokens
        for choice in output.outputs:
            if choice.finish_reason is not None:
                metrics.finished(choice.finish_reason)
                record.finish_reasons.append(choice.finish_reason)
        if output.finished:
            metrics.e2e_latency.observe(now - arrival)
            scheduled = output.metrics.first_scheduled_time if output.metrics else None
            if scheduled is not None:
                metrics.queue_time.observe(max(0.0, scheduled - arrival))
        yield output


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive, tagged with their position."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()  # abort now, not when the generator is collected
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))
            return
        await queue.put((index, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        # Let each pump see its cancellation, so every engine stream runs its abort/release code.
        await asyncio.gather(*tasks, return_exceptions=True)


class Admission:
    """Capacity reserved for one HTTP request's sequences. `release` gives it back and writes the
    request log line, exactly once, however the request ends."""

    def __init__(self, state: ServerState, num_sequences: int, *, request_id: str, endpoint: str,
                 model: str, arrival: float, records: list[CallRecord], stream: bool,
                 prompt: Any) -> None:
        state.admit(num_sequences)
        self.state, self.num_sequences = state, num_sequences
        self.log = dict(request_id=request_id, endpoint=endpoint, model=model, arrival=arrival,
                        records=records, stream=stream, prompt=prompt)
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.state.release(self.num_sequences)
            log_request(self.state, status=200, **self.log)


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, but cancel it (aborting its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


def log_request(state: ServerState, *, request_id: str, endpoint: str, model: str, status: int,
                arrival: float, records: list[CallRecord], stream: bool, prompt: Any = None) -> None:
    """One structured line per request; prompt text only with --log-prompts."""
    now = time.time()
    first = min((r.first_token_time for r in records if r.first_token_time), default=None)
    line: dict[str, Any] = {
        "event": "request", "id": request_id, "endpoint": endpoint, "model": model, "status": status,
        "stream": stream, "prompt_tokens": sum(r.prompt_tokens for r in records),
        "completion_tokens": sum(r.completion_tokens for r in records),
        "cached_tokens": sum(r.cached_tokens for r in records),
        "latency_ms": round((now - arrival) * 1000, 1),
        "ttft_ms": round((first - arrival) * 1000, 1) if first else None,
        "finish_reasons": [reason for r in records for reason in r.finish_reasons],
    }
    if state.config.log_prompts and prompt is not None:
        line["prompt"] = prompt
    request_log.info(json.dumps(line, ensure_ascii=False))


class SSEResponse(StreamingResponse):
    """An event stream that runs `on_close` when the response ends in any way (finished, client
    gone, server shutting down), even if the body generator never started: admission slots are
    released here, not in the generator."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Any) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
