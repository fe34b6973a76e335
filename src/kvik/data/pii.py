"""PII scrubbing: e-mail addresses, phone numbers and IP addresses replaced by placeholders.

Patterns err towards precision: a phone number needs 9 to 15 digits in at least three groups (or a
leading "+"), so years, prices and ordinary numbers survive; IPv4 octets must be at most 255.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvik.data.config import PIIConfig

EMAIL = re.compile(r"(?<![\w.+-])[\w.+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,}(?![\w-])")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\w.]|\.\d)")
# Full (eight groups) or "::"-compressed IPv6 addresses; bare "::" alone is not matched.
IPV6 = re.compile(
    r"(?<![\w:])(?:(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}"
    r"|(?:[0-9A-Fa-f]{1,4}:){1,6}(?::[0-9A-Fa-f]{1,4}){1,6}"
    r"|(?:[0-9A-Fa-f]{1,4}:){1,7}:|::(?:[0-9A-Fa-f]{1,4}:){0,6}[0-9A-Fa-f]{1,4})(?![\w:])")
# Optional +country code, then digit groups separated by one space, dot or hyphen, the area code
# possibly in parentheses.
PHONE = re.compile(r"(?<![\w+(])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,5}\)[ .-]?)?"
                   r"\d{2,5}(?:[ .-]\d{2,5}){1,4}(?![\w-]|\.\d)")


@dataclass(frozen=True, slots=True)
class ScrubResult:
    text: str
    emails: int
    phones: int
    ips: int


def _is_phone(match: str) -> bool:
    digits = sum(c.isdigit() for c in match)
    groups = len(re.findall(r"\d+", match))
    return 9 <= digits <= 15 and (match.startswith(("+", "(")) or groups >= 3)


def scrub(text: str, config: PIIConfig) -> ScrubResult:
    emails = phones = ips = 0
    if config.emails:
        text, emails = EMAIL.subn(config.email_replacement, text)
    if config.ips:
        # IPs before phones: "192.168.1.20" would otherwise read as a dotted phone number.
        text, n4 = IPV4.subn(config.ip_replacement, text)
        n6 = 0

        def replace_ipv6(match: re.Match[str]) -> str:
            nonlocal n6
            # Hex words joined by "::" (C++'s "a::b") match the grammar; real addresses have digits.
            if not any(c.isdigit() for c in match.group()):
                return match.group()
            n6 += 1
            return config.ip_replacement
        text = IPV6.sub(replace_ipv6, text)
        ips = n4 + n6
    if config.phones:
        def replace_phone(match: re.Match[str]) -> str:
            nonlocal phones
            if not _is_phone(match.group()):
                return match.group()
            phones += 1
            return config.phone_replacement
        text = PHONE.sub(replace_phone, text)
    return ScrubResult(text, emails, phones, ips)
