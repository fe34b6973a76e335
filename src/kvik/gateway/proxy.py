"""Sending a request upstream, with failover.

An attempt that fails before anything reached the client (connect error, timeout, reset, a 5xx, or
429 from an overloaded replica) is retried on a replica not tried yet, within `max_attempts` and the
retry budget. For streaming requests the first chunk is read before the answer is handed to the
relay, so a replica that dies before producing a token is still failed over; after that first chunk
bytes flow to the client and a failure can only be reported in-stream.

The proxy finishes every attempt it abandons. For the attempt it returns, the caller owns the
replica's slot and must call `UpstreamAnswer.finish` exactly once (after the last byte relayed).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvik.core.errors import ServiceUnavailableError, UpstreamError
from kvik.gateway.balancing import RoutingContext
from kvik.gateway.metrics import GatewayMetrics
from kvik.gateway.replica import Outcome, Replica
from kvik.gateway.retry_budget import RetryBudget
from kvik.gateway.router import ModelPool

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(slots=True, eq=False)
class UpstreamAnswer:
    replica: Replica
    status: int
    content_type: str
    attempts: int
    body: bytes = b""  # the whole body (non-streaming, or any error answer)
    retry_after: str | None = None  # the replica's Retry-After header (429/503), relayed to the client
    first_chunk: bytes = b""  # streaming 200: already read from the upstream
    rest: AsyncIterator[bytes] | None = None  # streaming 200: the chunks after the first
    _response: httpx.Response | None = None
    _finished: bool = field(default=False)

    @property
    def streaming(self) -> bool:
        return self.rest is not None

    async def finish(self, outcome: Outcome) -> None:
        """Close the upstream stream and release the replica slot; safe to call twice."""
        if self._finished:
            return
        self._finished = True
        if self._response is not None:
            await self._response.aclose()
        self.replica.finish_attempt(outcome)


class UpstreamProxy:
    def __init__(self, client: httpx.AsyncClient, max_attempts: int, budget: RetryBudget,
                 metrics: GatewayMetrics) -> None:
        self._client = client
        self._max_attempts = max_attempts
        self._budget = budget
        self._metrics = metrics

    async def send(self, pool: ModelPool, path: str, body: dict[str, Any], *, stream: bool,
                   context: RoutingContext, request_id: str) -> UpstreamAnswer:
        """The first answer worth relaying: a success, a client error (4xx) the replica gave, or, when
        every attempt failed, the last upstream error answer. Raises 503 when no replica is available
        and 502 when every attempt failed without an answer."""
        self._budget.record_request()
        payload = json.dumps(body).encode()
        tried: set[Replica] = set()
        last_answer: UpstreamAnswer | None = None
        last_reason = ""
        for attempt in range(1, self._max_attempts + 1):
            replica = pool.pick(context, tried)
            if replica is None:
                break
            if attempt > 1:
                if not self._budget.try_spend():
                    break
                self._metrics.retries.labels(pool.name, last_reason).inc()
            tried.add(replica)
            replica.begin_attempt()
            try:
                answer = await self._attempt(replica, path, payload, stream, attempt, request_id)
            except httpx.TransportError as exc:
                replica.finish_attempt(Outcome.FAILURE)
                last_reason = _reason(exc)
                continue
            except BaseException:  # cancelled: the client went away while we waited
                replica.finish_attempt(Outcome.NEUTRAL)
                raise
            if answer.status in RETRY_STATUSES or answer.status >= 500:
                # A 503 with Retry-After is a healthy replica saying it is full (kvik serve's
                # admission control): retry elsewhere, but do not count it against its breaker.
                overloaded = answer.status == 503 and answer.retry_after is not None
                failed = answer.status >= 500 and not overloaded
                await answer.finish(Outcome.FAILURE if failed else Outcome.NEUTRAL)
                last_answer, last_reason = answer, f"status_{answer.status}"
                continue
            if not answer.streaming:
                await answer.finish(Outcome.SUCCESS if answer.status < 400 else Outcome.NEUTRAL)
            return answer
        if last_answer is not None:
            return last_answer
        if not tried:
            raise ServiceUnavailableError(f"No replica of {pool.name!r} is available right now.",
                                          retry_after=pool.seconds_until_available())
        raise UpstreamError(f"No replica of {pool.name!r} could answer ({len(tried)} tried, last: {last_reason}).")

    async def _attempt(self, replica: Replica, path: str, payload: bytes, stream: bool, attempt: int,
                       request_id: str) -> UpstreamAnswer:
        headers = {"content-type": "application/json", "accept-encoding": "identity",
                   "x-request-id": request_id}
        if replica.api_key:
            headers["authorization"] = f"Bearer {replica.api_key}"
        request = self._client.build_request("POST", replica.url + path, content=payload, headers=headers)
        response = await self._client.send(request, stream=stream)
        content_type = response.headers.get("content-type", "application/json")
        retry_after = response.headers.get("retry-after")
        if not stream:
            return UpstreamAnswer(replica, response.status_code, content_type, attempt, body=response.content,
                                  retry_after=retry_after)
        try:
            if response.status_code != 200:
                body = await response.aread()
                await response.aclose()
                return UpstreamAnswer(replica, response.status_code, content_type, attempt, body=body,
                                      retry_after=retry_after)
            chunks = response.aiter_raw()
            first = b""
            while not first:  # a replica that closes before any byte is a failed attempt
                first = await anext(chunks)
        except StopAsyncIteration:
            await response.aclose()
            raise httpx.RemoteProtocolError("the replica closed the stream before sending anything") from None
        except BaseException:
            await response.aclose()
            raise
        return UpstreamAnswer(replica, 200, content_type, attempt, first_chunk=first, rest=chunks,
                              _response=response)


def _reason(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connect_error"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    return "transport_error"
