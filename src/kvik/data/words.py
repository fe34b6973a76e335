"""Language-agnostic word splitting, with no model to download.

A word is a run of letters, combining marks, digits and joiners (so "don't", "état", "हिन्दी" and
"co-op" are one word each). Scripts written without spaces (Han, kana, Thai, Lao, Khmer, Myanmar,
Tibetan) have no cheap word boundaries, so each of their characters (with its combining marks) counts as one word: this keeps
word counts and n-gram shingles meaningful for them without a segmentation model. The heuristics'
English-tuned thresholds (e.g. mean word length) still need tuning per language in the config.
"""

from __future__ import annotations

import regex

_UNSPACED = r"\p{Han}\p{Hiragana}\p{Katakana}\p{Thai}\p{Lao}\p{Khmer}\p{Myanmar}\p{Tibetan}"
_WORD_CHAR = rf"[\p{{L}}\p{{M}}\p{{N}}--[{_UNSPACED}]]"
# Apostrophes, hyphens and the like join two word characters: "don't", "co-op", "l'eau".
_JOINER = r"['’\-\u00b7]"
WORD = regex.compile(rf"[[{_UNSPACED}]--\p{{M}}]\p{{M}}*|{_WORD_CHAR}+(?:{_JOINER}{_WORD_CHAR}+)*", regex.V1)

# Sentence ends across scripts, for counting sentences (C4's minimum).
SENTENCE_END = regex.compile(r"[.!?。！？؟।॥]+(?=\s|$|[\"'”’)\]])", regex.V1)

# Line-final punctuation that marks a finished sentence (C4 and FineWeb line rules).
TERMINAL_PUNCTUATION = (".", "!", "?", '"', "'", "”", "’", "。", "！", "？", "؟", "।", "॥", "…")


def split_words(text: str) -> list[str]:
    """The words of `text` in order, as they appear (no case folding)."""
    return WORD.findall(text)


def count_sentences(text: str) -> int:
    return len(SENTENCE_END.findall(text))
