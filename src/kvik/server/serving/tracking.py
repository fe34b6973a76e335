"""What the server records about each request: per-call token counts and latencies (for usage,
metrics and the request log), and the admission slot it holds until it ends."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from kvik.core import tracing
from kvik.core.outputs import RequestOutput
from kvik.engine.async_llm import AsyncLLM
from kvik.engine.messages import EngineCoreRequest
from kvik.server.state import ServerState
from kvik.server.tracing import annotate_usage

request_log = logging.getLogger("kvik.server.requests")


@dataclass(slots=True)
class CallRecord:
    """What the request log line and the usage numbers need from one engine call."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # when the engine first planned a step with it
    finish_reasons: list[str] = field(default_factory=list)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def records_usage(records: list[CallRecord], count_completion: bool = True) -> dict[str, Any]:
    return usage(sum(r.prompt_tokens for r in records),
                 sum(r.completion_tokens for r in records) if count_completion else 0,
                 sum(r.cached_tokens for r in records))


async def tracked_generate(state: ServerState, engine: AsyncLLM, request: EngineCoreRequest,
                           prompt: str | None, record: CallRecord) -> AsyncIterator[RequestOutput]:
    """The engine's output stream for one prompt, observed for metrics (per model and tier)."""
    metrics = state.metrics
    # A LoRA adapter's requests count under the adapter's name (per-adapter latency and tokens).
    model, tier = request.lora_name or state.served_name(engine), metrics.tier(request.priority)
    arrival = request.arrival_time
    last: float | None = None
    async for output in engine.generate(request, prompt):
        now = time.time()
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        if new_tokens:
            if last is None:
                metrics.time_to_first_token(model, tier, now - arrival)
                metrics.tokens(model, tier, len(request.prompt_token_ids), 0)
                record.first_token_time = now
            else:
                # One output may bring several tokens (a multi-step run, accepted drafts): the gap
                # is shared among them, one observation each, so the histogram stays per token.
                gap = (now - last) / new_tokens
                for _ in range(new_tokens):
                    metrics.inter_token_latency(model, gap)
            metrics.tokens(model, tier, 0, new_tokens)
            last = now
        record.completion_tokens += new_tokens
        record.cached_tokens = output.num_cached_tokens
        if record.first_scheduled_time is None and output.metrics is not None:
            record.first_scheduled_time = output.metrics.first_scheduled_time
        for choice in output.outputs:
            if choice.finish_reason is not None:
                metrics.finished(choice.finish_reason, model)
                record.finish_reasons.append(choice.finish_reason)
        if output.finished:
            metrics.e2e_latency(model, tier, now - arrival)
            scheduled = output.metrics.first_scheduled_time if output.metrics else None
            if scheduled is not None:
                metrics.queue_time(model, tier, max(0.0, scheduled - arrival))
        yield output


class Admission:
    """Capacity reserved for one HTTP request's sequences. `release` gives it back and writes the
    request log line, exactly once, however the request ends, with the status it really ended with
    (a stream that failed half-way is not a 200 in the log)."""

    def __init__(self, state: ServerState, num_sequences: int, *, request_id: str, endpoint: str,
                 model: str, arrival: float, records: list[CallRecord], stream: bool,
                 prompt: Any, reserve: bool = True) -> None:
        # Batch lines (reserve=False) have their own concurrency limit and never take the
        # capacity interactive clients are admitted against.
        num_sequences = num_sequences if reserve else 0
        if num_sequences:
            state.admit(num_sequences)
        self.state, self.num_sequences = state, num_sequences
        self.log = dict(request_id=request_id, endpoint=endpoint, model=model, arrival=arrival,
                        records=records, stream=stream, prompt=prompt)
        self.released = False
        self.status = 200
        self.error: str | None = None

    def fail(self, status: int, error: str) -> None:
        """The request failed after it was admitted (an engine error, a dead engine)."""
        self.status, self.error = status, error

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.state.release(self.num_sequences)
            annotate_usage(self.log["records"])
            log_request(self.state, status=self.status, error=self.error, **self.log)


def log_request(state: ServerState, *, request_id: str, endpoint: str, model: str, status: int,
                arrival: float, records: list[CallRecord], stream: bool, prompt: Any = None,
                error: str | None = None) -> None:
    """One structured line per request; prompt text only with --log-prompts."""
    now = time.time()
    first = min((r.first_token_time for r in records if r.first_token_time), default=None)
    scheduled = min((r.first_scheduled_time for r in records if r.first_scheduled_time), default=None)
    line: dict[str, Any] = {
        "event": "request", "id": request_id, "endpoint": endpoint, "model": model, "status": status,
        "stream": stream, "prompt_tokens": sum(r.prompt_tokens for r in records),
        "completion_tokens": sum(r.completion_tokens for r in records),
        "cached_tokens": sum(r.cached_tokens for r in records),
        "latency_ms": round((now - arrival) * 1000, 1),
        "ttft_ms": round((first - arrival) * 1000, 1) if first else None,
        # Arrival to the engine's first step with it: the wait for the queue and the running step.
        "queue_ms": round(max(0.0, scheduled - arrival) * 1000, 1) if scheduled else None,
        "finish_reasons": [reason for r in records for reason in r.finish_reasons],
    }
    if error is not None:
        line["error"] = error
    if tracing.enabled():
        line["trace_id"] = tracing.current_trace_id()
    if state.config.log_prompts and prompt is not None:
        line["prompt"] = prompt
    request_log.info(json.dumps(line, ensure_ascii=False))
