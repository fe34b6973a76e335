"""Gopher quality rules (Rae et al. 2021, appendix A.1.1): length, word shape, symbols, bullets,
ellipses, alphabetic words and stop words."""

from __future__ import annotations

from kvik.data.config import GopherQualityConfig
from kvik.data.filters import Rejection, ratio_detail
from kvik.data.words import split_words

_BULLETS = ("•", "●", "○", "▪", "◦", "‣", "⁃", "-", "*", "·")
_ELLIPSES = ("...", "…")


def check(text: str, config: GopherQualityConfig) -> Rejection | None:
    words = split_words(text)
    n_words = len(words)
    if config.min_words is not None and n_words < config.min_words:
        return Rejection("too_few_words", f"{n_words} < {config.min_words}")
    if config.max_words is not None and n_words > config.max_words:
        return Rejection("too_many_words", f"{n_words} > {config.max_words}")
    if n_words == 0:
        return Rejection("too_few_words", "0 words")
    mean_length = sum(len(w) for w in words) / n_words
    if config.min_mean_word_length is not None and mean_length < config.min_mean_word_length:
        return Rejection("short_mean_word_length",
                         ratio_detail(mean_length, "<", config.min_mean_word_length))
    if config.max_mean_word_length is not None and mean_length > config.max_mean_word_length:
        return Rejection("long_mean_word_length",
                         ratio_detail(mean_length, ">", config.max_mean_word_length))
    if config.max_symbol_word_ratio is not None:
        symbols = text.count("#") + text.count("...") + text.count("…")
        ratio = symbols / n_words
        if ratio > config.max_symbol_word_ratio:
            return Rejection("symbol_word_ratio", ratio_detail(ratio, ">", config.max_symbol_word_ratio))
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    if lines and config.max_bullet_lines_ratio is not None:
        ratio = sum(line.startswith(_BULLETS) for line in lines) / len(lines)
        if ratio > config.max_bullet_lines_ratio:
            return Rejection("bullet_lines_ratio", ratio_detail(ratio, ">", config.max_bullet_lines_ratio))
    if lines and config.max_ellipsis_lines_ratio is not None:
        ratio = sum(line.endswith(_ELLIPSES) for line in lines) / len(lines)
        if ratio > config.max_ellipsis_lines_ratio:
            return Rejection("ellipsis_lines_ratio",
                             ratio_detail(ratio, ">", config.max_ellipsis_lines_ratio))
    if config.min_alpha_words_ratio is not None:
        # Whitespace tokens, as in the paper: "80% of words contain at least one alphabetic
        # character" is about tokens like "1,234" or "---", which word splitting would discard.
        tokens = text.split()
        ratio = sum(any(c.isalpha() for c in t) for t in tokens) / max(len(tokens), 1)
        if ratio < config.min_alpha_words_ratio:
            return Rejection("alpha_words_ratio", ratio_detail(ratio, "<", config.min_alpha_words_ratio))
    if config.min_stop_words is not None:
        stop_words = {w.lower() for w in config.stop_words}
        found = sum(w.lower() in stop_words for w in words)
        if found < config.min_stop_words:
            return Rejection("too_few_stop_words", f"{found} < {config.min_stop_words}")
    return None
