"""FineWeb's line-level quality rules (Penedo et al. 2024, section 3.3; datatrove's
FineWebQualityFilter): terminal punctuation, short lines, duplicated line characters and
list-like pages."""

from __future__ import annotations

from kvik.data.config import FineWebConfig
from kvik.data.filters import Rejection, ratio_detail
from kvik.data.filters.gopher_repetition import duplicated
from kvik.data.words import TERMINAL_PUNCTUATION, split_words


def check(text: str, config: FineWebConfig) -> Rejection | None:
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    if not lines:
        return Rejection("empty", "no non-blank lines")
    if config.min_line_punct_ratio is not None:
        ratio = sum(line.endswith(TERMINAL_PUNCTUATION) for line in lines) / len(lines)
        if ratio < config.min_line_punct_ratio:
            return Rejection("line_punct_ratio", ratio_detail(ratio, "<", config.min_line_punct_ratio))
    if config.max_short_line_ratio is not None:
        ratio = sum(len(line) <= config.short_line_length for line in lines) / len(lines)
        if ratio > config.max_short_line_ratio:
            return Rejection("short_line_ratio", ratio_detail(ratio, ">", config.max_short_line_ratio))
    if config.max_duplicate_line_chars_ratio is not None:
        _, dup_chars = duplicated(lines)
        ratio = dup_chars / max(len(text.replace("\n", "")), 1)
        if ratio > config.max_duplicate_line_chars_ratio:
            return Rejection("duplicate_line_chars",
                             ratio_detail(ratio, ">", config.max_duplicate_line_chars_ratio))
    if config.max_newline_word_ratio is not None:
        ratio = text.count("\n") / max(len(split_words(text)), 1)
        if ratio > config.max_newline_word_ratio:
            return Rejection("newline_word_ratio", ratio_detail(ratio, ">", config.max_newline_word_ratio))
    return None
