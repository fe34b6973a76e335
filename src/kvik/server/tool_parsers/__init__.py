"""Tool-call formats, one file each, chosen by name (`--tool-call-parser`) or from the chat template.

`resolve_tool_parser("auto", template, vocabulary)` picks the format whose markers the model's chat
template writes (Mistral's `[TOOL_CALLS]`, Hermes' `<tool_call>`, Llama 3's JSON with "parameters"),
and Hermes when the template shows none: its tags are plain text any model can be made to write,
and a `required` or named tool_choice forces them with the grammar whatever the template says.
"""

from __future__ import annotations

from kvik.core.errors import ConfigError
from kvik.server.tool_parsers.base import (FunctionSpec, ParsedCalls, TokenVocabulary, ToolCall,
                                           ToolCallStream, ToolParser)
from kvik.server.tool_parsers.hermes import HermesToolParser
from kvik.server.tool_parsers.llama3_json import Llama3JsonToolParser
from kvik.server.tool_parsers.mistral import MistralToolParser

PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}
DEFAULT_PARSER = HermesToolParser
CHOICES = ("auto", "none", *PARSERS)

__all__ = ["CHOICES", "DEFAULT_PARSER", "PARSERS", "FunctionSpec", "ParsedCalls", "TokenVocabulary", "ToolCall",
           "ToolCallStream", "ToolParser", "detect_tool_parser", "resolve_tool_parser"]


def detect_tool_parser(template: str) -> type[ToolParser] | None:
    """The format a chat template's text says the model writes, if any."""
    if MistralToolParser.template_markers[0] in template:
        return MistralToolParser
    if HermesToolParser.template_markers[0] in template:
        return HermesToolParser
    if Llama3JsonToolParser.matches(template):
        return Llama3JsonToolParser
    return None


def resolve_tool_parser(name: str, template: str, vocabulary: TokenVocabulary) -> ToolParser | None:
    """The parser for `--tool-call-parser NAME` ("auto": from the template; "none": no parsing)."""
    if name == "none":
        return None
    if name == "auto":
        return (detect_tool_parser(template) or DEFAULT_PARSER)(vocabulary)
    if name not in PARSERS:
        raise ConfigError(f"--tool-call-parser: unknown parser {name!r}; choose one of {', '.join(CHOICES)}")
    return PARSERS[name](vocabulary)
