"""`<think>...</think>` reasoning (Qwen3, QwQ, DeepSeek-R1 and its distillations).

The thinking is what comes between the tags; the content is what follows `</think>` (leading blank
lines dropped). If the prompt opened the thinking, the output starts inside it; otherwise only an
output that begins with `<think>` has a thinking part, and one without tags is all content.
"""

from __future__ import annotations

from typing import Callable

from kvik.core.errors import ConfigError
from kvik.server.reasoning.base import WHITESPACE, ReasoningParser, ReasoningSplit, ThinkingState

START, END = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ThinkTagParser(ReasoningParser):
    name = "think"

    def __init__(self, token_id: Callable[[str], int | None]) -> None:
        start, end = token_id(START), token_id(END)
        if start is None or end is None:
            raise ConfigError(f"reasoning parser {self.name!r}: the tokenizer has no single {START} and "
                              f"{END} tokens; this model does not think in tags")
        self.start_token_id, self._end_token_id = start, end

    @property
    def end_token_id(self) -> int:
        return self._end_token_id

    def thinking_state(self, prompt_token_ids: list[int], decode: Callable[[list[int]], str]) -> ThinkingState:
        last_start = _last_index(prompt_token_ids, self.start_token_id)
        last_end = _last_index(prompt_token_ids, self._end_token_id)
        last = max(last_start, last_end)
        # Only a tag at the very end of the prompt (blank text after it) is about this turn.
        if last < 0 or decode(prompt_token_ids[last + 1:]).strip(WHITESPACE):
            return ThinkingState.MODEL
        return ThinkingState.CLOSED if last == last_end else ThinkingState.OPEN

    def split(self, text: str, state: ThinkingState, final: bool) -> ReasoningSplit:
        if state is ThinkingState.CLOSED:
            return ReasoningSplit(None, text)
        body = text
        if state is ThinkingState.MODEL:
            stripped = text.lstrip(WHITESPACE)
            if not stripped.startswith(START):
                if not final and START.startswith(stripped):
                    return ReasoningSplit(None, "")  # may still be the opening tag
                return ReasoningSplit(None, text)
            body = stripped[len(START):]
        end = body.find(END)
        if end == -1:
            return ReasoningSplit(body if final else body[:len(body) - _held(body, END)], "")
        content = body[end + len(END):].lstrip(WHITESPACE)
        return ReasoningSplit(body[:end], content)


def _last_index(ids: list[int], token: int) -> int:
    for index in range(len(ids) - 1, -1, -1):
        if ids[index] == token:
            return index
    return -1
