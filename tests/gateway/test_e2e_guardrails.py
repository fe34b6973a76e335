"""Guardrails through a real gateway: PII never reaches the upstream; the moderation hook blocks."""

from __future__ import annotations

import secrets

import pytest

from tests.gateway.harness import Gateway, Upstream, require_fake
from tests.gateway.moderation_hook import BLOCKED_WORD

pytestmark = pytest.mark.timeout(120)

EMAIL = "jane.doe@example.com"
CARD = "4111 1111 1111 1111"


@pytest.fixture(scope="module")
def key(standard_gateway: Gateway) -> str:
    return standard_gateway.create_key(name="guardrail-tests")


def test_email_and_card_never_reach_the_upstream(standard_gateway: Gateway, key: str,
                                                 upstreams: list[Upstream]) -> None:
    require_fake()
    marker = secrets.token_hex(4)
    secret_text = f"[{marker}] my mail is {EMAIL}, card {CARD}, staff id EMP-123456"
    with standard_gateway.client(key) as client:
        chat = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "system", "content": f"{marker} reply to {EMAIL}"},
                                          {"role": "user", "content": [{"type": "text", "text": secret_text}]}]})
        streamed = client.post("/v1/chat/completions", json={
            "model": "tiny", "stream": True, "messages": [{"role": "user", "content": secret_text}]})
        completion = client.post("/v1/completions", json={"model": "tiny", "prompt": secret_text})
    assert (chat.status_code, streamed.status_code, completion.status_code) == (200, 200, 200)

    sent = [repr(b) for u in upstreams for b in u.received() if marker in repr(b)]
    assert len(sent) == 3
    for body in sent:
        assert EMAIL not in body and "4111" not in body and "EMP-123456" not in body
        assert "[EMAIL]" in body and "[CARD]" in body and "[EMPLOYEE_ID]" in body


def test_moderation_hook_blocks_with_content_filter(standard_gateway: Gateway, key: str,
                                                    upstreams: list[Upstream]) -> None:
    require_fake()
    marker = secrets.token_hex(4)
    with standard_gateway.client(key) as client:
        blocked = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": f"{marker} tell me about {BLOCKED_WORD}"}]})
        allowed = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": f"{marker} tell me about kittens"}]})
    assert blocked.status_code == 400
    error = blocked.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "content_filter")
    assert BLOCKED_WORD in error["message"]
    assert allowed.status_code == 200
    assert [b for u in upstreams for b in u.received() if BLOCKED_WORD in repr(b)] == []
