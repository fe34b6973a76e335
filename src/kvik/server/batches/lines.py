"""Run one batch line through the same preprocessing and response building as the HTTP endpoints,
so a line's result is exactly what the same request sent on its own would have returned.

The batch sets the line's scheduling: the background tier's priority and the batch owner as the
tenant (a line cannot choose either), and `stream` is off. Lines may call the endpoints OpenAI's
Batch API takes: chat completions, completions, embeddings and responses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvik.core.errors import InvalidRequestError
from kvik.protocol.openai import ChatCompletionRequest, CompletionRequest
from kvik.protocol.pooling import EmbeddingRequest
from kvik.protocol.responses import ResponsesRequest
from kvik.server.model_pool import lease_scope
from kvik.server.serving.chat import ChatServing
from kvik.server.serving.completions import CompletionServing
from kvik.server.serving.pooling import PoolingServing
from kvik.server.serving.responses_api import ResponsesServing
from kvik.server.serving.preprocess import prepare_chat, prepare_completion
from kvik.server.serving.tracking import tracked_generate
from kvik.server.state import ServerState


@dataclass(slots=True, frozen=True)
class LineScheduling:
    priority: int
    tenant: str
    tenant_weight: float


@dataclass(slots=True, frozen=True)
class LineServings:
    """The server's own endpoint implementations, shared with the HTTP routes (a response a line
    stores is the one GET /v1/responses/{id} finds)."""

    chat: ChatServing
    completions: CompletionServing
    pooling: PoolingServing
    responses: ResponsesServing


async def execute_line(state: ServerState, url: str, body: dict[str, Any], scheduling: LineScheduling,
                       servings: LineServings) -> dict[str, Any]:
    """The response body for one line; raises KvikError as the endpoint would."""
    fields = {**body, "priority": scheduling.priority, "tenant": scheduling.tenant or None,
              "tenant_weight": scheduling.tenant_weight}
    if url != "/v1/embeddings":
        fields.update(stream=False, stream_options=None)
    with lease_scope():
        if url == "/v1/embeddings":
            return await servings.pooling.embeddings_body(_validate(EmbeddingRequest, fields), None)
        if url == "/v1/responses":
            fields.pop("stream_options")
            return await servings.responses.response_body(_validate(ResponsesRequest, fields))
        if url == "/v1/chat/completions":
            chat_body = _validate(ChatCompletionRequest, fields)
            prepared = await prepare_chat(state, chat_body)
            prompt = prepared.prompts[0]
            stream = tracked_generate(state, prepared.engine, prompt.request, prompt.text, prompt.record)
            return ChatServing.completion_body(chat_body, prepared, await ChatServing.collect(stream))
        completion_body = _validate(CompletionRequest, fields)
        prepared = await prepare_completion(state, completion_body)
        streams = [tracked_generate(state, prepared.engine, p.request, p.text, p.record) for p in prepared.prompts]
        completions = servings.completions
        return completions.completion_body(completion_body, prepared, *await completions.collect(streams))


def _validate(model: type, fields: dict[str, Any]) -> Any:
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        raise InvalidRequestError(message, param=where or None) from None
