"""The assistant's message from a choice's text: thinking split off (`reasoning_content`), tool calls
parsed out of the rest (`tool_calls`, finish_reason "tool_calls"), the remainder as `content`; and
the same as streamed deltas, which add up to the same message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvik.server.reasoning import ReasoningParser, ReasoningStream, ThinkingState
from kvik.server.tool_parsers import ToolCallStream, ToolParser


@dataclass(slots=True)
class AssistantPlan:
    reasoning: ReasoningParser | None = None
    thinking: ThinkingState = ThinkingState.CLOSED
    tools: ToolParser | None = None
    parallel_tool_calls: bool = True

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(message, finish_reason) for a whole choice."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            split = self.reasoning.split(text, self.thinking, final=True)
            message["reasoning_content"], message["content"] = split.reasoning, split.content
        if self.tools is not None:
            parsed = self.tools.parse(message["content"], self.parallel_tool_calls)
            if parsed.calls:
                message["content"] = parsed.content
                message["tool_calls"] = [call.to_openai() for call in parsed.calls]
                if finish_reason == "stop":
                    finish_reason = "tool_calls"
        return message, finish_reason

    def stream(self) -> AssistantStream:
        return AssistantStream(self)


class AssistantStream:
    """One choice's streamed deltas: `feed` the new text, get the delta objects to send."""

    def __init__(self, plan: AssistantPlan) -> None:
        self.reasoning = ReasoningStream(plan.reasoning, plan.thinking) if plan.reasoning else None
        self.tools = ToolCallStream(plan.tools, plan.parallel_tool_calls) if plan.tools else None

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, final)
            if reasoning:
                deltas.append({"reasoning_content": reasoning})
        if self.tools is None:
            if content:
                deltas.append({"content": content})
            return deltas
        content, entries = self.tools.feed(content, final)
        if content:
            deltas.append({"content": content})
        deltas.extend({"tool_calls": [entry]} for entry in entries)
        return deltas

    def finish_reason(self, engine_reason: str) -> str:
        if engine_reason == "stop" and self.tools is not None and self.tools.has_calls:
            return "tool_calls"
        return engine_reason
