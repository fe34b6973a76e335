"""One streamed chat request through a real gateway and a real `kvik serve` replica, traced.

Both processes export OpenTelemetry spans over OTLP/HTTP to a receiver this test runs
(`tests.otlp_receiver`, decoding the protobuf with opentelemetry-proto). The request comes from the
official `openai` SDK with no trace context, so the gateway starts the trace; the test checks that
every span of the request arrives, all under one trace id, each under the right parent (across the
gateway -> replica HTTP hop, whose `traceparent` the gateway sets), with the GenAI attributes, and
that the replica's log lines carry the trace id. The same holds across a gRPC hop (a `grpc://`
replica URL: the gateway sends `traceparent` as call metadata, the replica's call span continues it).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from tests.gateway.harness import (UPSTREAM_MODEL, GatewayFactory, ServerProcess, free_port,
                                   kvik_serve_command, model_config)
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytest.importorskip("torch")  # the replica is kvik serve
pytest.importorskip("opentelemetry.sdk")
openai = pytest.importorskip("openai")
connect = pytest.importorskip("websockets.sync.client").connect
pytestmark = pytest.mark.timeout(300)

GATEWAY_SPANS = {"POST /v1/chat/completions", "auth", "rate_limit", "route", "upstream"}
SERVER_SPANS = {"POST /v1/chat/completions", "tokenize", "generate", "queue", "prefill", "decode", "detokenize"}
MAX_TOKENS = 4
SERVER_KIND, CLIENT_KIND = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


def _by_name(spans: list[ReceivedSpan], service: str) -> dict[str, ReceivedSpan]:
    named: dict[str, ReceivedSpan] = {}
    for span in spans:
        if span.service == service:
            assert span.name not in named, f"two {service} spans named {span.name!r}"
            named[span.name] = span
    return named


def _complete(trace_id: str, spans: list[ReceivedSpan]) -> bool:
    mine = [s for s in spans if s.trace_id == trace_id]
    return ({s.name for s in mine if s.service == "kvik-gateway"} >= GATEWAY_SPANS
            and {s.name for s in mine if s.service == "kvik-server"} >= SERVER_SPANS)


def test_streamed_request_is_one_trace_across_gateway_replica_and_engine(
        tiny_llama: Path, workdir: Path, gateways: GatewayFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Export every 100 ms instead of every 5 s, so the spans arrive while the processes run.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with OtlpReceiver() as receiver:
        port, grpc_port = free_port(), free_port()
        replica = ServerProcess(
            [*kvik_serve_command(tiny_llama, port, log_prompts=True), "--otlp-traces-endpoint", receiver.url,
             "--grpc-port", str(grpc_port)],
            port, workdir / f"traced-replica-{port}.log", env={"OMP_NUM_THREADS": "1", "KVIK_CPU_KERNELS": "0"})
        try:
            replica.start(timeout=120)
            gateway = gateways.start({
                "models": [model_config("tiny", [replica]),
                           {"name": "tiny-grpc", "upstream_model": UPSTREAM_MODEL,
                            "replicas": [{"url": f"grpc://127.0.0.1:{grpc_port}"}]}],
                "tracing": {"otlp_traces_endpoint": receiver.url, "sample_ratio": 1.0},
            }, name="traced")
            key = gateway.create_key(name="tracing")
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)
            stream = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Say something about tracing."}],
                max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
            usage = chunks[-1].usage
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]

            spans = receiver.wait_for(lambda got: any(
                s.name == "generate" and _complete(s.trace_id, got) for s in got))
            trace_id = next(s.trace_id for s in spans if s.name == "generate")
            mine = [s for s in spans if s.trace_id == trace_id]
            gw = _by_name(mine, "kvik-gateway")
            sv = _by_name(mine, "kvik-server")
            assert set(gw) == GATEWAY_SPANS and set(sv) == SERVER_SPANS, (set(gw), set(sv))

            # Parent links: the gateway's request span is the root (the client sent no traceparent).
            root = gw["POST /v1/chat/completions"]
            assert root.parent_span_id is None and root.kind == SERVER_KIND
            for name in ("auth", "rate_limit", "route", "upstream"):
                assert gw[name].parent_span_id == root.span_id, name
            assert gw["upstream"].kind == CLIENT_KIND
            # Across the HTTP hop: the replica's request span continues the upstream attempt's.
            request = sv["POST /v1/chat/completions"]
            assert request.parent_span_id == gw["upstream"].span_id and request.kind == SERVER_KIND
            for name in ("tokenize", "generate"):
                assert sv[name].parent_span_id == request.span_id, name
            for name in ("queue", "prefill", "decode", "detokenize"):
                assert sv[name].parent_span_id == sv["generate"].span_id, name

            # Phases in order, inside their parents.
            # (The replica's span may end a little after the gateway's attempt: the relay is done
            # at `data: [DONE]`, the replica's span after its response closes.)
            assert root.start_ns <= gw["upstream"].start_ns <= request.start_ns
            assert gw["upstream"].end_ns <= root.end_ns
            assert sv["tokenize"].end_ns <= sv["generate"].start_ns
            assert sv["queue"].end_ns <= sv["prefill"].start_ns + 1
            assert sv["prefill"].end_ns <= sv["decode"].start_ns + 1
            assert sv["generate"].start_ns <= sv["queue"].start_ns and sv["decode"].end_ns <= sv["generate"].end_ns

            # GenAI semantic-convention attributes, matching what the client was told.
            attrs = request.attributes
            assert attrs["gen_ai.operation.name"] == "chat"
            assert attrs["gen_ai.request.model"] == UPSTREAM_MODEL
            assert attrs["gen_ai.request.max_tokens"] == MAX_TOKENS
            assert attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens
            assert attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens
            assert attrs["gen_ai.response.finish_reasons"] == finish
            assert attrs["http.response.status_code"] == 200
            assert sv["generate"].attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
            assert sv["decode"].attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
            assert root.attributes["gen_ai.request.model"] == "tiny"
            assert root.attributes["http.response.status_code"] == 200
            assert gw["upstream"].attributes["kvik.replica"] == replica.url
            assert all(s.status_code != 2 for s in mine)

            # Logs carry the trace id: the replica's request line, in its text and in its JSON.
            lines = [line for line in replica.log_path.read_text().splitlines() if "kvik.server.requests" in line]
            traced = [line for line in lines if f"trace_id={trace_id}" in line]
            assert traced, lines
            assert json.loads(traced[-1].partition("kvik.server.requests: ")[2])["trace_id"] == trace_id

            # The WebSocket bridge: a request on a socket whose handshake carried a traceparent
            # joins that trace, gateway and replica alike.
            client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
            ws_url = gateway.url.replace("http://", "ws://") + "/v1/chat/completions"
            with connect(ws_url, additional_headers={"Authorization": f"Bearer {key}",
                                                     "traceparent": f"00-{client_trace}-{client_span}-01"}) as socket:
                assert json.loads(socket.recv(timeout=30))["type"] == "session.created"
                socket.send(json.dumps({"type": "response.create", "stream_id": "s1", "model": "tiny",
                                        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}))
                while (event := json.loads(socket.recv(timeout=60)))["type"] != "response.done":
                    pass
                assert event["status"] == "completed"
            spans = receiver.wait_for(lambda got: _complete(client_trace, got))
            ws_root = next(s for s in spans if s.trace_id == client_trace and s.service == "kvik-gateway"
                           and s.name == "POST /v1/chat/completions")
            assert ws_root.parent_span_id == client_span

            # The gRPC hop: the replica's call span continues the gateway's upstream attempt.
            grpc_chunks = list(client.chat.completions.create(
                model="tiny-grpc", messages=[{"role": "user", "content": "Trace me over gRPC."}],
                max_tokens=MAX_TOKENS, stream=True))
            assert grpc_chunks[-1].choices[0].finish_reason in ("length", "stop")
            call_name = "kvik.inference.v1.Inference/ChatStream"

            def grpc_traced(got: list[ReceivedSpan]) -> bool:
                calls = [s for s in got if s.name == call_name]
                return any({x.name for x in got if x.trace_id == call.trace_id} >= {"upstream", "generate", "decode"}
                           for call in calls)

            spans = receiver.wait_for(grpc_traced)
            call = next(s for s in spans if s.name == call_name)
            mine = [s for s in spans if s.trace_id == call.trace_id]
            gw, sv = _by_name(mine, "kvik-gateway"), _by_name(mine, "kvik-server")
            assert call.kind == SERVER_KIND and call.parent_span_id == gw["upstream"].span_id
            assert gw["upstream"].attributes["kvik.replica"] == f"grpc://127.0.0.1:{grpc_port}"
            assert call.attributes["rpc.system"] == "grpc" and call.attributes["gen_ai.operation.name"] == "chat"
            for name in ("tokenize", "generate"):
                assert sv[name].parent_span_id == call.span_id, name
            assert sv["decode"].parent_span_id == sv["generate"].span_id
        finally:
            replica.stop()

