"""The server's part of a trace: GenAI semantic-convention attributes on the request's server span.

The span itself comes from `kvik.web.tracing.TracingMiddleware` (installed by `create_app` when
tracing is on); tokenization gets a `tokenize` span in `serving.preprocess`, and the engine's phases
come from `kvik.engine.request_spans`. Attribute names follow the OpenTelemetry semantic conventions
for generative AI (gen_ai.*). Every function here is a no-op when tracing is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvik.core import tracing

if TYPE_CHECKING:
    from kvik.server.serving.preprocess import PreparedRequest
    from kvik.server.serving.tracking import CallRecord

PROVIDER = "kvik"


def annotate_request(prepared: PreparedRequest, operation: str) -> None:
    """What was asked: operation ("chat", "text_completion"), model and sampling settings."""
    if not tracing.enabled() or not prepared.prompts:
        return
    params = prepared.prompts[0].request.params
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": prepared.model, "gen_ai.response.model": prepared.model,
        "gen_ai.response.id": prepared.request_id,
        "gen_ai.request.max_tokens": max(p.request.max_tokens for p in prepared.prompts),
        "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.choice.count": params.n if params.n != 1 else None,
        "gen_ai.request.seed": params.seed,
    }
    if params.stop:
        attributes["gen_ai.request.stop_sequences"] = list(params.stop)
    tracing.set_attributes(attributes)


def annotate_usage(records: list[CallRecord]) -> None:
    """What it cost: token counts and finish reasons over all of the request's engine calls."""
    if not tracing.enabled():
        return
    tracing.set_attributes({
        "gen_ai.usage.input_tokens": sum(r.prompt_tokens for r in records),
        "gen_ai.usage.output_tokens": sum(r.completion_tokens for r in records),
        "gen_ai.response.finish_reasons": [reason for r in records for reason in r.finish_reasons],
    })
