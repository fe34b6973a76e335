"""The shared PII engine: rule order decides overlaps, placeholders are the caller's."""

from __future__ import annotations

from kvik.core.pii import BUILTIN_RULES, PHONE, PiiMatch, PiiMatcher, pattern_rule


def test_earlier_rules_win_overlaps_and_placeholders_are_per_label() -> None:
    matcher = PiiMatcher([*BUILTIN_RULES["ip"], PHONE])
    text = "host 10.20.30.40 or 555-123-4567"
    assert matcher.find(text) == [PiiMatch(5, 16, "IP"), PiiMatch(20, 32, "PHONE")]
    redacted, counts = matcher.redact(text, {"IP": "<ip>"})
    assert redacted == "host <ip> or [PHONE]"
    assert counts == {"IP": 1, "PHONE": 1}


def test_texts_are_matched_as_one_and_each_keeps_its_part() -> None:
    matcher = PiiMatcher([pattern_rule("ticket", r"T-\d{4}-\d{4}"), *BUILTIN_RULES["card"]])
    result = matcher.redact_texts(["see T-1234-", "5678 and 4111 1111 1111 1111"], joiner="")
    assert result.texts == ["see [TICKET]", " and [CARD]"]
    assert result.counts == {"TICKET": 1, "CARD": 1}
