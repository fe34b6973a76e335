"""One PII pattern engine for every part of kvik that removes personal data: the gateway's request
redaction and the data pipeline's scrubbing of training text build a `PiiMatcher` from the rules here.

Rules favour precision: card numbers must pass the Luhn check; a phone number needs 9 to 15 digits in
at least three groups, or a leading `+` or parenthesised area code; IPv4 octets are at most 255 and an
IPv6 address must hold a digit (C++'s `a::b` matches the grammar). Years, prices, versions, dates and
ISBNs survive.

Matching runs on a compatibility-normalised copy of the text (NFKC, restricted to characters that
normalise to one ASCII character, so offsets do not move): full-width digits and `＠`, non-breaking
spaces and the like match like their ASCII forms, and the placeholder replaces the original characters.

Every rule is matched against the same text; where matches overlap, the earlier rule in the matcher's
list wins. The digit-based rules only look at runs of digits and separators (found in one scan), with a
few characters of context. Large texts are scanned in windows: a regular expression holds the GIL for a
whole call, and the gateway redacts large bodies in a worker thread that must let the event loop serve
other tenants meanwhile (the interpreter hands the GIL over between bytecodes, so each call is kept to
one window).
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache

WINDOW_CHARS = 64 * 1024  # one regex call scans at most this much (plus the overlap)
# Matches may run this far past a window's end; longer matches of configured patterns can be cut.
OVERLAP_CHARS = 1024
# Runs of digits and the separators the digit rules allow, at least 6 characters (a UK national
# insurance number without spaces has 6 digits); every digit-rule match overlaps one.
_DIGIT_RUN = re.compile(r"\d[\d\s.()+-]{5,}")
RUN_CONTEXT_CHARS = 4  # around a run: a `+` or `(` before a phone number, the letters of an NI number
_DIGIT = re.compile(r"\d")

Span = tuple[int, int]


@dataclass(slots=True, frozen=True)
class PiiRule:
    """One kind of personal data: matches of `regex` that pass `accept` are replaced."""

    label: str  # "EMAIL", "CARD", ...: the key of the counts and the default placeholder `[LABEL]`
    regex: re.Pattern[str]
    accept: Callable[[str], bool] | None = None  # a check on the matched text (Luhn, digit count)
    digits: bool = False  # matches always overlap a digit run: scan only around those
    min_run: int = 6  # shortest digit run that can hold a match
    worth_scanning: Callable[[str, int, int], bool] | None = None  # a cheap test of a window


def luhn_valid(digits: str) -> bool:
    """The Luhn checksum of a string of decimal digits, as every payment card number carries."""
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = int(char)
        if position % 2 == 1:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


def _is_card(candidate: str) -> bool:
    digits = "".join(char for char in candidate if char.isdecimal())
    return 13 <= len(digits) <= 19 and luhn_valid(digits)


def _is_phone(candidate: str) -> bool:
    digits = sum(char.isdecimal() for char in candidate)
    groups = len(re.findall(r"\d+", candidate))
    return 9 <= digits <= 15 and (candidate.startswith(("+", "(")) or groups >= 3)


def _has_ipv6_digit(candidate: str) -> bool:
    return any(char.isdigit() for char in candidate)


def _has_at_sign(text: str, start: int, end: int) -> bool:
    return text.find("@", start, end) >= 0


def _has_colon(text: str, start: int, end: int) -> bool:
    return text.find(":", start, end) >= 0


def _has_digit(text: str, start: int, end: int) -> bool:
    return _DIGIT.search(text, start, end) is not None


# The local part takes any word character (`jane_doe`, `josé`); no lookahead after the top-level
# domain, so `a@b.com_x` still loses its address.
EMAIL = PiiRule("EMAIL", re.compile(
    r"(?<![\w.%+-])[\w.%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"), worth_scanning=_has_at_sign)
# 13 to 19 digits, optionally grouped by single spaces, newlines, dots or dashes (`4111.1111.…`).
# Newlines matter: the texts of a conversation are joined by them.
CARD = PiiRule("CARD", re.compile(r"(?<![\d-])\d(?:[\s.-]?\d){12,18}(?![\d-])"), _is_card, digits=True, min_run=13)
NATIONAL_IDS = (
    # US social security number, without the never-issued area numbers 000, 666 and 9xx.
    PiiRule("NATIONAL_ID", re.compile(r"(?<![\d-])(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\d-])"),
            digits=True, min_run=11),
    # UK national insurance number.
    PiiRule("NATIONAL_ID", re.compile(
        r"\b(?!BG|GB|NK|KN|TN|NT|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z] ?\d{2} ?\d{2} ?\d{2} ?[A-D]\b"),
        digits=True, min_run=6),
)
# An optional +country code, then digit groups separated by one space, dot or hyphen, the area code
# possibly in parentheses; or `+` and 9 to 15 digits in one piece. Not followed by a decimal part
# (`123 456 789.5` is a number).
PHONE = PiiRule("PHONE", re.compile(
    r"(?<![\w+(])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,5}\)[ .-]?)?\d{2,5}(?:[ .-]\d{2,5}){1,4}(?![\w-]|\.\d)"
    r"|(?<![\w+])\+\d{9,15}(?!\w)"), _is_phone, digits=True, min_run=9)
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# A sentence may end after the address (`at 10.0.0.1.`); a fifth number may not (`1.2.3.4.5`).
IPV4 = PiiRule("IP", re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\w|\.\d)"),
               digits=True, min_run=7)
# Full (eight groups) or "::"-compressed IPv6 addresses; bare "::" alone is not matched.
IPV6 = PiiRule("IP", re.compile(
    r"(?<![\w:])(?:(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}"
    r"|(?:[0-9A-Fa-f]{1,4}:){1,6}(?::[0-9A-Fa-f]{1,4}){1,6}"
    r"|(?:[0-9A-Fa-f]{1,4}:){1,7}:|::(?:[0-9A-Fa-f]{1,4}:){0,6}[0-9A-Fa-f]{1,4})(?![\w:])"),
    _has_ipv6_digit, worth_scanning=_has_colon)

# The built-in rules by the entity name configurations use.
BUILTIN_RULES: dict[str, tuple[PiiRule, ...]] = {
    "email": (EMAIL,), "card": (CARD,), "national_id": NATIONAL_IDS, "phone": (PHONE,), "ip": (IPV4, IPV6)}


def pattern_rule(name: str, regex: str) -> PiiRule:
    """An operator's own pattern, replaced by `[NAME]`."""
    return PiiRule(name.upper(), re.compile(regex))


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


@dataclass(slots=True, frozen=True)
class PiiMatch:
    start: int
    end: int  # exclusive, offsets into the text as given (normalising keeps them)
    label: str


@dataclass(slots=True)
class RedactedTexts:
    texts: list[str]
    counts: Counter[str] = field(default_factory=Counter)  # label -> replacements made


class PiiMatcher:
    """Finds and replaces the matches of `rules` (earlier rules win overlaps)."""

    def __init__(self, rules: Sequence[PiiRule]) -> None:
        self._rules = list(rules)
        self._any_digits = any(rule.digits for rule in self._rules)
        if self._rules:
            _ascii_folding()  # build the table at start-up, not in the first request

    def find(self, text: str) -> list[PiiMatch]:
        """The accepted, disjoint matches in `text`, in order of position."""
        text = normalise(text)
        runs = _digit_runs(text) if self._any_digits else []
        taken = _Spans()
        found: list[PiiMatch] = []
        for rule in self._rules:
            matches = _run_matches(rule, text, runs) if rule.digits else _scan(rule.regex, text, rule.worth_scanning)
            for match in matches:
                if (rule.accept is None or rule.accept(match.group())) and taken.add(match.start(), match.end()):
                    found.append(PiiMatch(match.start(), match.end(), rule.label))
        found.sort(key=lambda match: match.start)
        return found

    def redact_texts(self, texts: Sequence[str], joiner: str = "\n",
                     placeholders: Mapping[str, str] | None = None) -> RedactedTexts:
        """`texts` matched as one text (joined by `joiner`, so a match may span two of them), each
        match replaced by `placeholders[label]` (default `[LABEL]`) in the text where it starts; the
        later texts it covers lose their part."""
        placeholders = placeholders or {}
        matches = self.find(joiner.join(texts))
        counts = Counter(match.label for match in matches)
        spans = [(m.start, m.end, placeholders.get(m.label, f"[{m.label}]")) for m in matches]
        return RedactedTexts(_replace_spans(list(texts), len(joiner), spans) if spans else list(texts), counts)

    def redact(self, text: str, placeholders: Mapping[str, str] | None = None) -> tuple[str, Counter[str]]:
        """`text` with every match replaced, and the number of replacements per label."""
        result = self.redact_texts([text], placeholders=placeholders)
        return result.texts[0], result.counts


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


def _replace_spans(segments: list[str], joiner_chars: int, spans: list[tuple[int, int, str]]) -> list[str]:
    """Apply sorted, disjoint spans of the joined text to its segments: a span's first segment gets
    the placeholder in place of its part, the later segments it covers lose theirs (the joiners go
    with the span)."""
    starts = []
    offset = 0
    for segment in segments:
        starts.append(offset)
        offset += len(segment) + joiner_chars
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


def _run_matches(rule: PiiRule, text: str, runs: list[Span]) -> Iterator[re.Match[str]]:
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
