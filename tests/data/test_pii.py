"""PII scrubbing replaces e-mail addresses, phone numbers and IP addresses, and nothing else."""

from __future__ import annotations

import pytest

from kvik.data.config import PIIConfig
from kvik.data.pii import scrub


@pytest.mark.parametrize("text, expected, counts", [
    ("Write to jane.doe+news@example.co.uk today.", "Write to <email> today.", (1, 0, 0)),
    ("Call +1 (555) 123-4567 or 555-123-4567.", "Call <phone> or <phone>.", (0, 2, 0)),
    ("In London dial +44 20 7946 0958, in Liverpool 0151 496 0123.",
     "In London dial <phone>, in Liverpool <phone>.", (0, 2, 0)),
    ("Server 192.168.1.20 talks to 8.8.8.8 and 2001:db8::8a2e:370:7334.",
     "Server <ip> talks to <ip> and <ip>.", (0, 0, 3)),
    # Shared with the gateway's redaction (kvik.core.pii): underscores in the local part, an address
    # ending a sentence, full-width digits, a "+" number written in one piece.
    ("Reach john_doe@example.com at 10.0.0.1.", "Reach <email> at <ip>.", (1, 0, 1)),
    ("Call \uff15\uff15\uff15-123-4567 or +441632960123 now.", "Call <phone> or <phone> now.", (0, 2, 0)),
])
def test_pii_is_replaced(text: str, expected: str, counts: tuple[int, int, int]) -> None:
    result = scrub(text, PIIConfig())
    assert result.text == expected
    assert (result.emails, result.phones, result.ips) == counts


@pytest.mark.parametrize("text", [
    "Between 1999 and 2004 the price rose from $1,299.00 to $2,100.50.",
    "Version 1.2.3 was released on 2024-01-15 at 12:30:45.",
    "The ISBN is 978-3-16-148410-0 and pi is 3.14159.",
    "Use std::vector or a::b in C++; 999.1.1.1 is not an address.",
    "Chapter 12, verse 7; page 345 of 1200.",
])
def test_ordinary_numbers_and_text_survive(text: str) -> None:
    assert scrub(text, PIIConfig()).text == text


def test_each_kind_can_be_switched_off_and_replacements_configured() -> None:
    text = "Mail a@b.org from 10.0.0.1 or call 555-123-4567."
    config = PIIConfig(ips=False, phones=False, email_replacement="[EMAIL]")
    assert scrub(text, config).text == "Mail [EMAIL] from 10.0.0.1 or call 555-123-4567."
