"""Sending a request upstream, with failover.

What is retried, on a replica not tried yet, within `max_attempts` and the retry budget: only
attempts that delivered nothing to the client (a request is committed to a replica at its first
relayed byte). Chat and completion requests change nothing on a replica, and an abandoned attempt's
connection is closed so the replica stops generating; so such a retry is safe. Retried:

- connect errors, resets, and timeouts: a stream's first event later than `timeouts.first_byte_s`,
  a non-streaming answer silent for `timeouts.read_s`, or an attempt still waiting when the health
  probes mark its replica down;
- 429, and 503 with Retry-After (a healthy replica saying it is full);
- other 5xx, once: a 5xx that the same request gets again from a second replica is the request's own
  doing (a query of death), so it is answered as it is, not tried on every replica.

Never retried: 4xx (the request is wrong everywhere) and anything after the first relayed byte.

What the breakers hear: transport failures and timeouts count against the replica; 4xx, 429,
overload 503s and a client that left count for nothing; a 5xx counts against the replica only when
another replica then answers the same request (2xx), and for nothing when another replica rejects it
as well (5xx or 4xx). A 5xx with no second opinion counts, and the pool's ejection cap keeps that
from taking a whole model offline.

The proxy finishes every attempt it abandons. For the attempt it returns, the caller owns the
replica's slot and must call `UpstreamAnswer.finish` exactly once (after the last byte relayed).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from kvik.core import tracing
from kvik.core.errors import ServiceUnavailableError, UpstreamError
from kvik.gateway.balancing import RoutingContext
from kvik.gateway.config import RetryConfig, TimeoutConfig
from kvik.gateway.metrics import GatewayMetrics
from kvik.gateway.replica import DRAIN_HEADER, Outcome, Replica
from kvik.gateway.retry_budget import RetryBudget
from kvik.gateway.router import ModelPool

if TYPE_CHECKING:
    from kvik.gateway.grpc_translate import GrpcPlan
    from kvik.gateway.grpc_upstream import GrpcUpstream


class AttemptTimeout(Exception):
    """An attempt that produced nothing in time, or whose replica was marked down meanwhile."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason  # the `reason` label of the retries metric


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
    _response: Any = None  # httpx.Response, or a gRPC replica's stream (kvik.gateway.grpc_upstream)
    _finished: bool = field(default=False)
    span: Any = None  # the attempt's trace span (kvik.core.tracing), ended by finish()

    @property
    def streaming(self) -> bool:
        return self.rest is not None

    @property
    def overloaded(self) -> bool:
        """A healthy replica saying it is full: 429, or 503 with Retry-After (kvik serve's admission
        control). Retried elsewhere, never held against the replica."""
        return self.status == 429 or (self.status == 503 and self.retry_after is not None)

    async def finish(self, outcome: Outcome | None) -> None:
        """Close the upstream stream and release the replica slot; safe to call twice. `None`
        leaves the breaker's verdict to `Replica.judge`."""
        if self._finished:
            return
        self._finished = True
        if self._response is not None:
            await self._response.aclose()
        self.replica.finish_attempt(outcome)
        tracing.end_span(self.span, error=f"HTTP {self.status}" if self.status >= 500 else None)


class UpstreamProxy:
    def __init__(self, client: httpx.AsyncClient, max_attempts: int, budget: RetryBudget,
                 metrics: GatewayMetrics, *, first_byte_s: float, grpc: GrpcUpstream | None = None) -> None:
        self._client = client
        self._grpc = grpc  # grpc:// replicas (None when grpcio is not installed)
        self._max_attempts = max_attempts
        self._budget = budget
        self._metrics = metrics
        self._first_byte_s = first_byte_s

    def reconfigure(self, retries: RetryConfig, timeouts: TimeoutConfig) -> None:
        """Reloaded retry and timeout settings (the retry budget keeps its window)."""
        self._max_attempts = retries.max_attempts
        self._budget.reconfigure(retries)
        self._first_byte_s = timeouts.first_byte_s

    async def send(self, pool: ModelPool, path: str, payload: bytes, *, stream: bool,
                   context: RoutingContext, request_id: str, pinned: Replica | None = None) -> UpstreamAnswer:
        """The first answer worth relaying: a success, a client error (4xx) the replica gave, a 5xx
        two replicas agree on, or, when every attempt failed, the last upstream error answer. Raises
        503 when no replica is available and 502 when every attempt failed without an answer.
        `pinned`: the only replica that may answer (it holds state the request needs), tried once."""
        self._budget.record_request()
        tracing.set_attributes({"gen_ai.request.model": pool.name})
        tried: set[Replica] = set()
        # grpc:// replicas get the request translated once; one the gRPC API cannot carry goes to the
        # model's http:// replicas only, and is refused (400) when it has none.
        grpc_plan, not_carried, skipped = None, None, frozenset()
        if self._grpc is not None and self._grpc.serves(pool.replicas):
            from kvik.gateway.grpc_translate import NotCarriedError
            from kvik.gateway.grpc_upstream import is_grpc

            try:
                grpc_plan = await self._grpc.plan(path, payload, stream)
            except NotCarriedError as exc:
                not_carried, skipped = exc, frozenset(r for r in pool.replicas if is_grpc(r.url))
        if pinned is not None:
            skipped = frozenset(r for r in pool.replicas if r is not pinned)
        suspects: list[Replica] = []  # replicas whose 5xx awaits a second opinion
        last_answer: UpstreamAnswer | None = None
        last_reason = ""
        try:
            for attempt in range(1, self._max_attempts + 1):
                replica = pool.pick(context, tried | skipped if skipped else tried)
                if replica is None:
                    break
                if attempt > 1:
                    if not self._budget.try_spend():
                        break
                    self._metrics.retries.labels(pool.name, last_reason).inc()
                tried.add(replica)
                replica.begin_attempt()
                try:
                    answer = await self._attempt(replica, path, payload, stream, attempt, request_id, grpc_plan)
                except (httpx.TransportError, AttemptTimeout) as exc:
                    replica.finish_attempt(Outcome.FAILURE)
                    last_reason = _reason(exc)
                    continue
                except BaseException:  # cancelled: the client went away while we waited
                    replica.finish_attempt(Outcome.NEUTRAL)
                    raise
                if answer.overloaded:
                    await answer.finish(Outcome.NEUTRAL)
                    last_answer, last_reason = answer, f"status_{answer.status}"
                    continue
                if answer.status >= 500:
                    await answer.finish(None)
                    if suspects:  # the second replica agrees: the request is the cause
                        for suspect in (*suspects, replica):
                            suspect.judge(Outcome.NEUTRAL)
                        suspects.clear()
                        return answer
                    suspects.append(replica)
                    last_answer, last_reason = answer, f"status_{answer.status}"
                    continue
                # A 2xx clears the request and convicts earlier 5xx replicas; a 4xx shows the
                # request was at fault there too.
                verdict = Outcome.FAILURE if answer.status < 400 else Outcome.NEUTRAL
                for suspect in suspects:
                    suspect.judge(verdict)
                suspects.clear()
                if not answer.streaming:
                    await answer.finish(Outcome.SUCCESS if answer.status < 400 else Outcome.NEUTRAL)
                return answer
        finally:
            for suspect in suspects:  # no second opinion came: count the 5xx
                suspect.judge(Outcome.FAILURE)
        if last_answer is not None:
            return last_answer
        if not_carried is not None and len(skipped) == len(pool.replicas):
            raise not_carried
        if not tried:
            raise ServiceUnavailableError(f"No replica of {pool.name!r} is available right now.",
                                          retry_after=pool.seconds_until_available())
        raise UpstreamError(f"No replica of {pool.name!r} could answer ({len(tried)} tried, last: {last_reason}).")

    async def _attempt(self, replica: Replica, path: str, payload: bytes, stream: bool, attempt: int,
                       request_id: str, grpc_plan: GrpcPlan | None = None) -> UpstreamAnswer:
        headers = {"content-type": "application/json", "accept-encoding": "identity",
                   "x-request-id": request_id}
        if replica.api_key:
            headers["authorization"] = f"Bearer {replica.api_key}"
        span = tracing.start_span("upstream", client=True, attributes={
            "http.request.method": "POST", "url.full": replica.url + path, "kvik.replica": replica.url,
            "kvik.attempt": attempt})
        tracing.inject(headers, span)
        # A stream must show its first event within first_byte_s; a non-streaming answer is bounded
        # by the client's read timeout (read_s). Both end early when the replica is marked down.
        deadline = asyncio.get_running_loop().time() + self._first_byte_s if stream else None
        response: httpx.Response | None = None
        try:
            async with asyncio.timeout_at(deadline) as timeout:
                replica.waiting.add(timeout)
                try:
                    if grpc_plan is not None and self._grpc is not None and replica.url.startswith("grpc://"):
                        answer = await self._grpc.first_part(replica, grpc_plan, stream, attempt, headers)
                    else:
                        request = self._client.build_request("POST", replica.url + path, content=payload,
                                                             headers=headers)
                        response = await self._client.send(request, stream=stream)
                        answer = await self._first_part(replica, response, stream, attempt)
                finally:
                    replica.waiting.discard(timeout)
        except TimeoutError:
            if response is not None:
                await response.aclose()
            reason = "first_byte_timeout" if replica.healthy else "replica_down"
            tracing.end_span(span, error=reason)
            raise AttemptTimeout(reason) from None
        except BaseException as exc:
            if response is not None:
                await response.aclose()
            tracing.end_span(span, error=type(exc).__name__)
            raise
        if span is not None:
            span.set_attribute("http.response.status_code", answer.status)
            answer.span = span
        return answer

    @staticmethod
    async def _first_part(replica: Replica, response: httpx.Response, stream: bool,
                          attempt: int) -> UpstreamAnswer:
        content_type = response.headers.get("content-type", "application/json")
        retry_after = response.headers.get("retry-after")
        if DRAIN_HEADER in response.headers:
            replica.announce_drain("a response")  # this answer is still good; the next goes elsewhere
        if not stream:
            return UpstreamAnswer(replica, response.status_code, content_type, attempt, body=response.content,
                                  retry_after=retry_after)
        if response.status_code != 200:
            body = await response.aread()
            await response.aclose()
            return UpstreamAnswer(replica, response.status_code, content_type, attempt, body=body,
                                  retry_after=retry_after)
        chunks = response.aiter_raw()
        first = b""
        try:
            while not first:  # a replica that closes before any byte is a failed attempt
                first = await anext(chunks)
        except StopAsyncIteration:
            raise httpx.RemoteProtocolError("the replica closed the stream before sending anything") from None
        return UpstreamAnswer(replica, 200, content_type, attempt, first_chunk=first, rest=chunks,
                              _response=response)


def _reason(exc: Exception) -> str:
    if isinstance(exc, AttemptTimeout):
        return exc.reason
    if isinstance(exc, httpx.ConnectError):
        return "connect_error"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    return "transport_error"
