"""The `kvik.inference.v1.Inference` service: chat and generate, unary and server-streaming.

Each call runs the path an HTTP request runs: the same request models and preprocessing
(`kvik.server.serving.preprocess`), the same admission (`Admission`: capacity, the request log line),
the same engine stream (`tracked_generate`: metrics), and the same answer objects (`ChatServing`,
`CompletionServing`), converted to protobuf at the end (`kvik.server.grpc.convert`).

Errors leave as gRPC status codes: INVALID_ARGUMENT for bad input (the message names the field and
says what to fix), NOT_FOUND for an unknown model, UNAUTHENTICATED without the server's key,
RESOURCE_EXHAUSTED when the server is at capacity, UNAVAILABLE while loading or draining or when the
engine died. The OpenAI error's type, code and param travel in the trailing metadata (`kvik-error-*`,
and `retry-after` in seconds), so a gateway can give its client the same error the HTTP API would.

A call the client cancels, or whose deadline passes, is cancelled by gRPC; leaving the engine's
stream then aborts the request in the engine (as a client disconnect does over HTTP).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from pydantic import ValidationError

from kvik.core import tracing
from kvik.core.errors import AuthenticationError, InvalidRequestError, KvikError, RetryableError, ServiceUnavailableError
from kvik.protocol.grpc import inference_pb2 as pb
from kvik.protocol.grpc import inference_pb2_grpc as pb_grpc
from kvik.server.app import validation_message
from kvik.server.grpc import convert
from kvik.server.model_pool import lease_scope
from kvik.server.serving.chat import ChatServing
from kvik.server.serving.completions import CompletionServing
from kvik.server.serving.preprocess import PreparedRequest, prepare_chat, prepare_completion
from kvik.server.serving.streams import merged
from kvik.server.serving.tracking import Admission, records_usage, tracked_generate
from kvik.server.state import ServerState

logger = logging.getLogger("kvik.server.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # kvik.inference.v1.Inference

# OpenAI-style HTTP status -> gRPC status (the standard mapping, read backwards).
_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
           408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.INVALID_ARGUMENT,
           429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED}


def status_code(exc: KvikError) -> grpc.StatusCode:
    if isinstance(exc, ServiceUnavailableError):  # also EngineDeadError
        return grpc.StatusCode.RESOURCE_EXHAUSTED if exc.code == "server_overloaded" else grpc.StatusCode.UNAVAILABLE
    return _STATUS.get(exc.http_status, grpc.StatusCode.INTERNAL)


def _ascii(value: Any) -> str:
    return _bounded(str(value).encode("ascii", "replace").decode("ascii"), MAX_PARAM_BYTES)


# gRPC carries the status message and the trailers in HTTP/2 headers, which a client refuses past
# its metadata limit (grpcio: 8 KiB soft, 16 KiB hard, percent-encoding included): an error that
# quotes a client's 20,000-character model name reached the client as RESOURCE_EXHAUSTED "Stream
# removed" instead of NOT_FOUND. Errors quote at most this much.
MAX_DETAILS_BYTES = 1024
MAX_PARAM_BYTES = 256


def _bounded(text: str, limit: int) -> str:
    raw = text.encode()
    if len(raw) <= limit:
        return text
    return raw[:limit].decode(errors="ignore") + "... (cut)"


def details(exc: KvikError) -> str:
    """The status message: the error's message, cut to fit any client's metadata limit."""
    return _bounded(exc.message, MAX_DETAILS_BYTES)


def error_metadata(exc: KvikError) -> tuple[tuple[str, str], ...]:
    """The OpenAI error's fields, for a client that wants to rebuild the HTTP API's error body."""
    pairs = [("kvik-error-type", exc.error_type)]
    if exc.code is not None:
        pairs.append(("kvik-error-code", _ascii(exc.code)))
    if exc.param is not None:
        pairs.append(("kvik-error-param", _ascii(exc.param)))
    if isinstance(exc, RetryableError):
        pairs.append(("retry-after", str(max(1, math.ceil(exc.retry_after)))))
    return tuple(pairs)


def _trace_headers(context: grpc.aio.ServicerContext) -> list[tuple[bytes, bytes]]:
    """The call's metadata as header pairs, for `tracing.server_span` (it reads `traceparent`)."""
    return [(key.encode("latin-1"), value.encode("latin-1")) for key, value in context.invocation_metadata() or ()
            if isinstance(value, str)]


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.completions = CompletionServing(state)
        self._aborts: set[asyncio.Task[None]] = set()

    def _ended(self, prepared: PreparedRequest, admission: Admission, exc: BaseException) -> None:
        """A call that ended early: its status for the request log, and for a cancelled call (client
        gone, deadline passed) an abort of its engine requests in a task of its own. The streams'
        own clean-up aborts them too, but a second cancellation of the call can cut that short;
        aborting twice is harmless."""
        admission.fail(_status_of(exc), str(exc))
        if isinstance(exc, Exception):
            return
        for prompt in prepared.prompts:
            task = asyncio.ensure_future(prepared.engine.abort(prompt.request.request_id))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)

    @contextlib.asynccontextmanager
    async def _call(self, context: grpc.aio.ServicerContext, method: str) -> AsyncIterator[None]:
        """Key check, drain accounting, the trace span, model leases, and errors as status codes."""
        state = self.state
        state.request_started()  # the drain waits for calls in flight, as for HTTP requests
        # The call's deadline, enforced here too: a loaded server was seen to miss gRPC's own
        # cancellation and generate a whole answer nobody would read.
        remaining = context.time_remaining()
        deadline = None
        if remaining is not None:
            deadline = asyncio.get_running_loop().call_later(max(0.0, remaining), _cancel, asyncio.current_task())
        try:
            with tracing.server_span(f"{SERVICE_NAME}/{method}", _trace_headers(context),
                                     {"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": method}), \
                    lease_scope():
                try:
                    self._authorize(context)
                    yield
                except ValidationError as exc:
                    message, param = validation_message(exc)  # type: ignore[arg-type]
                    await self._abort(context, InvalidRequestError(message, param=param))
                except KvikError as exc:
                    await self._abort(context, exc)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # a bug or an engine failure: say which, as the HTTP API does
                    logger.exception("gRPC %s failed", method)
                    await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {type(exc).__name__}",
                                        trailing_metadata=(("kvik-error-type", "server_error"),))
        finally:
            if deadline is not None:
                deadline.cancel()
            state.request_finished()

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        expected = self.state.config.api_key
        if expected is None:
            return
        metadata = dict(context.invocation_metadata() or ())
        scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
            raise AuthenticationError("Incorrect or missing API key: send the metadata "
                                      "'authorization: Bearer <key>'")

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, exc: KvikError) -> None:
        code = status_code(exc)
        if code is grpc.StatusCode.INTERNAL:
            logger.error("gRPC call failed: %s", exc.message)
        await context.abort(code, details(exc), trailing_metadata=error_metadata(exc))

    @contextlib.contextmanager
    def _admitted(self, prepared: PreparedRequest, endpoint: str, stream: bool) -> Iterator[Admission]:
        """Capacity for the call's sequences, held until it ends; a call that fails or is cancelled
        is logged with its real status."""
        admission = Admission(self.state, prepared.num_sequences, request_id=prepared.request_id,
                              endpoint=endpoint, model=prepared.model, arrival=prepared.arrival,
                              records=[p.record for p in prepared.prompts], stream=stream,
                              prompt=[p.text for p in prepared.prompts] if endpoint == "completions"
                              else prepared.prompts[0].text)
        try:
            yield admission
        except BaseException as exc:
            self._ended(prepared, admission, exc)
            raise
        finally:
            admission.release()

    # -- chat --

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> pb.ChatResponse:
        async with self._call(context, "Chat"):
            body = convert.chat_request(request, stream=False)
            prepared = await prepare_chat(self.state, body)
            prompt = prepared.prompts[0]
            with self._admitted(prepared, "chat", False):
                choices = await ChatServing.collect(
                    tracked_generate(self.state, prepared.engine, prompt.request, prompt.text, prompt.record))
            return convert.chat_response(ChatServing.completion_body(body, prepared, choices))
        raise AssertionError("unreachable: _call aborts or returns")  # pragma: no cover

    async def ChatStream(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[pb.ChatStreamResponse]:
        async with self._call(context, "ChatStream"):
            body = convert.chat_request(request, stream=True)
            prepared = await prepare_chat(self.state, body)
            prompt = prepared.prompts[0]
            with self._admitted(prepared, "chat", True):
                stream = tracked_generate(self.state, prepared.engine, prompt.request, prompt.text, prompt.record)
                async for chunk in ChatServing.chunk_stream(body, prepared, stream):
                    yield convert.chat_stream_response(chunk)

    # -- generate --

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> pb.GenerateResponse:
        async with self._call(context, "Generate"):
            body = convert.completion_request(request, stream=False)
            prepared = await prepare_completion(self.state, body)
            with self._admitted(prepared, "completions", False):
                streams = [tracked_generate(self.state, prepared.engine, p.request, p.text, p.record)
                           for p in prepared.prompts]
                # The HTTP endpoint's own collection and response object.
                choices, prompt_logprobs = await self.completions.collect(streams)
            answer = self.completions.completion_body(body, prepared, choices, prompt_logprobs)
            response = pb.GenerateResponse(id=answer["id"], model=answer["model"], created=answer["created"],
                                           usage=convert.usage(answer["usage"]))
            for (_, index), choice in sorted(choices.items()):
                text = answer["choices"][index]
                response.choices.append(pb.GenerateChoice(
                    index=index, text=text["text"], token_ids=choice.token_ids,
                    finish_reason=text["finish_reason"] or "", stop_reason=convert.stop_reason(text["stop_reason"])))
            return response
        raise AssertionError("unreachable: _call aborts or returns")  # pragma: no cover

    async def GenerateStream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async with self._call(context, "GenerateStream"):
            body = convert.completion_request(request, stream=True)
            prepared = await prepare_completion(self.state, body)
            header = {"id": prepared.request_id, "model": prepared.model, "created": int(prepared.arrival)}
            records = [p.record for p in prepared.prompts]
            with self._admitted(prepared, "completions", True):
                streams = [tracked_generate(self.state, prepared.engine, p.request, p.text, p.record)
                           for p in prepared.prompts]
                async for _, output in merged(streams):
                    choices = [pb.GenerateChoice(index=delta.index, text=delta.text, token_ids=list(delta.token_ids),
                                                 finish_reason=delta.finish_reason or "",
                                                 stop_reason=convert.stop_reason(delta.stop_reason))
                               for delta in output.outputs if delta.text or delta.token_ids or delta.finish_reason]
                    if choices:
                        yield pb.GenerateStreamResponse(**header, choices=choices)
                yield pb.GenerateStreamResponse(**header, usage=convert.usage(records_usage(records)))


def _cancel(task: asyncio.Task[Any] | None) -> None:
    if task is not None and not task.done():
        task.cancel()


def _status_of(exc: BaseException) -> int:
    """The HTTP-style status the request log line records for a call that ended with `exc`."""
    if isinstance(exc, KvikError):
        return exc.http_status
    if not isinstance(exc, Exception):
        return 499  # cancelled: the client left or its deadline passed
    return 500
