"""A chat request's tools: validated, offered to the template, and turned into a plan for the
output (parse calls from the text, or force them with a grammar).

`tool_choice` "auto" (the default when tools are given) parses the calls the model chose to write
and returns plain text when it wrote none; "required" and a named function force the model, with
the grammar engine, to write one call (or, with `parallel_tool_calls`, one or more) in the model's
own format, with arguments valid against the function's `parameters`; "none" parses nothing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from kvik.core.errors import InvalidRequestError
from kvik.core.sampling_params import StructuredOutputs
from kvik.engine.structured.grammar import check_constraint
from kvik.protocol.openai import ChatCompletionRequest, NamedToolChoice
from kvik.server.tool_parsers import FunctionSpec, ToolParser

# OpenAI: a function without `parameters` takes none.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(slots=True)
class ToolPlan:
    parser: ToolParser | None = None  # reads calls from the output; None: the output is text
    constraint: StructuredOutputs | None = None  # forces calls (required / named)
    parallel: bool = True


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the client sent them, for the chat template."""
    if not body.tools:
        return None
    return [tool.model_dump(exclude_unset=True) for tool in body.tools]


async def plan_tools(body: ChatCompletionRequest, parser: ToolParser | None, fallback: ToolParser
                     ) -> ToolPlan:
    """`parser` is the server's (None with --tool-call-parser none); `fallback` writes forced calls
    when there is none."""
    choice = body.tool_choice
    tools = body.tools or []
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice: is only allowed when tools are given", param="tool_choice")
        return ToolPlan()
    functions = [FunctionSpec(t.function.name, t.function.parameters if t.function.parameters is not None
                              else NO_PARAMETERS) for t in tools]
    names = [f.name for f in functions]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise InvalidRequestError(f"tools: function {duplicate!r} is defined more than once", param="tools")
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        return ToolPlan(parser, None, parallel)
    if choice == "none":
        return ToolPlan(None, None, parallel)
    if isinstance(choice, NamedToolChoice):
        wanted = choice.function.name
        if wanted not in names:
            raise InvalidRequestError(
                f"tool_choice: function {wanted!r} is not one of the request's tools "
                f"({', '.join(repr(n) for n in names)})", param="tool_choice")
        functions = [f for f in functions if f.name == wanted]
        parallel = False  # OpenAI: a named choice calls that function once
    forced = {f.name for f in functions}
    for index, tool in enumerate(tools):
        if tool.function.name in forced and tool.function.parameters is not None:
            await asyncio.to_thread(check_constraint, StructuredOutputs(json=tool.function.parameters),
                                    f"tools[{index}].function.parameters")
    writer = parser or fallback
    constraint = StructuredOutputs(grammar=writer.forced_grammar(functions, parallel))
    await asyncio.to_thread(check_constraint, constraint, "tool_choice")
    return ToolPlan(writer, constraint, parallel)
