"""Reasoning parsers, chosen by `--reasoning-parser` or from the model.

"auto" enables the `<think>` parser when the tokenizer has `<think>` and `</think>` as single tokens
and the chat template writes `<think>` (Qwen3, QwQ, DeepSeek-R1); "none" disables parsing (the
thinking stays in `content`). "qwen3" and "deepseek_r1" are names for the same parser: the
difference between those families (who opens the tag) is read from the rendered prompt.
"""

from __future__ import annotations

from typing import Callable

from kvik.core.errors import ConfigError
from kvik.server.reasoning.base import ReasoningParser, ReasoningSplit, ReasoningStream, ThinkingState
from kvik.server.reasoning.think_tags import START, ThinkTagParser

PARSERS: dict[str, type[ReasoningParser]] = {"think": ThinkTagParser, "qwen3": ThinkTagParser,
                                             "deepseek_r1": ThinkTagParser}
CHOICES = ("auto", "none", *PARSERS)

__all__ = ["CHOICES", "ReasoningParser", "ReasoningSplit", "ReasoningStream", "ThinkingState",
           "resolve_reasoning_parser"]


def resolve_reasoning_parser(name: str, template: str, token_id: Callable[[str], int | None]
                             ) -> ReasoningParser | None:
    if name == "none":
        return None
    if name == "auto":
        if START not in template:
            return None
        try:
            return ThinkTagParser(token_id)
        except ConfigError:
            return None
    if name not in PARSERS:
        raise ConfigError(f"--reasoning-parser: unknown parser {name!r}; choose one of {', '.join(CHOICES)}")
    return PARSERS[name](token_id)
