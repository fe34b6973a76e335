"""`kvik serve --grpc-port`: the kvik.inference.v1.Inference service, grpc.health.v1 and reflection,
called with grpcio's own client against a real server process on the tiny model.

What is checked: greedy answers over gRPC equal the HTTP API's (chat and completions, unary and
streamed); a cancelled call and a passed deadline abort the engine's request (read from the
server's Prometheus gauges and token counter); bad input is INVALID_ARGUMENT naming the field; a
full server says RESOURCE_EXHAUSTED, a draining one UNAVAILABLE while health turns NOT_SERVING;
reflection lists the service; the API server process still never maps libtorch.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import httpx
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("torch")  # kvik serve's engine

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase  # noqa: E402

from kvik.protocol.grpc import inference_pb2 as pb  # noqa: E402
from kvik.protocol.grpc import inference_pb2_grpc as pb_grpc  # noqa: E402
from tests.server.conftest import metric_value  # noqa: E402
from tests.support.processes import ServerProcess, free_port  # noqa: E402

SERVICE = "kvik.inference.v1.Inference"
KEY = "grpc-test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
LONG = 2000  # tokens: far more than a test waits for, within the servers' 2048-token context


@pytest.fixture(scope="module")
def served(server_factory) -> tuple[ServerProcess, str]:
    """A server with a key and room for two sequences (so overload is easy to reach). Single steps
    and a 2048-token context: the deadline, cancel and overload tests need a long answer to still be
    generating. In runs of forwards (multi-step decoding) the tiny model can write 480 tokens in
    well under 0.1 s, and on a fast machine 500 single steps took 0.11 s (4,400 tokens/s)."""
    grpc_port = free_port()
    server = server_factory("--grpc-port", str(grpc_port), "--api-key", KEY, "--max-num-seqs", "2",
                            "--max-waiting", "0", "--num-scheduler-steps", "1", "--max-model-len", "2048")
    return server, f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def stub(served) -> pb_grpc.InferenceStub:
    with grpc.insecure_channel(served[1]) as channel:
        yield pb_grpc.InferenceStub(channel)


def chat_request(content: str, max_tokens: int = 8, **sampling: Any) -> pb.ChatRequest:
    return pb.ChatRequest(model="tiny", messages=[pb.ChatMessage(role="user", text=content)],
                          sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))


def http(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.base_url + path, json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def metrics(server: ServerProcess) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def wait_idle(server: ServerProcess) -> str:
    """The metrics once no request is running (the aborted one has left the engine)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = metrics(server)
        if metric_value(text, "kvik:num_requests_running") == 0:
            return text
        time.sleep(0.05)
    pytest.fail("a request was still running 10 s after its call ended")


def test_greedy_answers_over_grpc_equal_the_http_apis(served, stub) -> None:
    server, _ = served
    request = chat_request("Tell me about gRPC", temperature=0)
    unary = stub.Chat(request, metadata=AUTH)
    streamed = list(stub.ChatStream(request, metadata=AUTH))
    over_http = http(server, "/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Tell me about gRPC"}], "max_tokens": 8,
        "temperature": 0})

    text = over_http["choices"][0]["message"]["content"]
    assert unary.choices[0].message.text == text and unary.choices[0].message.role == "assistant"
    assert unary.choices[0].finish_reason == over_http["choices"][0]["finish_reason"]
    assert unary.usage.prompt_tokens == over_http["usage"]["prompt_tokens"]
    assert unary.usage.completion_tokens == over_http["usage"]["completion_tokens"] == 8
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(m.choices[0].delta.content for m in streamed if m.choices) == text
    assert [m.choices[0].finish_reason for m in streamed if m.choices][-1] == "length"
    assert not streamed[-1].choices and streamed[-1].usage.completion_tokens == 8  # the final message
    assert len({m.id for m in streamed}) == 1 and streamed[0].id.startswith("chatcmpl-")

    completion = http(server, "/completions", {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8,
                                               "temperature": 0})
    generate = pb.GenerateRequest(model="tiny", text="Once upon a time",
                                  sampling=pb.SamplingParams(max_tokens=8, temperature=0))
    answer = stub.Generate(generate, metadata=AUTH)
    deltas = list(stub.GenerateStream(generate, metadata=AUTH))
    assert answer.choices[0].text == completion["choices"][0]["text"]
    assert "".join(c.text for m in deltas for c in m.choices) == answer.choices[0].text
    assert [t for m in deltas for c in m.choices for t in c.token_ids] == list(answer.choices[0].token_ids)
    assert len(answer.choices[0].token_ids) == 8 and deltas[-1].usage.completion_tokens == 8
    # The prompt as token ids gives the same answer as its text.
    ids = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": "Once upon a time"},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()["tokens"]
    by_ids = stub.Generate(pb.GenerateRequest(model="tiny", token_ids=pb.TokenIds(ids=ids),
                                              sampling=generate.sampling), metadata=AUTH)
    assert by_ids.choices[0].text == answer.choices[0].text


def test_a_cancelled_stream_aborts_the_engine_request(served, stub) -> None:
    server, _ = served
    before = metric_value(metrics(server), "kvik:generation_tokens_total")
    call = stub.GenerateStream(pb.GenerateRequest(
        model="tiny", text="A long story", sampling=pb.SamplingParams(max_tokens=LONG, ignore_eos=True)),
        metadata=AUTH)
    for _ in range(3):
        next(call)
    assert metric_value(metrics(server), "kvik:num_requests_running") == 1
    call.cancel()
    generated = metric_value(wait_idle(server), "kvik:generation_tokens_total") - before
    assert generated < LONG


def test_a_passed_deadline_is_deadline_exceeded_and_aborts(served, stub) -> None:
    server, _ = served
    before = metric_value(metrics(server), "kvik:generation_tokens_total")
    # 50 ms: the tiny model's 2000 single steps take about 0.45 s on a fast machine.
    with pytest.raises(grpc.RpcError) as caught:
        stub.Chat(chat_request("Another long story", LONG, ignore_eos=True), metadata=AUTH, timeout=0.05)
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    generated = metric_value(wait_idle(server), "kvik:generation_tokens_total") - before
    assert generated < LONG


def _error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if not hasattr(result, "choices"):
            list(result)  # a stream: its status comes with the first read
    return caught.value


def test_bad_input_is_invalid_argument_saying_what_to_fix(stub) -> None:
    cases = [
        (lambda: stub.Chat(chat_request("hi", temperature=-1), metadata=AUTH), "temperature", "temperature:"),
        (lambda: stub.ChatStream(chat_request("hi", temperature=-1), metadata=AUTH), "temperature", "temperature:"),
        (lambda: stub.Chat(pb.ChatRequest(model="tiny"), metadata=AUTH), "messages", "messages:"),
        (lambda: stub.Chat(pb.ChatRequest(model="tiny", messages=[pb.ChatMessage(role="wizard", text="hi")]),
                           metadata=AUTH), "messages.0.role", "messages.0.role:"),
        (lambda: stub.Generate(pb.GenerateRequest(model="tiny"), metadata=AUTH), "prompt", "prompt: set"),
        (lambda: stub.Generate(pb.GenerateRequest(model="tiny", text="hi", sampling=pb.SamplingParams(
            max_tokens=100_000)), metadata=AUTH), "max_tokens", "maximum context length is 2048"),
        (lambda: stub.Chat(pb.ChatRequest(model="tiny", messages=[pb.ChatMessage(
            role="user", parts=pb.ContentParts(parts=[pb.ContentPart(type="image_url")]))]), metadata=AUTH),
         "messages.0.content", "messages[0].content: part type 'image_url' is not supported"),
    ]
    for call, param, says in cases:
        error = _error(call)
        trailing = dict(error.trailing_metadata())
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (param, error.details())
        assert trailing["kvik-error-type"] == "invalid_request_error"
        assert trailing.get("kvik-error-param") == param, (param, error.details(), trailing)
        assert says in error.details(), error.details()

    unknown = _error(lambda: stub.Chat(pb.ChatRequest(model="nope", messages=[pb.ChatMessage(
        role="user", text="hi")]), metadata=AUTH))
    assert unknown.code() is grpc.StatusCode.NOT_FOUND and "'tiny'" in unknown.details()
    # An error that quotes a huge client value still fits the client's metadata limit (it arrived as
    # RESOURCE_EXHAUSTED "Stream removed" before; found by fuzzing the gRPC API).
    for model in ("m" * 20_000, "é" * 5_000):
        huge = _error(lambda: stub.Chat(pb.ChatRequest(model=model, messages=[pb.ChatMessage(
            role="user", text="hi")]), metadata=AUTH))
        assert huge.code() is grpc.StatusCode.NOT_FOUND, huge.details()[:200]
        assert huge.details().endswith("... (cut)") and len(huge.details().encode()) < 1100
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        denied = _error(lambda: stub.Chat(chat_request("hi"), metadata=metadata))
        assert denied.code() is grpc.StatusCode.UNAUTHENTICATED and "authorization" in denied.details()


def test_a_full_server_says_resource_exhausted(served, stub) -> None:
    server, _ = served
    busy = [stub.GenerateStream(pb.GenerateRequest(model="tiny", text=f"busy {i}", sampling=pb.SamplingParams(
        max_tokens=LONG, ignore_eos=True)), metadata=AUTH) for i in range(2)]
    for call in busy:
        next(call)  # both admitted and running: the server's two slots are taken
    try:
        error = _error(lambda: stub.Chat(chat_request("one more"), metadata=AUTH))
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        trailing = dict(error.trailing_metadata())
        assert trailing["kvik-error-code"] == "server_overloaded" and int(trailing["retry-after"]) >= 1
    finally:
        for call in busy:
            call.cancel()
    wait_idle(server)


def test_health_reflection_and_no_torch_in_the_api_server(served) -> None:
    psutil = pytest.importorskip("psutil")
    server, address = served
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as caught:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND

        reflected = ProtoReflectionDescriptorDatabase(channel)
        services = set(reflected.get_services())
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        described = reflected.FindFileContainingSymbol(SERVICE)
        assert described.package == "kvik.inference.v1"
        assert [m.name for m in described.service[0].method] == ["Generate", "GenerateStream", "Chat", "ChatStream"]
    assert server.process is not None
    maps = psutil.Process(server.process.pid).memory_maps()
    assert not [m.path for m in maps if "libtorch" in m.path]


def test_draining_is_unavailable_and_health_turns_not_serving(server_factory) -> None:
    grpc_port = free_port()
    server = server_factory("--grpc-port", str(grpc_port), "--drain-timeout", "60")
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        call = stub.GenerateStream(pb.GenerateRequest(model="tiny", text="drain", sampling=pb.SamplingParams(
            max_tokens=300, ignore_eos=True)))
        first = next(call)
        server.process.send_signal(signal.SIGTERM)
        rest: list[pb.GenerateStreamResponse] = []
        reader = threading.Thread(target=lambda: rest.extend(call))
        reader.start()
        deadline = time.monotonic() + 5
        while health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status \
                != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health still SERVING 5 s after SIGTERM"
            time.sleep(0.05)
        refused = _error(lambda: stub.Chat(chat_request("too late")))
        assert refused.code() is grpc.StatusCode.UNAVAILABLE
        assert dict(refused.trailing_metadata())["kvik-error-code"] == "draining"
        reader.join(60)
    # The call in flight finished in full, then the server exited cleanly.
    tokens = len(first.choices[0].token_ids) + sum(len(c.token_ids) for m in rest for c in m.choices)
    assert tokens == 300 and rest[-1].usage.completion_tokens == 300
    assert server.process.wait(timeout=30) == 0


def test_an_engine_death_is_unavailable_and_health_turns_not_serving(server_factory) -> None:
    psutil = pytest.importorskip("psutil")
    grpc_port = free_port()
    # Single steps and room for LONG tokens: the stream must still be running when its engine dies.
    server = server_factory("--grpc-port", str(grpc_port), "--num-scheduler-steps", "1", "--max-model-len", "2048")
    assert server.process is not None
    engines = [child for child in psutil.Process(server.process.pid).children()
               if any("libtorch" in m.path for m in child.memory_maps())]
    assert len(engines) == 1
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        call = stub.GenerateStream(pb.GenerateRequest(model="tiny", text="doomed", sampling=pb.SamplingParams(
            max_tokens=LONG, ignore_eos=True)))
        next(call)
        engines[0].kill()
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        assert dict(caught.value.trailing_metadata())["kvik-error-code"] == "engine_dead"
        # Health follows at once; the process exits (status 1) a second after the engine died.
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status
        deadline = time.monotonic() + 0.5
        while status != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < deadline:
            time.sleep(0.02)
            status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert server.process.wait(timeout=30) == 1
