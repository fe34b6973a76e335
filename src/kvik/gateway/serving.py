"""The proxy pipeline for `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/classify` and
`/v1/responses`, top to bottom:

    authenticate -> parse -> route (a stored conversation's replica: `stored_responses`) -> authorize
    -> reserve budget and TPM, count RPM -> guardrails -> scheduling fields from the key
    -> cache lookup -> upstream with failover -> relay -> settle tokens, cache store, usage row
    (and where a stored response lives)

Every refusal is a typed `KvikError` turned into the OpenAI error envelope in one place
(`kvik.protocol.errors.error_from_exception`). Parsing, redaction, cache keys and encoding run off
the event loop for large bodies (`offload`), so one tenant's huge request does not stall the others.
Every request that reserved tokens settles them exactly once, in `_finish`, however it ends.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from kvik.core.errors import InvalidRequestError, KvikError, QuotaExceededError
from kvik.core.tracing import traced
from kvik.gateway.auth import Principal
from kvik.gateway.balancing import RoutingContext
from kvik.gateway.cache import policy
from kvik.gateway.cache.backend import CachedResponse
from kvik.gateway.disconnect import ClientDisconnected, unless_disconnected
from kvik.gateway.guardrails.moderation import ModerationRequest
from kvik.gateway.guardrails.text import replace_request_texts, request_texts
from kvik.gateway.proxy import UpstreamAnswer
from kvik.gateway.relay import CLIENT_LEFT, RelayResponse, StreamRelay, replay
from kvik.gateway.replica import Outcome
from kvik.gateway.request_body import (CHAT, CLASSIFY, COMPLETIONS, EMBEDDINGS, RESPONSES, Endpoint, parse_body,
                                       wants_usage_chunk)
from kvik.gateway.router import ModelPool
from kvik.gateway.scheduling import SCHEDULING_FIELDS
from kvik.gateway.sse import TokenUsage, inspect_event, inspect_response_event
from kvik.gateway.state import GatewayState
from kvik.gateway.stored_responses import StoredResponses
from kvik.gateway.tenancy import tenant_of
from kvik.gateway.tokens import TokenEstimate, estimate_tokens
from kvik.gateway.usage import UsageRecord
from kvik.protocol.errors import error_from_exception

__all__ = ["CHAT", "CLASSIFY", "COMPLETIONS", "EMBEDDINGS", "RESPONSES", "ProxyService"]

# What a client may send as its own x-request-id: visible ASCII, no spaces, as HTTP headers carry it.
_REQUEST_ID = re.compile(r"[!-~]{1,128}")


@dataclass(slots=True)
class RequestLog:
    """What the usage row, the metrics and the token settlement of one request need, filled in as
    the request goes."""

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
    estimate: TokenEstimate | None = None
    held_budget: int = 0  # tokens of the key's budget reserved at admission
    held_tpm: int = 0  # tokens of the key's TPM window reserved at admission
    usage: TokenUsage = TokenUsage()  # what the request is charged
    finished: bool = False


@dataclass(slots=True)
class Prepared:
    """A request ready to go upstream (after guardrails)."""

    payload: bytes  # what is sent upstream
    cache_key: str | None
    context: RoutingContext


class ProxyService:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.stored = StoredResponses(state)

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        log = RequestLog(endpoint, f"req_{secrets.token_hex(12)}")
        handed_to_stream = False
        try:
            log.request_id = _client_request_id(request.headers) or log.request_id
            response = await self._handle(request, log)
            handed_to_stream = isinstance(response, RelayResponse)
            return response
        except KvikError as exc:
            status, body, headers = error_from_exception(exc)
            await self._finish(log, status)
            return JSONResponse(body, status_code=status, headers={**headers, "x-request-id": log.request_id})
        except (ClientDisconnected, ClientDisconnect):
            await self._finish(log, CLIENT_LEFT)
            return Response(status_code=CLIENT_LEFT)  # nobody is there to read it
        finally:
            if not log.finished and not handed_to_stream:  # an unexpected error, or cancelled
                with anyio.CancelScope(shield=True):
                    await self._finish(log, 500)

    async def _handle(self, request: Request, log: RequestLog) -> Response:
        state = self.state
        log.principal = await state.auth.authenticate(request.headers.get("authorization"))
        raw = await request.body()  # bounded in size and time by the ClientLimits middleware
        body, texts, log.estimate = await state.cpu.run(len(raw), self._parse, raw, log.endpoint)
        log.stream = body.get("stream") is True
        pool = state.router.resolve(body["model"])
        log.model = pool.name
        state.auth.authorize_model(log.principal, pool.name)
        continuation = await self.stored.pin(body, log.principal, pool) if log.endpoint.responses else None
        if continuation is not None:
            log.estimate = log.estimate.continuing(continuation.context_tokens)
        await self._admit(log)
        prepared = await self._prepare(body, texts, pool, log, request.headers, len(raw))

        cache = state.cache
        if cache is not None and prepared.cache_key is not None and policy.directive(
                body, request.headers, sampled=log.endpoint.generates).read:
            cached = await cache.get(prepared.cache_key)
            state.metrics.cache.labels(pool.name, "miss" if cached is None else "hit").inc()
            if cached is not None:
                return await self._replay(cached, log)
        headers = {"x-request-id": log.request_id,
                   "x-kvik-cache": "miss" if prepared.cache_key is not None else "bypass"}
        try:
            answer = await unless_disconnected(request, state.proxy.send(
                pool, log.endpoint.path, prepared.payload, stream=log.stream, context=prepared.context,
                request_id=log.request_id,
                pinned=continuation.replica if continuation is not None else None))
        except ClientDisconnected:
            # The replica was asked and has likely read the prompt: charge that (estimated).
            log.usage = TokenUsage(log.estimate.prompt, 0)
            raise
        log.replica, log.attempts = answer.replica.url, answer.attempts
        if answer.streaming:
            return self._relay(answer, log, headers, body, prepared.cache_key)
        if answer.status == 200:
            answered = _json_object(answer.body)  # parsed once for its usage and a stored response's id
            log.usage = (TokenUsage.from_json(answered.get("usage"))
                         or TokenUsage(log.estimate.prompt, log.estimate.completion))
            if _stores(log.endpoint, body):
                await self.stored.remember(answered.get("id"), log.principal, pool.name, answer.replica.url,
                                           log.usage.total_tokens)
            if cache is not None and prepared.cache_key is not None:
                await cache.put(prepared.cache_key, CachedResponse(200, answer.content_type, (answer.body,)))
        elif answer.retry_after is not None:
            # Every replica was overloaded (or the answer is the replica's own 429): pass on its hint.
            headers["retry-after"] = answer.retry_after
        await self._finish(log, answer.status)
        return Response(answer.body, status_code=answer.status, media_type=answer.content_type, headers=headers)

    def _parse(self, raw: bytes, endpoint: Endpoint) -> tuple[dict[str, Any], list[str], TokenEstimate]:
        body = parse_body(raw, endpoint)
        texts = request_texts(body)
        return body, texts, estimate_tokens(body, texts, self.state.config.limits.reserve_completion_tokens,
                                            generates=endpoint.generates)

    @traced("rate_limit")
    async def _admit(self, log: RequestLog) -> None:
        """Reserve the estimate from the key's budget and TPM, count RPM; or refuse with 429."""
        state, principal, estimate = self.state, log.principal, log.estimate
        assert principal is not None and estimate is not None
        try:
            log.held_budget = state.auth.budgets.reserve(principal, estimate)
        except QuotaExceededError:
            state.metrics.rate_limited.labels("budget").inc()
            raise
        log.held_tpm = await state.limiter.admit(principal, estimate)

    async def _prepare(self, body: dict[str, Any], texts: list[str], pool: ModelPool, log: RequestLog,
                       headers: Mapping[str, str], size: int) -> Prepared:
        state = self.state
        if state.redactor is not None and texts:
            redacted = await state.cpu.run(size, state.redactor.redact_texts, texts)
            if redacted != texts:
                body, texts = replace_request_texts(body, redacted), redacted
        if state.moderation is not None:
            try:
                await state.moderation.check(ModerationRequest(
                    model=pool.name, endpoint=log.endpoint.name, texts=texts,
                    key_id=log.principal.key_id if log.principal else None))
            except KvikError:
                state.metrics.blocked.labels(pool.name).inc()
                raise
        assert log.principal is not None
        scheduling = await state.scheduling.request_fields(log.principal)
        return await state.cpu.run(size, self._encode, body, pool, log, headers, scheduling)

    def _encode(self, body: dict[str, Any], pool: ModelPool, log: RequestLog, headers: Mapping[str, str],
                scheduling: dict[str, Any]) -> Prepared:
        """The cache key, the routing context and the upstream payload: CPU work on the whole body."""
        config = self.state.config
        tenant = tenant_of(log.principal)
        cache_key = None
        if (self.state.cache is not None and not log.endpoint.responses
                and policy.directive(body, headers, sampled=log.endpoint.generates).write):
            scope = None if config.cache.share_across_tenants else tenant
            cache_key = policy.cache_key(log.endpoint.name, pool.name, body, tenant=scope)
        # Scheduling fields come from the key, never from the client (kvik.gateway.scheduling).
        upstream = {name: value for name, value in body.items() if name not in SCHEDULING_FIELDS}
        upstream.update(scheduling, model=pool.upstream_model)
        if log.stream and not log.endpoint.responses and not wants_usage_chunk(body):
            # Ask for the usage chunk so TPM and usage rows count streamed tokens; the relay drops
            # it again, so the client sees the stream it asked for.
            upstream["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        if self.state.salter is not None:
            upstream["cache_salt"] = self.state.salter.salt(tenant)  # overrides the client's
        return Prepared(json.dumps(upstream).encode(), cache_key, pool.routing_context(body))

    async def _replay(self, cached: CachedResponse, log: RequestLog) -> Response:
        log.cached = True
        await self._finish(log, cached.status)
        headers = {"x-request-id": log.request_id, "x-kvik-cache": "hit"}
        if len(cached.chunks) == 1 and not log.stream:
            return Response(cached.chunks[0], status_code=cached.status, media_type=cached.content_type,
                            headers=headers)
        return StreamingResponse(replay(cached.chunks), status_code=cached.status,
                                 media_type=cached.content_type, headers=headers)

    def _relay(self, answer: UpstreamAnswer, log: RequestLog, headers: dict[str, str], body: dict[str, Any],
               cache_key: str | None) -> Response:
        state = self.state
        replica = answer.replica

        async def remember(relay: StreamRelay) -> None:
            # The final event carries the usage (None only from a replica that sends none).
            context = relay.usage.total_tokens if relay.usage is not None else log.estimate.total
            await self.stored.remember(relay.response_id, log.principal, log.model, replica.url, context)

        # A Responses stream is relayed as it comes (its usage rides on its last event); chat and
        # completions streams lose the usage chunk the gateway asked for on the client's behalf.
        responses = log.endpoint.responses
        relay = StreamRelay(answer, keep_usage_chunk=responses or wants_usage_chunk(body),
                            record=cache_key is not None,
                            on_first_chunk=lambda: state.metrics.ttft.labels(log.model, log.replica).observe(
                                time.monotonic() - log.started),
                            inspect=inspect_response_event if responses else inspect_event,
                            on_done=remember if _stores(log.endpoint, body) else None)

        async def close() -> None:
            await answer.finish(relay.outcome)
            assert log.estimate is not None
            # A finished stream: the replica's count. Otherwise (the client left, the replica
            # failed) the tokens the client got, and the prompt (estimated from above if the
            # replica's count never came).
            if relay.outcome is Outcome.SUCCESS and relay.usage is not None:
                log.usage = relay.usage
            else:
                prompt = relay.usage.prompt_tokens if relay.usage is not None else log.estimate.prompt
                log.usage = TokenUsage(prompt, relay.content_deltas)
            if (state.cache is not None and cache_key is not None and relay.recorded is not None
                    and relay.outcome is Outcome.SUCCESS):
                await state.cache.put(cache_key, CachedResponse(200, answer.content_type, tuple(relay.recorded)))
            await self._finish(log, relay.status)

        return RelayResponse(relay.events(), close, media_type=answer.content_type, headers=headers)

    async def _finish(self, log: RequestLog, status: int) -> None:
        """Settle the tokens held, then metrics and the usage row (requests refused before a key was
        known leave no row). Runs once per request."""
        if log.finished:
            return
        log.finished = True
        state = self.state
        charged = 0 if log.cached else log.usage.total_tokens
        if log.principal is not None:
            state.auth.budgets.settle(log.principal, log.held_budget, charged)
            await state.limiter.settle(log.principal, log.held_tpm, charged)
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


def _client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's own request id (kept so its logs and ours can be joined), or None."""
    value = headers.get("x-request-id")
    if not value:
        return None
    if not _REQUEST_ID.fullmatch(value):
        raise InvalidRequestError("x-request-id: send 1 to 128 visible ASCII characters (no spaces), or "
                                  "leave it out and the gateway makes one.", param="x-request-id")
    return value


def _stores(endpoint: Endpoint, body: dict[str, Any]) -> bool:
    """A Responses request whose answer the replica stores (`store` defaults to true)."""
    return endpoint.responses and body.get("store") is not False


def _json_object(body: bytes) -> dict[str, Any]:
    """A replica's JSON answer as an object; {} for anything else."""
    try:
        answered = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    return answered if isinstance(answered, dict) else {}
