"""The proxy pipeline for `/v1/chat/completions` and `/v1/completions`, top to bottom:

    authenticate -> parse -> route -> authorize -> budget and rate limits -> guardrails
    -> cache lookup -> upstream with failover -> relay -> charge tokens, cache store, usage row

Every refusal is a typed `KvikError` turned into the OpenAI error envelope in one place
(`kvik.protocol.errors.error_from_exception`).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvik.core.errors import InvalidRequestError, KvikError, QuotaExceededError, RequestTooLargeError
from kvik.gateway.auth import Principal
from kvik.gateway.cache import policy
from kvik.gateway.cache.backend import CachedResponse
from kvik.gateway.guardrails.moderation import ModerationRequest
from kvik.gateway.guardrails.text import request_texts
from kvik.gateway.proxy import UpstreamAnswer
from kvik.gateway.relay import RelayResponse, StreamRelay, replay
from kvik.gateway.replica import Outcome
from kvik.gateway.router import ModelPool
from kvik.gateway.sse import TokenUsage
from kvik.gateway.state import GatewayState
from kvik.gateway.usage import UsageRecord
from kvik.protocol.errors import error_from_exception


@dataclass(slots=True, frozen=True)
class Endpoint:
    name: str  # "chat.completions" or "completions", as in usage rows and moderation requests
    path: str  # the upstream path
    required_field: str  # "messages" or "prompt"


CHAT = Endpoint("chat.completions", "/v1/chat/completions", "messages")
COMPLETIONS = Endpoint("completions", "/v1/completions", "prompt")


@dataclass(slots=True)
class RequestLog:
    """What the usage row and the metrics of one request need, filled in as the request goes."""

    endpoint: Endpoint
    request_id: str
    started: float = field(default_factory=time.monotonic)
    created_at: float = field(default_factory=time.time)
    principal: Principal | None = None
    model: str = ""
    replica: str | None = None
    stream: bool = False
    cached: bool = False
    attempts: int = 0
    usage: TokenUsage = TokenUsage()


class ProxyService:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        # A client's own request id is kept (bounded) so its logs and ours can be joined.
        request_id = request.headers.get("x-request-id", "")[:128] or f"req_{secrets.token_hex(12)}"
        log = RequestLog(endpoint, request_id)
        try:
            return await self._handle(request, log)
        except KvikError as exc:
            status, body, headers = error_from_exception(exc)
            self._finish(log, status)
            return JSONResponse(body, status_code=status, headers={**headers, "x-request-id": log.request_id})

    async def _handle(self, request: Request, log: RequestLog) -> Response:
        state = self.state
        log.principal = await state.auth.authenticate(request.headers.get("authorization"))
        body = await _read_body(request, log.endpoint, state.config.limits.max_body_bytes)
        log.stream = body.get("stream") is True
        pool = state.router.resolve(body["model"])
        log.model = pool.name
        state.auth.authorize_model(log.principal, pool.name)
        try:
            state.auth.check_budget(log.principal)
        except QuotaExceededError:
            state.metrics.rate_limited.labels("budget").inc()
            raise
        await state.limiter.admit(log.principal)
        body = await self._apply_guardrails(body, pool, log)

        cache = state.cache
        directive = policy.directive(body, request.headers) if cache is not None else policy.NO_CACHE
        cache_key = policy.cache_key(log.endpoint.name, pool.name, body) if directive.write else None
        if cache is not None and cache_key is not None and directive.read:
            cached = await cache.get(cache_key)
            state.metrics.cache.labels(pool.name, "miss" if cached is None else "hit").inc()
            if cached is not None:
                return self._replay(cached, log)
        headers = {"x-request-id": log.request_id,
                   "x-kvik-cache": "miss" if cache_key is not None else "bypass"}

        # Scheduling fields come from the key, never from the client (kvik.gateway.tenancy).
        upstream_body = {**body, "model": pool.upstream_model, **await state.tenancy.request_fields(log.principal)}
        client_wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if log.stream and not client_wants_usage:
            # Ask for the usage chunk so TPM and usage rows count streamed tokens; the relay drops
            # it again, so the client sees the stream it asked for.
            upstream_body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        answer = await state.proxy.send(pool, log.endpoint.path, upstream_body, stream=log.stream,
                                        context=pool.routing_context(body), request_id=log.request_id)
        log.replica, log.attempts = answer.replica.url, answer.attempts
        if answer.streaming:
            return self._relay(answer, log, headers, client_wants_usage, cache_key)
        if answer.status == 200:
            log.usage = _usage_of(answer.body)
            await self._charge(log)
            if cache is not None and cache_key is not None:
                await cache.put(cache_key, CachedResponse(200, answer.content_type, (answer.body,)))
        elif answer.retry_after is not None:
            # Every replica was overloaded (or the answer is the replica's own 429): pass on its hint.
            headers["retry-after"] = answer.retry_after
        self._finish(log, answer.status)
        return Response(answer.body, status_code=answer.status, media_type=answer.content_type, headers=headers)

    async def _apply_guardrails(self, body: dict[str, Any], pool: ModelPool, log: RequestLog) -> dict[str, Any]:
        state = self.state
        if state.redactor is not None:
            redaction = state.redactor.redact_request(body)
            body = redaction.body
        if state.moderation is not None:
            try:
                await state.moderation.check(ModerationRequest(
                    model=pool.name, endpoint=log.endpoint.name, texts=request_texts(body),
                    key_id=log.principal.key_id if log.principal else None))
            except KvikError:
                state.metrics.blocked.labels(pool.name).inc()
                raise
        return body

    def _replay(self, cached: CachedResponse, log: RequestLog) -> Response:
        log.cached = True
        self._finish(log, cached.status)
        headers = {"x-request-id": log.request_id, "x-kvik-cache": "hit"}
        if len(cached.chunks) == 1 and not log.stream:
            return Response(cached.chunks[0], status_code=cached.status, media_type=cached.content_type,
                            headers=headers)

        return StreamingResponse(replay(cached.chunks), status_code=cached.status,
                                 media_type=cached.content_type, headers=headers)

    def _relay(self, answer: UpstreamAnswer, log: RequestLog, headers: dict[str, str],
               client_wants_usage: bool, cache_key: str | None) -> Response:
        state = self.state
        relay = StreamRelay(answer, keep_usage_chunk=client_wants_usage, record=cache_key is not None,
                            on_first_chunk=lambda: state.metrics.ttft.labels(log.model, log.replica).observe(
                                time.monotonic() - log.started))

        async def close() -> None:
            await answer.finish(relay.outcome)
            log.usage = relay.usage or TokenUsage()
            await self._charge(log)
            if (state.cache is not None and cache_key is not None and relay.recorded is not None
                    and relay.saw_done and relay.outcome is Outcome.SUCCESS):
                await state.cache.put(cache_key, CachedResponse(200, answer.content_type, tuple(relay.recorded)))
            self._finish(log, relay.status)

        return RelayResponse(relay.events(), close, media_type=answer.content_type, headers=headers)

    async def _charge(self, log: RequestLog) -> None:
        tokens = log.usage.total_tokens
        if log.principal is not None and tokens:
            self.state.auth.note_tokens(log.principal, tokens)
            await self.state.limiter.charge_tokens(log.principal, tokens)

    def _finish(self, log: RequestLog, status: int) -> None:
        """Metrics and the usage row; requests refused before a key was known leave no row."""
        state = self.state
        latency = time.monotonic() - log.started
        replica = log.replica or ""
        state.metrics.requests.labels(log.model, replica, str(status)).inc()
        if log.model:
            state.metrics.latency.labels(log.model, replica).observe(latency)
        if log.principal is None:
            return
        state.usage.record(UsageRecord(
            created_at=log.created_at, request_id=log.request_id, key_id=log.principal.key_id,
            model=log.model, replica=log.replica, endpoint=log.endpoint.name, stream=log.stream,
            cached=log.cached, status=status, prompt_tokens=0 if log.cached else log.usage.prompt_tokens,
            completion_tokens=0 if log.cached else log.usage.completion_tokens,
            latency_ms=latency * 1000, attempts=log.attempts))


async def _read_body(request: Request, endpoint: Endpoint, max_bytes: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RequestTooLargeError(f"The request body is over the gateway's limit of {max_bytes} bytes.")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise RequestTooLargeError(f"The request body is over the gateway's limit of {max_bytes} bytes.")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidRequestError("you must provide a model parameter", param="model")
    if endpoint.required_field not in body:
        raise InvalidRequestError(f"Missing required parameter: '{endpoint.required_field}'.",
                                  param=endpoint.required_field)
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        raise InvalidRequestError("'stream' must be a boolean.", param="stream")
    return body


def _usage_of(body: bytes) -> TokenUsage:
    try:
        return TokenUsage.from_json(json.loads(body).get("usage")) or TokenUsage()
    except (ValueError, AttributeError):
        return TokenUsage()
