"""The reasoning parser interface: where a reasoning model's thinking ends and its answer begins.

A parser knows the model's tags, decides from the rendered prompt whether the output starts inside
the thinking (a template that opens `<think>` itself, as DeepSeek-R1's does) or after it (one that
wrote an empty `<think></think>` because `enable_thinking` is false, as Qwen3's does), and splits
text into (reasoning, content), also while it streams (`ReasoningStream`), so the streamed deltas
add up to the non-streamed message. Structured outputs start constraining after the end tag.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

WHITESPACE = " \t\r\n"


class ThinkingState(enum.Enum):
    OPEN = "open"  # the prompt opened the thinking: the output starts inside it
    CLOSED = "closed"  # the prompt closed it (thinking disabled): the output is the answer
    MODEL = "model"  # the prompt says nothing: the model may open it itself


@dataclass(slots=True)
class ReasoningSplit:
    reasoning: str | None  # None if the output has no thinking part
    content: str


class ReasoningParser(ABC):
    name: ClassVar[str]

    @property
    @abstractmethod
    def end_token_id(self) -> int:
        """The token that ends the thinking; constraints start after it."""

    @abstractmethod
    def thinking_state(self, prompt_token_ids: list[int], decode: Callable[[list[int]], str]) -> ThinkingState:
        """Where the rendered prompt leaves the model."""

    @abstractmethod
    def split(self, text: str, state: ThinkingState, final: bool) -> ReasoningSplit:
        """Reasoning and content of `text`; while not `final`, a possible start of a tag at the end
        is held back."""


class ReasoningStream:
    """Streamed (reasoning, content) deltas that add up to `parser.split(text, state, True)`."""

    def __init__(self, parser: ReasoningParser, state: ThinkingState) -> None:
        self.parser = parser
        self.state = state
        self.text = ""
        self.reasoning_sent = 0
        self.content_sent = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        split = self.parser.split(self.text, self.state, final)
        reasoning = split.reasoning or ""
        new_reasoning = reasoning[self.reasoning_sent:]
        new_content = split.content[self.content_sent:]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        self.content_sent = max(self.content_sent, len(split.content))
        return new_reasoning, new_content
