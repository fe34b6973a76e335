"""Replicas at `grpc://host:port`: kvik serve's gRPC API (`kvik serve --grpc-port`) as an upstream.

The proxy and the relay stay transport-blind: an attempt on a gRPC replica produces the same
`UpstreamAnswer` an HTTP attempt does (status, OpenAI JSON body, or the SSE bytes of a stream), and
its failures are httpx's transport errors, so failover, breaker verdicts, usage accounting, the cache
and the relay's stream-error handling apply unchanged.

- gRPC statuses the replica sent on purpose (it puts the OpenAI error's type in the trailing metadata,
  `kvik-error-type`) become that HTTP status and error body: INVALID_ARGUMENT 400, NOT_FOUND 404,
  RESOURCE_EXHAUSTED (full) and UNAVAILABLE (draining, loading, engine dead) 503 + Retry-After, which
  the proxy retries on another replica without blaming this one.
- A call that never reached the replica, or broke (UNAVAILABLE without that metadata: refused,
  reset, the process died) is `GrpcConnectError` / `GrpcStreamError`; a non-streaming call silent for
  `timeouts.read_s`, or a stream silent that long between messages, is `GrpcReadTimeout`.
- Closing the answer cancels the call, which aborts the request in the replica's engine (a client
  that left, a first-byte timeout, a replica marked down).

Health probes use the standard `grpc.health.v1.Health/Check` for the Inference service.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvik.gateway.grpc_translate import GrpcPlan, answer_json, plan, stream_frames
from kvik.gateway.proxy import UpstreamAnswer
from kvik.gateway.replica import Replica
from kvik.protocol.errors import error_body
from kvik.protocol.grpc import inference_pb2_grpc as pb_grpc
from kvik.protocol.sse import DONE_FRAME, sse_frame

SCHEME = "grpc://"
SERVICE_NAME = "kvik.inference.v1.Inference"
OFFLOAD_BYTES = 2**20  # bodies larger than this are translated off the event loop
# Metadata the replica must not get from the HTTP request's headers (gRPC sets its own).
_NOT_METADATA = frozenset({"content-type", "accept-encoding"})

_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
                grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
                grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
                grpc.StatusCode.RESOURCE_EXHAUSTED: 503, grpc.StatusCode.UNAVAILABLE: 503,
                grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.DEADLINE_EXCEEDED: 504}

# Reconnect quickly after a replica restarts (gRPC's default backoff grows to two minutes), and leave
# retrying to the proxy, which knows the other replicas.
CHANNEL_OPTIONS = [("grpc.enable_retries", 0), ("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.min_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000),
                   ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def is_grpc(url: str) -> bool:
    return url.startswith(SCHEME)


class GrpcConnectError(httpx.ConnectError):
    """The call did not reach the replica (refused, reset before an answer)."""


class GrpcStreamError(httpx.RemoteProtocolError):
    """The stream broke without the replica saying why (the process died, the connection dropped)."""


class GrpcReadTimeout(httpx.ReadTimeout):
    """Nothing came from the replica for `timeouts.read_s`."""


def _metadata(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((key.lower(), value) for key, value in headers.items() if key.lower() not in _NOT_METADATA)


def _replica_error(exc: grpc.aio.AioRpcError) -> tuple[int, dict[str, Any], str | None] | None:
    """(HTTP status, OpenAI error body, Retry-After) of an error status the replica itself sent;
    None when the status came from the transport (no kvik-error-type in its trailing metadata)."""
    trailing = {key: value for key, value in exc.trailing_metadata() or ()}
    error_type = trailing.get("kvik-error-type")
    if error_type is None:
        return None
    status = _HTTP_STATUS.get(exc.code(), 500)
    retry_after = trailing.get("retry-after")
    if status == 503 and retry_after is None:
        retry_after = "1"  # a deliberate refusal: the proxy retries it elsewhere, blaming no one
    code: Any = trailing.get("kvik-error-code")
    return status, error_body(exc.details() or exc.code().name, error_type, trailing.get("kvik-error-param"),
                              code), retry_after


class GrpcStream:
    """The rest of a streamed call as SSE bytes; `aclose` cancels the call."""

    def __init__(self, call: Any, grpc_plan: GrpcPlan, read_s: float) -> None:
        self._call = call
        self._plan = grpc_plan
        self._read_s = read_s

    async def rest(self) -> AsyncIterator[bytes]:
        while True:
            try:
                reply = await asyncio.wait_for(self._call.read(), self._read_s)
            except asyncio.TimeoutError:
                self._call.cancel()
                raise GrpcReadTimeout("the replica sent nothing for timeouts.read_s") from None
            except grpc.aio.AioRpcError as exc:
                error = _replica_error(exc)
                if error is None:
                    raise GrpcStreamError(f"the gRPC stream broke: {exc.code().name}") from None
                yield sse_frame(error[1])  # the replica's own error event; no [DONE] after it
                return
            if reply is grpc.aio.EOF:
                yield DONE_FRAME
                return
            frames = stream_frames(self._plan, reply)
            if frames:
                yield frames

    async def aclose(self) -> None:
        self._call.cancel()


class GrpcUpstream:
    """One channel per replica address, opened on first use, closed with the gateway."""

    def __init__(self, read_s: float) -> None:
        self._read_s = read_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, url: str) -> grpc.aio.Channel:
        channel = self._channels.get(url)
        if channel is None:
            channel = self._channels[url] = grpc.aio.insecure_channel(url[len(SCHEME):], options=CHANNEL_OPTIONS)
        return channel

    def serves(self, replicas: list[Replica]) -> bool:
        return any(is_grpc(replica.url) for replica in replicas)

    async def plan(self, path: str, payload: bytes, stream: bool) -> GrpcPlan:
        """The translated request (raises `NotCarriedError` or `InvalidRequestError`)."""
        if len(payload) > OFFLOAD_BYTES:
            return await asyncio.to_thread(plan, path, json.loads(payload), stream)
        return plan(path, json.loads(payload), stream)

    async def first_part(self, replica: Replica, grpc_plan: GrpcPlan, stream: bool, attempt: int,
                         headers: Mapping[str, str]) -> UpstreamAnswer:
        """The attempt's answer: the whole body, or a stream's first message as SSE with the rest to
        follow. The proxy bounds a stream's wait for its first message (`first_byte_s`)."""
        stub = pb_grpc.InferenceStub(self._channel(replica.url))
        metadata = _metadata(headers)
        if not stream:
            rpc = stub.Chat if grpc_plan.chat else stub.Generate
            try:
                reply = await rpc(grpc_plan.request, metadata=metadata, timeout=self._read_s)
            except grpc.aio.AioRpcError as exc:
                return self._error_answer(replica, exc, attempt)
            return UpstreamAnswer(replica, 200, "application/json", attempt, body=answer_json(grpc_plan, reply))
        call = (stub.ChatStream if grpc_plan.chat else stub.GenerateStream)(grpc_plan.request, metadata=metadata)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            return self._error_answer(replica, exc, attempt)
        except BaseException:  # the first-byte deadline, or the client left: stop the generation
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            raise GrpcStreamError("the replica closed the stream before sending anything")
        relay = GrpcStream(call, grpc_plan, self._read_s)
        return UpstreamAnswer(replica, 200, "text/event-stream", attempt, first_chunk=stream_frames(grpc_plan, first),
                              rest=relay.rest(), _response=relay)

    @staticmethod
    def _error_answer(replica: Replica, exc: grpc.aio.AioRpcError, attempt: int) -> UpstreamAnswer:
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            raise GrpcReadTimeout("the replica did not answer within timeouts.read_s") from None
        error = _replica_error(exc)
        if error is None and exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            # gRPC's own refusal of a message over the replica's --max-body-bytes: the request's fault.
            error = (413, error_body(f"the request is larger than the replica accepts ({exc.details()})",
                                     "invalid_request_error", None, "request_too_large"), None)
        if error is None:
            raise GrpcConnectError(f"gRPC {exc.code().name}: {exc.details()}") from None
        status, body, retry_after = error
        return UpstreamAnswer(replica, status, "application/json", attempt,
                              body=json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
                              retry_after=retry_after)

    async def probe(self, url: str, timeout_s: float) -> bool:
        """grpc.health.v1 Check of the Inference service: SERVING or not."""
        stub = health_pb2_grpc.HealthStub(self._channel(url))
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def forget(self, url: str) -> None:
        """Close the channel to a replica that left the configuration (a later call reopens it)."""
        channel = self._channels.pop(url, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
