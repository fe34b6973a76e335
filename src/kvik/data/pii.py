"""PII scrubbing of training text: e-mail addresses, phone numbers and IP addresses replaced by the
pipeline's placeholders. The rules are `kvik.core.pii`'s, shared with the gateway's redaction."""

from __future__ import annotations

from dataclasses import dataclass

from kvik.core.pii import EMAIL, IPV4, IPV6, PHONE, PiiMatcher, PiiRule
from kvik.data.config import PIIConfig


@dataclass(frozen=True, slots=True)
class ScrubResult:
    text: str
    emails: int
    phones: int
    ips: int


def scrub(text: str, config: PIIConfig) -> ScrubResult:
    """`text` with the kinds `config` enables replaced. Overlaps go to e-mail, then IP, then phone
    (`192.168.1.20` would otherwise read as a dotted phone number)."""
    rules: list[PiiRule] = []
    if config.emails:
        rules.append(EMAIL)
    if config.ips:
        rules += [IPV4, IPV6]
    if config.phones:
        rules.append(PHONE)
    placeholders = {"EMAIL": config.email_replacement, "IP": config.ip_replacement, "PHONE": config.phone_replacement}
    redacted, counts = PiiMatcher(rules).redact(text, placeholders)
    return ScrubResult(redacted, counts["EMAIL"], counts["PHONE"], counts["IP"])
