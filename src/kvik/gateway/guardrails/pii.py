"""PII redaction: personal data in a request is replaced by a placeholder (`[EMAIL]`, `[CARD]`, ...)
before the request leaves the gateway, so replicas, their logs and their caches never hold it.

The patterns, the normalised matching and the windowed scanning are `kvik.core.pii`'s (shared with
the data pipeline); this module chooses the rules from the gateway's `PiiConfig` and applies them to
requests. What is matched is the conversation as the model will see it, not each text alone: every
text of the request (see `guardrails.text`) joined by newlines, so a card number split across two
messages is still one card number. Where matches overlap, the earlier rule wins: configured
patterns, then email, card, national ids, and phone numbers last.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvik.core.pii import BUILTIN_RULES, WINDOW_CHARS, PiiMatcher, luhn_valid, pattern_rule
from kvik.gateway.config import PiiConfig
from kvik.gateway.guardrails.text import replace_request_texts, request_texts

__all__ = ["JOINER", "WINDOW_CHARS", "PiiRedactor", "Redaction", "luhn_valid"]

JOINER = "\n"  # between the texts of one request, as a chat template puts turns on their own lines
_ENTITY_ORDER = ("email", "card", "national_id", "phone")


@dataclass(slots=True)
class Redaction:
    body: dict[str, Any]
    counts: Counter[str] = field(default_factory=Counter)  # entity name -> replacements made


class PiiRedactor:
    def __init__(self, config: PiiConfig) -> None:
        rules = [pattern_rule(pattern.name, pattern.regex) for pattern in config.patterns]
        entities = set(config.entities)
        rules += [rule for entity in _ENTITY_ORDER if entity in entities for rule in BUILTIN_RULES[entity]]
        self._matcher = PiiMatcher(rules)

    def redact_texts(self, texts: list[str], counts: Counter[str] | None = None) -> list[str]:
        """The texts of one request with PII replaced, matched across text boundaries."""
        result = self._matcher.redact_texts(texts, JOINER)
        if counts is not None:
            counts.update(result.counts)
        return result.texts

    def redact_text(self, text: str, counts: Counter[str] | None = None) -> str:
        return self.redact_texts([text], counts)[0]

    def redact_request(self, body: dict[str, Any]) -> Redaction:
        texts = request_texts(body)
        counts: Counter[str] = Counter()
        if not texts:
            return Redaction(body, counts)
        redacted = self.redact_texts(texts, counts)
        return Redaction(body=replace_request_texts(body, redacted) if counts else body, counts=counts)
