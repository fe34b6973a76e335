"""PII redaction: personal data in a request is replaced by a placeholder (`[EMAIL]`, `[CARD]`, ...)
before the request leaves the gateway, so replicas, their logs and their caches never hold it.

Patterns favour precision: card numbers must pass the Luhn check, phone numbers need separators or a
leading `+` and 9 to 15 digits, so ordinary numbers in prompts survive.

What is matched is the conversation as the model will see it, not each text alone: every text of
the request (see `guardrails.text`) joined by newlines, so a card number split across two messages
is still one card number. Matching runs on a compatibility-normalised copy (NFKC, restricted to
characters that normalise to one ASCII character, so offsets do not move): full-width digits and
`＠`, non-breaking spaces and the like match like their ASCII forms, and the placeholder replaces
the original characters.

Every rule is matched against the same joined text; where matches overlap, the earlier rule wins
(configured patterns, then email, card, national ids, and phone numbers last). The digit-based rules
only look at runs of digits and separators (found in one scan), with a few characters of context.
Large texts are scanned in windows: a regular expression holds the GIL for a whole call, and the
gateway redacts large bodies in a worker thread that must let the event loop serve other tenants
meanwhile (the interpreter hands the GIL over between bytecodes, so each call is kept to one window).
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from kvik.gateway.config import PiiConfig
from kvik.gateway.guardrails.text import replace_request_texts, request_texts

EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
# 13 to 19 digits, optionally grouped by single spaces, newlines, dots or dashes (`4111.1111.…`);
# validated by `luhn_valid`. Newlines matter: the texts of a conversation are joined by them.
CARD_CANDIDATE = re.compile(r"(?<![\d-])\d(?:[\s.-]?\d){12,18}(?![\d-])")
NATIONAL_IDS = [
    # US social security number, without the never-issued area numbers 000, 666 and 9xx.
    re.compile(r"(?<![\d-])(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\d-])"),
    # UK national insurance number.
    re.compile(r"\b(?!BG|GB|NK|KN|TN|NT|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z] ?\d{2} ?\d{2} ?\d{2} ?[A-D]\b"),
]
PHONE_CANDIDATE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]\d{2,4}){1,4}(?![\w-])"
    r"|(?<![\w+])\+\d{9,15}(?!\w)")
_DIGIT = re.compile(r"\d")

JOINER = "\n"  # between the texts of one request, as a chat template puts turns on their own lines
WINDOW_CHARS = 64 * 1024  # one regex call scans at most this much (plus the overlap)
# Matches may run this far past a window's end; longer matches of configured patterns can be cut.
OVERLAP_CHARS = 1024
# Runs of digits and the separators the digit rules allow, at least 6 characters (a UK national
# insurance number without spaces has 6 digits); every digit-rule match overlaps one.
_DIGIT_RUN = re.compile(r"\d[\d\s.()+-]{5,}")
RUN_CONTEXT_CHARS = 4  # around a run: a `+` or `(` before a phone number, the letters of an NI number

Span = tuple[int, int]


@dataclass(slots=True, frozen=True)
class _Rule:
    label: str
    regex: re.Pattern[str]
    accept: Callable[[str], bool] | None = None  # a check on the matched text (Luhn, digit count)
    digits: bool = False  # matches always overlap a digit run: scan only around those
    min_run: int = 6  # shortest digit run that can hold a match
    worth_scanning: Callable[[str, int, int], bool] | None = None  # a cheap test of a window


def luhn_valid(digits: str) -> bool:
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = int(char)
        if position % 2 == 1:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


@cache
def _ascii_folding() -> dict[int, str]:
    """Characters whose NFKC form is a single ASCII character (full-width forms, mathematical
    digits, `＠`, no-break spaces, ...), mapped to it. Built once, in about 50 ms."""
    table: dict[int, str] = {}
    code_points = list(range(0x80, 0x10000)) + list(range(0x1D400, 0x1D800))  # BMP, math alphanumerics
    for code_point in code_points:
        folded = unicodedata.normalize("NFKC", chr(code_point))
        if len(folded) == 1 and ord(folded) < 0x80:
            table[code_point] = folded
    return table


def normalise(text: str) -> str:
    """`text` with compatibility characters folded to ASCII; the same length, so offsets hold."""
    return text if text.isascii() else text.translate(_ascii_folding())


@dataclass(slots=True)
class Redaction:
    body: dict[str, Any]
    counts: Counter[str] = field(default_factory=Counter)  # entity name -> replacements made


class PiiRedactor:
    def __init__(self, config: PiiConfig) -> None:
        self._rules = [_Rule(pattern.name.upper(), re.compile(pattern.regex)) for pattern in config.patterns]
        entities = set(config.entities)
        if "email" in entities:
            self._rules.append(_Rule("EMAIL", EMAIL, worth_scanning=_has_at_sign))
        if "card" in entities:
            self._rules.append(_Rule("CARD", CARD_CANDIDATE, _is_card, digits=True, min_run=13))
        if "national_id" in entities:
            self._rules += [_Rule("NATIONAL_ID", regex, digits=True, min_run=min_run)
                            for regex, min_run in zip(NATIONAL_IDS, (11, 6), strict=True)]
        if "phone" in entities:
            self._rules.append(_Rule("PHONE", PHONE_CANDIDATE, _is_phone, digits=True, min_run=9))
        if self._rules:
            _ascii_folding()  # build the table at start-up, not in the first request

    def redact_texts(self, texts: list[str], counts: Counter[str] | None = None) -> list[str]:
        """The texts of one request with PII replaced, matched across text boundaries."""
        counts = Counter() if counts is None else counts
        text = normalise(JOINER.join(texts))
        runs = _digit_runs(text) if any(rule.digits for rule in self._rules) else []
        taken = _Spans()
        found: list[tuple[int, int, str]] = []
        for rule in self._rules:
            matches = _run_matches(rule, text, runs) if rule.digits else _scan(rule.regex, text, rule.worth_scanning)
            for match in matches:
                if (rule.accept is None or rule.accept(match.group())) and taken.add(match.start(), match.end()):
                    found.append((match.start(), match.end(), f"[{rule.label}]"))
                    counts[rule.label] += 1
        return _replace_spans(list(texts), sorted(found)) if found else list(texts)

    def redact_text(self, text: str, counts: Counter[str] | None = None) -> str:
        return self.redact_texts([text], counts)[0]

    def redact_request(self, body: dict[str, Any]) -> Redaction:
        texts = request_texts(body)
        counts: Counter[str] = Counter()
        if not texts:
            return Redaction(body, counts)
        redacted = self.redact_texts(texts, counts)
        return Redaction(body=replace_request_texts(body, redacted) if counts else body, counts=counts)


class _Spans:
    """Non-overlapping spans taken so far."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, start: int, end: int) -> bool:
        """Take [start, end) unless it overlaps a span already taken."""
        index = bisect.bisect_left(self._starts, start)
        if index > 0 and self._ends[index - 1] > start:
            return False
        if index < len(self._starts) and self._starts[index] < end:
            return False
        self._starts.insert(index, start)
        self._ends.insert(index, end)
        return True


def _replace_spans(segments: list[str], spans: list[tuple[int, int, str]]) -> list[str]:
    """Apply sorted, disjoint spans of the joined text to its segments: a span's first segment gets
    the placeholder in place of its part, the later segments it covers lose theirs (the joiners go
    with the span)."""
    starts = []
    offset = 0
    for segment in segments:
        starts.append(offset)
        offset += len(segment) + len(JOINER)
    cuts: list[list[tuple[int, int, str]]] = [[] for _ in segments]  # per segment: (start, end, new text)
    for start, end, placeholder in spans:
        first = bisect.bisect_right(starts, start) - 1
        index = first
        while index < len(segments) and starts[index] < end:
            size = len(segments[index])
            local_start = min(size, max(0, start - starts[index]))  # a span may start on a joiner
            local_end = max(local_start, min(size, end - starts[index]))
            if local_start < local_end or index == first:
                cuts[index].append((local_start, local_end, placeholder if index == first else ""))
            index += 1
    out = []
    for segment, segment_cuts in zip(segments, cuts, strict=True):
        if not segment_cuts:
            out.append(segment)
            continue
        pieces, position = [], 0
        for start, end, text in segment_cuts:
            pieces += [segment[position:start], text]
            position = end
        pieces.append(segment[position:])
        out.append("".join(pieces))
    return out


def _scan(regex: re.Pattern[str], text: str, worth_scanning: Callable[[str, int, int], bool] | None
          ) -> Iterator[re.Match[str]]:
    """`regex.finditer(text)`, one window at a time (see the module docstring)."""
    length = len(text)
    if length <= WINDOW_CHARS:
        if worth_scanning is None or worth_scanning(text, 0, length):
            yield from regex.finditer(text)
        return
    position = 0
    while position < length:
        window_end = min(length, position + WINDOW_CHARS)
        limit = min(length, window_end + OVERLAP_CHARS)
        resume = window_end
        if worth_scanning is None or worth_scanning(text, position, limit):
            # Lookbehinds see before `position`; only matches that start in this window count, the
            # next window starts after the last of them.
            for match in regex.finditer(text, position, limit):
                if match.start() >= window_end:
                    break
                yield match
                resume = max(resume, match.end())
        position = resume


def _digit_runs(text: str) -> list[Span]:
    return [match.span() for match in _scan(_DIGIT_RUN, text, _has_digit)]


def _run_matches(rule: _Rule, text: str, runs: list[Span]) -> Iterator[re.Match[str]]:
    """The rule's matches that overlap a digit run, each run searched with a little context (a
    lookbehind sees before the start of the search; a lookahead stops at its end)."""
    length, resume, min_run, finditer = len(text), 0, rule.min_run, rule.regex.finditer
    for start, end in runs:
        if end - start < min_run:
            continue
        for match in finditer(text, max(resume, start - RUN_CONTEXT_CHARS), min(length, end + RUN_CONTEXT_CHARS)):
            if match.end() > start and match.start() < end:
                yield match
                resume = match.end()


def _has_at_sign(text: str, start: int, end: int) -> bool:
    return text.find("@", start, end) >= 0


def _has_digit(text: str, start: int, end: int) -> bool:
    return _DIGIT.search(text, start, end) is not None


def _is_card(candidate: str) -> bool:
    digits = "".join(char for char in candidate if char.isdecimal())
    return 13 <= len(digits) <= 19 and luhn_valid(digits)


def _is_phone(candidate: str) -> bool:
    return 9 <= sum(char.isdecimal() for char in candidate) <= 15
