"""C4 rules (Raffel et al. 2020, section 2.2): line rules remove boilerplate lines, document rules
drop pages that are placeholders, code or too short once the lines are gone."""

from __future__ import annotations

from dataclasses import dataclass

from kvik.data.config import C4Config
from kvik.data.filters import Rejection
from kvik.data.words import TERMINAL_PUNCTUATION, count_sentences, split_words

_POLICY_PHRASES = ("terms of use", "privacy policy", "cookie policy", "uses cookies",
                   "use of cookies", "use cookies")


@dataclass(frozen=True, slots=True)
class C4Outcome:
    text: str  # the document with failing lines removed
    lines_removed: int
    rejection: Rejection | None


def _keep_line(line: str, config: C4Config) -> bool:
    stripped = line.strip()
    if not stripped:
        return True  # blank lines separate paragraphs; they carry no content to judge
    lower = stripped.lower()
    if config.drop_lines_without_terminal_punct and (
            not stripped.endswith(TERMINAL_PUNCTUATION) or stripped.endswith(("...", "…"))):
        return False
    words = split_words(stripped)
    if config.min_words_per_line is not None and len(words) < config.min_words_per_line:
        return False
    if config.max_word_length is not None and any(len(t) > config.max_word_length
                                                  for t in stripped.split()):
        return False
    if config.drop_javascript_lines and "javascript" in lower:
        return False
    if config.drop_policy_lines and any(phrase in lower for phrase in _POLICY_PHRASES):
        return False
    return True


def check(text: str, config: C4Config) -> C4Outcome:
    lower = text.lower()
    if config.drop_lorem_ipsum and "lorem ipsum" in lower:
        return C4Outcome(text, 0, Rejection("lorem_ipsum", "contains 'lorem ipsum'"))
    if config.drop_curly_bracket and "{" in text:
        return C4Outcome(text, 0, Rejection("curly_bracket", "contains '{' (likely code)"))
    lines = text.split("\n")
    kept = [line for line in lines if _keep_line(line, config)]
    removed = sum(1 for line in lines if line.strip()) - sum(1 for line in kept if line.strip())
    new_text = "\n".join(kept).strip("\n")
    if not new_text.strip():
        return C4Outcome(new_text, removed, Rejection("no_lines_left", f"{removed} lines removed"))
    if config.min_sentences is not None:
        sentences = count_sentences(new_text)
        if sentences < config.min_sentences:
            return C4Outcome(new_text, removed,
                             Rejection("too_few_sentences", f"{sentences} < {config.min_sentences}"))
    return C4Outcome(new_text, removed, None)
