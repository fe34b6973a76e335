"""PII redaction patterns."""

from __future__ import annotations

import pytest

from kvik.gateway.config import PiiConfig
from kvik.gateway.guardrails.pii import PiiRedactor, luhn_valid

REDACTOR = PiiRedactor(PiiConfig(enabled=True, patterns=[{"name": "employee_id", "regex": r"EMP-\d{6}"}]))


@pytest.mark.parametrize(("text", "expected"), [
    ("write to alice.smith+x@mail.example.co.uk now", "write to [EMAIL] now"),
    ("card 4111 1111 1111 1111 ok", "card [CARD] ok"),
    ("card 4111-1111-1111-1111", "card [CARD]"),
    ("amex 378282246310005.", "amex [CARD]."),
    ("call +44 20 7946 0958 or (555) 123-4567", "call [PHONE] or [PHONE]"),
    ("ssn 123-45-6789", "ssn [NATIONAL_ID]"),
    ("NI number AB 12 34 56 C", "NI number [NATIONAL_ID]"),
    ("badge EMP-123456", "badge [EMPLOYEE_ID]"),
])
def test_redacts(text: str, expected: str) -> None:
    assert REDACTOR.redact_text(text) == expected


@pytest.mark.parametrize("text", [
    "order 4111 1111 1111 1112 failed Luhn",
    "the year 2024, 3.14159, 42 apples",
    "meeting on 2024-01-15",
    "version 1.2.3 of the app, room 12 3",
])
def test_leaves_ordinary_text_alone(text: str) -> None:
    assert REDACTOR.redact_text(text) == text


def test_luhn() -> None:
    assert luhn_valid("4111111111111111") and not luhn_valid("4111111111111112")


def test_request_bodies_are_copied_not_mutated() -> None:
    body = {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "me@x.org"}, {"type": "image_url", "image_url": {}}]},
        {"role": "user", "content": "4111111111111111"}]}
    result = REDACTOR.redact_request(body)
    assert result.body["messages"][0]["content"][0]["text"] == "[EMAIL]"
    assert result.body["messages"][1]["content"] == "[CARD]"
    assert result.counts == {"EMAIL": 1, "CARD": 1}
    assert body["messages"][1]["content"] == "4111111111111111"
    prompt = REDACTOR.redact_request({"model": "m", "prompt": ["a@b.io", "plain"]})
    assert prompt.body["prompt"] == ["[EMAIL]", "plain"]


@pytest.mark.parametrize(("text", "expected"), [
    ("card 4111.1111.1111.1111 ok", "card [CARD] ok"),  # dots between the groups
    ("card ４１１１ １１１１ １１１１ １１１１ ok", "card [CARD] ok"),  # full-width digits
    ("card 4111\u00a01111\u00a01111\u00a01111", "card [CARD]"),  # no-break spaces
    ("mail jane.doe＠example.com now", "mail [EMAIL] now"),  # full-width at sign
    ("ｊａｎｅ＠ｅｘａｍｐｌｅ．ｃｏｍ", "[EMAIL]"),  # full-width everything
])
def test_common_obfuscations_are_redacted(text: str, expected: str) -> None:
    assert REDACTOR.redact_text(text) == expected


def test_a_card_split_across_two_messages_is_redacted_in_both() -> None:
    """Issue 10, finding 12: redaction sees the conversation, not each message alone."""
    body = {"model": "m", "messages": [{"role": "user", "content": "my card is 4111 1111"},
                                       {"role": "user", "content": [{"type": "text", "text": "1111 1111 thanks"}]}]}
    result = REDACTOR.redact_request(body)
    first, second = result.body["messages"]
    assert (first["content"], second["content"][0]["text"]) == ("my card is [CARD]", " thanks")
    assert result.counts == {"CARD": 1}


def test_chat_template_kwargs_strings_are_redacted() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": False, "documents": [
                {"title": "contact", "text": "write to jane.doe@example.com"}], "note": "ssn 123-45-6789"}}
    result = REDACTOR.redact_request(body)
    kwargs = result.body["chat_template_kwargs"]
    assert kwargs == {"enable_thinking": False, "documents": [{"title": "contact", "text": "write to [EMAIL]"}],
                      "note": "ssn [NATIONAL_ID]"}


def test_large_texts_are_scanned_across_window_edges() -> None:
    from kvik.gateway.guardrails.pii import WINDOW_CHARS

    filler = "lorem ipsum " * (WINDOW_CHARS // 12)
    for offset in (-10, -3, 0, 5):  # the e-mail and the card straddle or follow a window edge
        head = filler[: WINDOW_CHARS + offset]
        text = head + "jane.doe@example.com and 4111 1111 1111 1111 end " + filler
        redacted = REDACTOR.redact_text(text)
        assert "jane.doe" not in redacted and "4111" not in redacted
        assert redacted == head + "[EMAIL] and [CARD] end " + filler
