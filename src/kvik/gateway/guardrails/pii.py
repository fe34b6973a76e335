"""PII redaction: personal data in request messages is replaced by a placeholder (`[EMAIL]`,
`[CARD]`, ...) before the request leaves the gateway, so replicas, their logs and their caches never
hold it. Patterns favour precision: card numbers must pass the Luhn check, phone numbers need
separators or a leading `+` and 9 to 15 digits, so ordinary numbers in prompts survive."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvik.gateway.config import PiiConfig
from kvik.gateway.guardrails.text import map_request_texts

EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
# 13 to 19 digits, optionally grouped by single spaces or dashes; validated by `luhn_valid`.
CARD_CANDIDATE = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")
NATIONAL_IDS = [
    # US social security number, without the never-issued area numbers 000, 666 and 9xx.
    re.compile(r"(?<![\d-])(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\d-])"),
    # UK national insurance number.
    re.compile(r"\b(?!BG|GB|NK|KN|TN|NT|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z] ?\d{2} ?\d{2} ?\d{2} ?[A-D]\b"),
]
PHONE_CANDIDATE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]\d{2,4}){1,4}(?![\w-])"
    r"|(?<![\w+])\+\d{9,15}(?!\w)")


def luhn_valid(digits: str) -> bool:
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = int(char)
        if position % 2 == 1:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


@dataclass(slots=True)
class Redaction:
    body: dict[str, Any]
    counts: Counter[str] = field(default_factory=Counter)  # entity name -> replacements made


class PiiRedactor:
    def __init__(self, config: PiiConfig) -> None:
        # Order matters: configured patterns first (most specific), cards and national ids before
        # phones (their digit groups would also look like phone numbers).
        self._rules: list[tuple[str, Callable[[str, Counter[str]], str]]] = []
        for pattern in config.patterns:
            self._rules.append((pattern.name.upper(), _regex_rule(pattern.name.upper(), re.compile(pattern.regex))))
        entities = set(config.entities)
        if "email" in entities:
            self._rules.append(("EMAIL", _regex_rule("EMAIL", EMAIL)))
        if "card" in entities:
            self._rules.append(("CARD", _card_rule))
        if "national_id" in entities:
            for regex in NATIONAL_IDS:
                self._rules.append(("NATIONAL_ID", _regex_rule("NATIONAL_ID", regex)))
        if "phone" in entities:
            self._rules.append(("PHONE", _phone_rule))

    def redact_text(self, text: str, counts: Counter[str] | None = None) -> str:
        counts = Counter() if counts is None else counts
        for _, rule in self._rules:
            text = rule(text, counts)
        return text

    def redact_request(self, body: dict[str, Any]) -> Redaction:
        counts: Counter[str] = Counter()
        redacted = map_request_texts(body, lambda text: self.redact_text(text, counts))
        return Redaction(body=redacted if counts else body, counts=counts)


def _regex_rule(label: str, regex: re.Pattern[str]) -> Callable[[str, Counter[str]], str]:
    def rule(text: str, counts: Counter[str]) -> str:
        text, n = regex.subn(f"[{label}]", text)
        if n:
            counts[label] += n
        return text

    return rule


def _card_rule(text: str, counts: Counter[str]) -> str:
    def replace(match: re.Match[str]) -> str:
        digits = re.sub(r"\D", "", match.group())
        if 13 <= len(digits) <= 19 and luhn_valid(digits):
            counts["CARD"] += 1
            return "[CARD]"
        return match.group()

    return CARD_CANDIDATE.sub(replace, text)


def _phone_rule(text: str, counts: Counter[str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if 9 <= sum(c.isdigit() for c in match.group()) <= 15:
            counts["PHONE"] += 1
            return "[PHONE]"
        return match.group()

    return PHONE_CANDIDATE.sub(replace, text)
