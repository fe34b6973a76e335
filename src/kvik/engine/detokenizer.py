"""Incremental detokenization and stop strings.

Text is produced token by token by decoding a short window and keeping what it adds: a token's text
can depend on its neighbours (byte-level BPE splits multi-byte characters across tokens; sentencepiece
drops leading spaces at the start of a decode), so each step decodes from `prefix_offset` and emits
the text beyond what the window decoded to before the new token. Text ending in U+FFFD is an
incomplete character and waits for the next token.
"""

from __future__ import annotations

from kvik.core.tokenizer import Tokenizer

# Prompt tokens kept as left context, so the first output token decodes as it would mid-text.
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still pending (an incomplete character shows as U+FFFD)."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        delta = full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The earliest stop string that ends within the last `num_new_chars` characters of `text`
    (earlier text was checked before); returns (stop string, start index) or None."""
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best
