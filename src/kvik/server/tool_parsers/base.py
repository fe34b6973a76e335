"""The tool-call parser interface, and what every format shares.

A format (one file each: hermes, llama3_json, mistral) says two things: how to split a model's text
into plain content and tool calls (`split`, also on text that is still being streamed), and the
grammar that forces the model to write calls in that format (`forced_grammar`, Lark for llguidance,
for `tool_choice` "required" or a named function). Everything else is shared here: turning a split
into `ToolCall`s for a whole response (`parse`) and into OpenAI's streamed `delta.tool_calls`
(`ToolCallStream`), so a stream always adds up to the non-streamed answer.

The JSON of a call is read with a small scanner of our own rather than `json.loads`: streaming needs
the *text span* of the `arguments` value while it is still incomplete, so that its pieces can be sent
as the model writes them and concatenate to exactly the final `arguments` string.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from kvik.engine.structured.grammar import JSON_OPTIONS

WHITESPACE = " \t\r\n"


@dataclass(slots=True)
class FunctionSpec:
    """A function the request offers: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class CallText:
    """One call found in the text, possibly still being written."""

    name: str | None  # None until the name's JSON string is complete
    arguments: str  # the arguments' JSON text so far ("" if not started)
    complete: bool  # the call's text is final
    streamable: bool = True  # `arguments` only grows by appending (an object being written)


@dataclass(slots=True)
class Split:
    content: str  # text outside tool-call markup, whitespace next to the markup removed
    calls: list[CallText] = field(default_factory=list)


@dataclass(slots=True)
class ParsedCalls:
    content: str | None
    calls: list[ToolCall]


class TokenVocabulary:
    """What a format needs to know about the tokenizer: whether a marker is one special token (the
    grammar must then name it by id, and the text keeps it only without skip_special_tokens)."""

    def __init__(self, token_id: Callable[[str], int | None], special_ids: frozenset[int]) -> None:
        self.token_id = token_id
        self.special_ids = special_ids

    def special_token(self, text: str) -> int | None:
        token = self.token_id(text)
        return token if token is not None and token in self.special_ids else None


class ToolParser(ABC):
    name: ClassVar[str]
    # Strings whose presence in a chat template says the model writes this format.
    template_markers: ClassVar[tuple[str, ...]] = ()
    # Markers that may be special tokens (the text needs skip_special_tokens=False to keep them).
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, vocabulary: TokenVocabulary) -> None:
        self.vocabulary = vocabulary

    @property
    def needs_special_tokens(self) -> bool:
        return any(self.vocabulary.special_token(m) is not None for m in self.markers)

    def literal(self, text: str) -> str:
        """`text` as a Lark terminal: the token by id if it is one special token, else the string."""
        special = self.vocabulary.special_token(text)
        return f"<[{special}]>" if special is not None else json.dumps(text)

    @abstractmethod
    def split(self, text: str, final: bool) -> Split:
        """Content and calls in `text`; while not `final`, a possible start of markup at the end is
        held back (neither content nor call yet)."""

    @abstractmethod
    def forced_grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        """A Lark grammar (llguidance) whose every sentence is one call (or, if `parallel`, one or
        more) of one of `functions`, with arguments valid against its parameters."""

    def parse(self, text: str, parallel: bool = True) -> ParsedCalls:
        """The calls in a finished text. If any call is malformed, there are none: the text is
        returned as content, as the model wrote it."""
        split = self.split(text, final=True)
        if not split.calls:
            return ParsedCalls(text, [])
        calls = []
        for call in split.calls:
            if not call.complete or call.name is None or not _is_json_object(call.arguments):
                return ParsedCalls(text, [])
            calls.append(ToolCall(call.name, call.arguments))
        if not parallel:
            calls = calls[:1]
        return ParsedCalls(split.content or None, calls)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class ToolCallStream:
    """Turns a growing text into OpenAI's streamed deltas: content pieces, and per call a first
    entry with id and name, then its arguments in pieces."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel
        self.text = ""
        self.content_sent = 0
        self.calls: list[ToolCall] = []  # announced calls; `arguments` holds what was sent
        self.has_calls = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Add `delta`; return (new content, new tool-call delta entries)."""
        self.text += delta
        split = self.parser.split(self.text, final)
        content = split.content if final else split.content.rstrip(WHITESPACE)
        if final and not self.calls and not self.parser.parse(self.text, self.parallel).calls:
            # Nothing was announced and nothing parses as a call: all of it is text, as `parse` says.
            split, content = Split(self.text), self.text
        new_content = content[self.content_sent:] if len(content) > self.content_sent else ""
        self.content_sent += len(new_content)
        entries: list[dict[str, Any]] = []
        calls = split.calls if self.parallel else split.calls[:1]
        for index, call in enumerate(calls):
            if index == len(self.calls):
                if call.name is None:
                    break
                announced = ToolCall(call.name, "")
                self.calls.append(announced)
                self.has_calls = True
                entries.append({"index": index, "id": announced.id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}})
            sent = self.calls[index]
            if call.streamable or call.complete:
                piece = call.arguments[len(sent.arguments):]
                if piece:
                    sent.arguments += piece
                    entries.append({"index": index, "function": {"arguments": piece}})
        return new_content, entries


# -- reading JSON text that may be incomplete --


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in WHITESPACE:
        position += 1
    return position


def value_end(text: str, start: int, final: bool) -> int | None:
    """The index just past the JSON value starting at `start`, or None if the text ends inside
    it. A bare literal (number, true, ...) ends at a delimiter, or at the end of a final text."""
    if start >= len(text):
        return None
    opener = text[start]
    if opener == '"':
        position = start + 1
        while position < len(text):
            char = text[position]
            if char == "\\":
                position += 2
                continue
            if char == '"':
                return position + 1
            position += 1
        return None
    if opener in "{[":
        depth, position, in_string = 0, start, False
        while position < len(text):
            char = text[position]
            if in_string:
                if char == "\\":
                    position += 1
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return position + 1
            position += 1
        return None
    position = start
    while position < len(text) and text[position] not in ",}]" + WHITESPACE:
        position += 1
    return position if position < len(text) or final else None


@dataclass(slots=True)
class ObjectScan:
    members: dict[str, tuple[int, int | None]]  # key -> (value start, value end or None)
    end: int | None  # just past the closing brace, or None while incomplete


def scan_object(text: str, start: int, final: bool = False) -> ObjectScan | None:
    """The members of the JSON object at `start` as far as the text goes; None if it is not an
    object (or is malformed before it ends)."""
    if start >= len(text) or text[start] != "{":
        return None
    members: dict[str, tuple[int, int | None]] = {}
    position = skip_whitespace(text, start + 1)
    if position < len(text) and text[position] == "}":
        return ObjectScan(members, position + 1)
    while position < len(text):
        if text[position] != '"':
            return None
        key_end = value_end(text, position, final)
        if key_end is None:
            return ObjectScan(members, None)
        key = json.loads(text[position:key_end])
        position = skip_whitespace(text, key_end)
        if position >= len(text):
            return ObjectScan(members, None)
        if text[position] != ":":
            return None
        position = skip_whitespace(text, position + 1)
        if position >= len(text):
            return ObjectScan(members, None)
        end = value_end(text, position, final)
        members[key] = (position, end)
        if end is None:
            return ObjectScan(members, None)
        position = skip_whitespace(text, end)
        if position >= len(text):
            return ObjectScan(members, None)
        if text[position] == "}":
            return ObjectScan(members, position + 1)
        if text[position] != ",":
            return None
        position = skip_whitespace(text, position + 1)
    return ObjectScan(members, None)


def call_from_object(text: str, start: int, final: bool, arguments_keys: tuple[str, ...] = ("arguments",)
                     ) -> tuple[CallText, int | None] | None:
    """A call written as `{"name": ..., "arguments": {...}}` at `start`: the call and the index just
    past the object (None while incomplete); None if the text there is no such object."""
    scan = scan_object(text, start, final)
    if scan is None:
        return None
    name = None
    if "name" in scan.members:
        value_start, value_stop = scan.members["name"]
        if value_stop is not None:
            try:
                decoded = json.loads(text[value_start:value_stop])
            except ValueError:
                return None
            if not isinstance(decoded, str):
                return None
            name = decoded
    arguments, streamable = "", True
    key = next((k for k in arguments_keys if k in scan.members), None)
    if key is not None:
        value_start, value_stop = scan.members[key]
        arguments = text[value_start:value_stop if value_stop is not None else len(text)]
        if text[value_start] == '"':  # arguments sent as a JSON string holding JSON
            streamable = False
            if value_stop is not None:
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    return None
    elif scan.end is not None:
        arguments = "{}"
    # The name must come first for arguments to stream; otherwise they wait for the whole object.
    streamable = streamable and (key is None or "name" not in scan.members
                                 or scan.members["name"][0] < scan.members[key][0])
    return CallText(name, arguments, complete=scan.end is not None, streamable=streamable), scan.end


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def call_schema(functions: list[FunctionSpec], arguments_key: str = "arguments", root: str = "#"
                ) -> dict[str, Any]:
    """The JSON schema of one call object `{"name": ..., arguments_key: {...}}` of any function,
    placed at JSON pointer `root` of the final document. Each function's local `$ref`s ("#/$defs/x",
    "#") are rebased onto where its parameters sit there, so they still point into its schema."""
    single = len(functions) == 1
    options = []
    for index, function in enumerate(functions):
        base = (f"{root}/properties/{arguments_key}" if single
                else f"{root}/anyOf/{index}/properties/{arguments_key}")
        options.append({
            "type": "object",
            "properties": {"name": {"const": function.name},
                           arguments_key: _rebase_refs(function.parameters, base)},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = options[0] if single else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


def _rebase_refs(schema: Any, base: str) -> Any:
    if isinstance(schema, list):
        return [_rebase_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rebased[key] = base + value[1:]
        elif key in ("properties", "$defs", "definitions", "patternProperties"):
            # Keys here are names, not keywords: only their values are schemas.
            rebased[key] = ({name: _rebase_refs(sub, base) for name, sub in value.items()}
                            if isinstance(value, dict) else value)
        else:
            rebased[key] = _rebase_refs(value, base)
    return rebased
