"""POST /v1/embeddings and /classify: every input becomes one pooling request in the engine.

The inputs of one HTTP request are validated first (all or nothing: one bad input is a 400 naming
it, before any work is queued), then sent to the engine, which batches them with everyone else's
work under the same token budget. A request holds at most `max_num_seqs` admission slots: a long
list (OpenAI allows 2048 inputs) is fed through that window instead of being refused or crowding
out other clients.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvik.core.errors import InvalidRequestError
from kvik.core.outputs import PoolingRequestOutput
from kvik.core.pooling_params import PoolingParams
from kvik.engine.async_llm import AsyncLLM
from kvik.engine.messages import EngineCoreRequest
from kvik.protocol.pooling import MAX_INPUTS, ClassifyRequest, EmbeddingRequest
from kvik.server.serving.streams import unless_disconnected
from kvik.server.serving.tracking import Admission, CallRecord
from kvik.server.state import ServerState


class PoolingServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _refuse_adapter(self, model: str) -> None:
        if self.state.lora_name(model) is not None:
            raise InvalidRequestError(f"model: {model!r} is a LoRA adapter; adapters serve chat and completions, "
                                      "not embeddings or classification", param="model")

    async def embeddings(self, body: EmbeddingRequest, raw: Request) -> Response:
        return JSONResponse(await self.embeddings_body(body, raw))

    async def embeddings_body(self, body: EmbeddingRequest, raw: Request | None) -> dict[str, Any]:
        """The embeddings response; `raw` is the client's connection (None for a batch line)."""
        engine, model = await self.state.engine_for(body.model)
        self._refuse_adapter(model)
        engine.input_processor.check_task("embed")
        pooling = PoolingParams(task="embed", dimensions=body.dimensions)
        if body.dimensions is not None:
            engine.input_processor.check_dimensions(body.dimensions)
        results = await self._run(engine, "embeddings", model, body, pooling, raw)
        data = [{"object": "embedding", "index": index,
                 "embedding": (base64.b64encode(result.data_bytes).decode() if body.encoding_format == "base64"
                               else result.data)}
                for index, result in enumerate(results)]
        tokens = sum(len(r.prompt_token_ids) for r in results)
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def classify(self, body: ClassifyRequest, raw: Request) -> Response:
        engine, model = await self.state.engine_for(body.model)
        self._refuse_adapter(model)
        engine.input_processor.check_task("classify")
        results = await self._run(engine, "classify", model, body, PoolingParams(task="classify"), raw)
        labels = engine.info.pooling.labels if engine.info.pooling else []
        data = []
        for index, result in enumerate(results):
            logits = result.data
            probs = _probabilities(logits)
            best = max(range(len(logits)), key=logits.__getitem__)
            data.append({"index": index, "label": labels[best] if best < len(labels) else str(best),
                         "probs": probs, "num_classes": len(logits), "logits": logits})
        tokens = sum(len(r.prompt_token_ids) for r in results)
        return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                             "created": int(time.time()), "model": model, "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                                       "completion_tokens": 0}})

    async def _run(self, engine: AsyncLLM, endpoint: str, model: str, body: EmbeddingRequest | ClassifyRequest,
                   pooling: PoolingParams, raw: Request | None) -> list[PoolingRequestOutput]:
        arrival = time.time()
        prompts = await _token_ids(engine, body.input)
        request_id = f"{endpoint}-{uuid.uuid4().hex}"
        requests: list[EngineCoreRequest] = []
        for index, ids in enumerate(prompts):
            where = "input" if len(prompts) == 1 else f"input[{index}]"
            try:
                requests.append(engine.input_processor.make_pooling_request(
                    f"{request_id}-{index}", ids, pooling, arrival, where=where, priority=body.priority,
                    tenant=body.tenant or "", tenant_weight=body.tenant_weight))
            except InvalidRequestError as exc:
                exc.param = "input"
                raise
        records = [CallRecord(prompt_tokens=len(r.prompt_token_ids)) for r in requests]
        window = min(len(requests), self.state.config.max_num_seqs)
        admission = Admission(self.state, window, request_id=request_id, endpoint=endpoint, model=model,
                              arrival=arrival, records=records, stream=False, prompt=None,
                              reserve=raw is not None)
        try:
            return await unless_disconnected(raw, self._encode_all(engine, model, requests, window))
        except Exception as exc:
            admission.fail(getattr(exc, "http_status", 500), str(exc))
            raise
        finally:
            admission.release()

    async def _encode_all(self, engine: AsyncLLM, model: str, requests: list[EngineCoreRequest], window: int
                          ) -> list[PoolingRequestOutput]:
        """Every request through the engine, at most `window` at once; the first failure cancels
        (and so aborts) the rest."""
        slots = asyncio.Semaphore(window)
        metrics = self.state.metrics

        async def one(request: EngineCoreRequest) -> PoolingRequestOutput:
            async with slots:
                result = await engine.encode(request)
            now, tier = time.time(), metrics.tier(request.priority)
            metrics.e2e_latency(model, tier, now - request.arrival_time)
            if result.metrics and result.metrics.first_scheduled_time:
                metrics.queue_time(model, tier, max(0.0, result.metrics.first_scheduled_time - request.arrival_time))
            metrics.finished("stop", model)
            return result

        tasks = [asyncio.ensure_future(one(r)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _token_ids(engine: AsyncLLM, raw_input: Any) -> list[list[int]]:
    """Token ids per input from any of the four shapes; strings get the tokenizer's special tokens
    ([CLS] ... [SEP] for BERT, BOS for Llama), as sentence-transformers and HF add them."""
    items = [raw_input] if isinstance(raw_input, str) else list(raw_input)
    if not items:
        raise InvalidRequestError("input: is empty; give a string, a list of strings or token ids",
                                  param="input")
    if isinstance(items[0], int):
        items = [items]
    if len(items) > MAX_INPUTS:
        raise InvalidRequestError(f"input: {len(items)} inputs; at most {MAX_INPUTS} per request",
                                  param="input")
    for index, item in enumerate(items):
        if not item:
            where = "input" if len(items) == 1 else f"input[{index}]"
            raise InvalidRequestError(f"{where}: is empty; give at least one token", param="input")
    texts = [item for item in items if isinstance(item, str)]
    for text in texts:
        engine.input_processor.check_text_size(len(text.encode("utf-8", "surrogatepass")), "input")
    encoded = iter(await engine.tokenize(texts) if texts else [])
    return [next(encoded) if isinstance(item, str) else list(item) for item in items]


def _probabilities(logits: list[float]) -> list[float]:
    """Softmax over the labels; a single logit (a reward model, a binary score) through a sigmoid."""
    if len(logits) == 1:
        value = logits[0]
        return [1 / (1 + math.exp(-value)) if value >= 0 else math.exp(value) / (1 + math.exp(value))]
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    total = sum(exps)
    return [e / total for e in exps]
