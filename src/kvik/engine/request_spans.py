"""The engine's spans of one request, emitted by the front end from timestamps, not by the core.

Why here and not in the core process: the core's step loop serves every running sequence in one
thread, so per-request spans there would put the OpenTelemetry SDK (span objects, a locked batch
queue, an exporter thread) into the loop that sets throughput, and would need a second exporter
per replica. The timestamps that bound the phases already reach the front end: the core stamps
`first_scheduled_time` (time.time(), the same host clock) on its outputs, and the front end stamps
the first token and the end as they arrive. So the trace context never needs to cross the ZeroMQ
boundary and the core pays nothing.

Under the request's `generate` span (kvik.request_id, GenAI usage and finish reasons):
- `queue`: handed to the core -> first scheduled;
- `prefill`: first scheduled -> first token received (includes one hop over ZeroMQ, ~0.1 ms);
- `decode`: first token -> last output;
- `detokenize`: the stream's incremental detokenization, first token -> last output, interleaved
  with decode; `kvik.detokenize.busy_s` is the time actually spent in it.
A phase the request never reached (aborted while queued) is left out.
"""

from __future__ import annotations

import time
from typing import Any

from kvik.core import tracing
from kvik.engine.output_processor import RequestState


def start_generate_span(request_id: str, num_prompt_tokens: int, max_tokens: int) -> Any:
    """The request's `generate` span, child of the current span; None when not traced."""
    return tracing.start_span("generate", attributes={
        "kvik.request_id": request_id, "gen_ai.usage.input_tokens": num_prompt_tokens,
        "gen_ai.request.max_tokens": max_tokens})


def end_generate_span(span: Any, state: RequestState, sent_time: float, error: str | None = None) -> None:
    """Record the phases of `state` (the front end's record of the request) and end `span`."""
    metrics = state.metrics
    end = metrics.finished_time or time.time()
    scheduled = metrics.first_scheduled_time
    first_token = metrics.first_token_time
    if scheduled is not None:
        tracing.record_span("queue", span, sent_time, scheduled)
        tracing.record_span("prefill", span, scheduled, first_token or end,
                            {"kvik.cached_tokens": state.num_cached_tokens})
    if first_token is not None:
        num_output = sum(len(sequence.token_ids) for sequence in state.sequences)
        tracing.record_span("decode", span, first_token, metrics.last_token_time or end,
                            {"gen_ai.usage.output_tokens": num_output})
        tracing.record_span("detokenize", span, first_token, metrics.last_token_time or end,
                            {"kvik.detokenize.busy_s": state.detokenize_seconds})
    reasons = [sequence.finish_reason for sequence in state.sequences if sequence.finish_reason]
    tracing.set_attributes({
        "gen_ai.usage.output_tokens": sum(len(sequence.token_ids) for sequence in state.sequences),
        "gen_ai.response.finish_reasons": reasons or ["abort"],
        "kvik.cached_tokens": state.num_cached_tokens,
    }, span)
    tracing.end_span(span, end, error)
