"""What the gateway reads from a Responses API body and stream: the texts guardrails see and
rewrite, the tokens it reserves, the fields it checks, and the events that end a stream and carry
its usage. The whole path, with real replicas, is in test_e2e_kvik_serve.py."""

from __future__ import annotations

import json

import pytest

from kvik.core.errors import InvalidRequestError
from kvik.gateway.guardrails.text import replace_request_texts, request_texts
from kvik.gateway.relay import classify_error
from kvik.gateway.request_body import RESPONSES, parse_body
from kvik.gateway.sse import inspect_response_event
from kvik.gateway.tokens import TEMPLATE_TOKENS_PER_MESSAGE, estimate_tokens

ITEMS = [
    {"role": "user", "content": "mail a@b.c"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "part one"},
                                                    {"type": "input_image", "image_url": "x"}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "said"}]},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"q\": \"model's own\"}"},
    {"type": "function_call_output", "call_id": "c1", "output": "tool says a@b.c"},
    {"type": "reasoning", "summary": []},
]


def test_instructions_and_every_text_an_input_item_carries_are_guardrail_texts() -> None:
    body = {"model": "m", "instructions": "be brief", "input": ITEMS}
    texts = request_texts(body)
    assert texts == ["be brief", "mail a@b.c", "part one", "said", "tool says a@b.c"]
    redacted = replace_request_texts(body, [t.replace("a@b.c", "[EMAIL]") for t in texts])
    assert redacted["instructions"] == "be brief"
    assert redacted["input"][0]["content"] == "mail [EMAIL]"
    assert redacted["input"][1]["content"][1] == ITEMS[1]["content"][1]  # not text: untouched
    assert redacted["input"][3] == ITEMS[3]  # the model's own call is not client text
    assert redacted["input"][4]["output"] == "tool says [EMAIL]"
    assert body["input"][0]["content"] == "mail a@b.c"  # a copy
    assert request_texts({"model": "m", "input": "just text"}) == ["just text"]
    # Any JSON where a type belongs (the mutation fuzzer found a list there a 500): not text, no error.
    odd = [{"role": "user", "content": [{"type": [1], "text": "t"}, {"type": {"a": 1}, "text": "u"}]},
           {"type": [2], "output": "v"}, {"type": "function_call_output", "output": [{"type": None}]}]
    assert request_texts({"model": "m", "input": odd}) == []


def test_the_estimate_counts_items_as_messages_and_max_output_tokens_as_the_completion() -> None:
    body = {"model": "m", "instructions": "hi", "input": ITEMS[:2], "max_output_tokens": 40}
    texts = request_texts(body)
    estimate = estimate_tokens(body, texts, reserve_completion_tokens=256)
    assert estimate.prompt == sum(len(t) for t in texts) + TEMPLATE_TOKENS_PER_MESSAGE * 3
    assert (estimate.completion, estimate.explicit) == (40, True)
    assert estimate_tokens({"model": "m", "input": "x"}, ["x"], reserve_completion_tokens=256).completion == 256
    # A continuation is also prompted with the stored conversation: that is reserved too.
    continued = estimate.continuing(500)
    assert (continued.prompt, continued.completion, continued.explicit) == (estimate.prompt + 500, 40, True)


@pytest.mark.parametrize("field,value", [
    ("max_output_tokens", 0), ("max_output_tokens", "9"), ("previous_response_id", ""),
    ("previous_response_id", "r" * 129), ("previous_response_id", 7), ("store", "yes"),
])
def test_fields_the_gateway_acts_on_are_checked(field, value) -> None:
    body = {"model": "m", "input": "x", field: value}
    with pytest.raises(InvalidRequestError) as caught:
        parse_body(json.dumps(body).encode(), RESPONSES)
    assert caught.value.param == field


def test_a_missing_input_is_named() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_body(b'{"model": "m"}', RESPONSES)
    assert caught.value.param == "input"


def event(kind: str, **payload) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': 0, **payload})}\n\n".encode()


def test_completed_ends_the_stream_with_usage_and_deltas_count_as_content() -> None:
    created = inspect_response_event(event("response.created", response={"id": "resp_1", "usage": None}))
    assert (created.response_id, created.done, created.usage, created.error) == ("resp_1", False, None, None)
    assert inspect_response_event(event("response.output_text.delta", delta="hi")).content_deltas == 1
    assert inspect_response_event(event("response.output_text.delta", delta="")).content_deltas == 0
    assert inspect_response_event(event("response.function_call_arguments.delta", delta="{")).content_deltas == 1
    for kind in ("response.completed", "response.incomplete"):
        done = inspect_response_event(event(kind, response={
            "id": "resp_1", "usage": {"input_tokens": 12, "output_tokens": 3, "total_tokens": 15}}))
        assert done.done and (done.usage.prompt_tokens, done.usage.completion_tokens) == (12, 3)
    # A text delta that happens to contain an event name is just text.
    assert not inspect_response_event(event("response.output_text.delta", delta='"response.completed"')).done


def test_failed_and_error_events_are_errors_classified_by_their_code() -> None:
    failed = inspect_response_event(event("response.failed", response={
        "id": "resp_1", "error": {"code": "server_error", "message": "boom"}}))
    assert failed.error == {"code": "server_error", "message": "boom"} and not failed.done
    assert classify_error(failed.error) == (502, False)
    bad = inspect_response_event(event("error", code="invalid_request_error", message="no"))
    assert bad.error is not None and classify_error(bad.error) == (400, True)
    gateway_own = inspect_response_event(b'data: {"error": {"message": "replica failed", "type": "server_error"}}\n\n')
    assert gateway_own.error == {"message": "replica failed", "type": "server_error"}
    assert inspect_response_event(b": keep-alive\n\n").error is None


def test_a_continuation_goes_to_its_replica_or_gets_a_4xx_or_503_saying_why() -> None:
    """`StoredResponses.pin` on a real SQLite database and real pools: the tenant's own response
    pins its replica; another tenant's is the unknown id's 404; a replica gone from the pool, a
    model that replica does not serve, and a replica that is down each get their own answer."""
    import asyncio
    from types import SimpleNamespace

    from kvik.core.errors import NotFoundError, ServiceUnavailableError
    from kvik.gateway.auth import Principal
    from kvik.gateway.config import BreakerConfig, ResponsesConfig
    from kvik.gateway.model_config import ModelConfig
    from kvik.gateway.keys import ApiKey
    from kvik.gateway.router import ModelPool
    from kvik.gateway.storage.database import open_database
    from kvik.gateway.stored_responses import StoredResponses

    db = open_database("sqlite:///:memory:")
    stored = StoredResponses(SimpleNamespace(db=db, config=SimpleNamespace(responses=ResponsesConfig())))
    pool = ModelPool(ModelConfig(name="m", replicas=[{"url": "http://r1"}, {"url": "http://r2"}]), BreakerConfig())
    other = ModelPool(ModelConfig(name="n", replicas=[{"url": "http://r3"}]), BreakerConfig())

    def principal(key_id: str) -> Principal:
        return Principal(key=ApiKey(id=key_id, name=key_id, key_prefix="k", role="user", models=None, rpm=None,
                                    tpm=None, token_budget=None, tokens_used=0, created_at=0.0, revoked_at=None))

    owner, stranger = principal("a"), principal("b")

    async def scenario() -> None:
        await stored.remember("resp_1", owner, "m", "http://r2", 321)
        await stored.remember("../etc", owner, "m", "http://r2", 5)  # not an id a replica makes: ignored
        await stored.remember(None, owner, "m", "http://r2", 5)
        assert await stored.pin({"input": "x"}, owner, pool) is None
        continuation = await stored.pin({"previous_response_id": "resp_1"}, owner, pool)
        assert (continuation.replica.url, continuation.context_tokens) == ("http://r2", 321)
        for who, body in ((stranger, {"previous_response_id": "resp_1"}),
                          (owner, {"previous_response_id": "resp_2"}),
                          (owner, {"previous_response_id": "../etc"})):
            with pytest.raises(NotFoundError, match="No response found"):
                await stored.pin(body, who, pool)
        with pytest.raises(InvalidRequestError, match="continue it with the model 'm'"):
            await stored.pin({"previous_response_id": "resp_1"}, owner, other)
        pool.replicas[1].healthy = False
        with pytest.raises(ServiceUnavailableError, match="only it can continue"):
            await stored.pin({"previous_response_id": "resp_1"}, owner, pool)
        pool.replicas.pop(1)  # left the pool (a reload, or discovery)
        with pytest.raises(NotFoundError, match="no longer in this gateway's pool"):
            await stored.pin({"previous_response_id": "resp_1"}, owner, pool)

        # Routes expire with the replicas' retention (30 days by default) and are swept.
        await stored.remember("resp_3", owner, "m", "http://r1", 0)
        db.execute("UPDATE response_routes SET created_at = created_at - 31 * 86400 WHERE response_id = 'resp_1'")
        assert await stored.lookup("resp_1", owner) is None and await stored.lookup("resp_3", owner) is not None
        assert await stored.sweep() == 1 and await stored.sweep() == 0
        stored.state.config.responses = ResponsesConfig(retention_days=0)  # kept until deleted
        db.execute("UPDATE response_routes SET created_at = 0")
        assert await stored.lookup("resp_3", owner) is not None and await stored.sweep() == 0

    asyncio.run(scenario())
    db.close()
