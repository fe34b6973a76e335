"""Gopher repetition rules (Rae et al. 2021, appendix A.1.1, table A1): duplicated lines and
paragraphs, the most frequent short n-grams, and characters covered by repeated long n-grams."""

from __future__ import annotations

import re
from collections import Counter

from kvik.data.config import GopherRepetitionConfig
from kvik.data.filters import Rejection, ratio_detail
from kvik.data.words import split_words

_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def duplicated(elements: list[str]) -> tuple[int, int]:
    """(number, characters) of elements that repeat an earlier one."""
    seen: set[str] = set()
    count = chars = 0
    for element in elements:
        if element in seen:
            count += 1
            chars += len(element)
        else:
            seen.add(element)
    return count, chars


def top_ngram_chars(words: list[str], n: int) -> int:
    """Characters covered by all occurrences of the most frequent n-gram (0 if none repeats)."""
    counts = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    if not counts:
        return 0
    gram, count = counts.most_common(1)[0]
    return 0 if count < 2 else count * sum(len(w) for w in gram)


def duplicate_ngram_chars(words: list[str], n: int) -> int:
    """Characters of the words covered by an n-gram that occurs more than once (each word once)."""
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    counts = Counter(grams)
    covered = [False] * len(words)
    for i, gram in enumerate(grams):
        if counts[gram] > 1:
            covered[i:i + n] = [True] * n
    return sum(len(w) for w, hit in zip(words, covered) if hit)


def check(text: str, config: GopherRepetitionConfig) -> Rejection | None:
    total_chars = max(len(text), 1)
    paragraphs = [p.strip() for p in _PARAGRAPH_BREAK.split(text) if p.strip()]
    dup_paragraphs, dup_paragraph_chars = duplicated(paragraphs)
    if paragraphs and config.max_duplicate_paragraphs_ratio is not None:
        ratio = dup_paragraphs / len(paragraphs)
        if ratio > config.max_duplicate_paragraphs_ratio:
            return Rejection("duplicate_paragraphs",
                             ratio_detail(ratio, ">", config.max_duplicate_paragraphs_ratio))
    if config.max_duplicate_paragraph_chars_ratio is not None:
        ratio = dup_paragraph_chars / total_chars
        if ratio > config.max_duplicate_paragraph_chars_ratio:
            return Rejection("duplicate_paragraph_chars",
                             ratio_detail(ratio, ">", config.max_duplicate_paragraph_chars_ratio))
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    dup_lines, dup_line_chars = duplicated(lines)
    if lines and config.max_duplicate_lines_ratio is not None:
        ratio = dup_lines / len(lines)
        if ratio > config.max_duplicate_lines_ratio:
            return Rejection("duplicate_lines", ratio_detail(ratio, ">", config.max_duplicate_lines_ratio))
    if config.max_duplicate_line_chars_ratio is not None:
        ratio = dup_line_chars / total_chars
        if ratio > config.max_duplicate_line_chars_ratio:
            return Rejection("duplicate_line_chars",
                             ratio_detail(ratio, ">", config.max_duplicate_line_chars_ratio))
    words = [w.lower() for w in split_words(text)]
    word_chars = max(sum(len(w) for w in words), 1)
    for n, threshold in sorted(config.max_top_ngram_chars_ratio.items()):
        ratio = top_ngram_chars(words, n) / word_chars
        if ratio > threshold:
            return Rejection(f"top_{n}gram_chars", ratio_detail(ratio, ">", threshold))
    for n, threshold in sorted(config.max_duplicate_ngram_chars_ratio.items()):
        ratio = duplicate_ngram_chars(words, n) / word_chars
        if ratio > threshold:
            return Rejection(f"duplicate_{n}gram_chars", ratio_detail(ratio, ">", threshold))
    return None
