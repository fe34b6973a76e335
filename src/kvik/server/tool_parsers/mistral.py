"""Mistral calls: `[TOOL_CALLS]` (a special token in Mistral's tokenizers) followed by a JSON list of
call objects (tokenizer v3 to v7), or, from v11 on, by `name[ARGS]{arguments}` for each call.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}
"""

from __future__ import annotations

import json

from kvik.server.tool_parsers.base import (WHITESPACE, CallText, FunctionSpec, Split, ToolParser,
                                           call_from_object, call_schema, held_prefix, skip_whitespace,
                                           value_end)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    template_markers = (MARKER,)
    markers = (MARKER, ARGS)

    def split(self, text: str, final: bool) -> Split:
        start = text.find(MARKER)
        if start == -1:
            content = text if final else text[:len(text) - held_prefix(text, MARKER)]
            return Split(content)
        content = text[:start].rstrip(WHITESPACE)
        position = skip_whitespace(text, start + len(MARKER))
        if position < len(text) and text[position] == "[":
            return Split(content, self._json_list(text, position + 1, final))
        return Split(content, self._named_calls(text, start, final))

    @staticmethod
    def _json_list(text: str, position: int, final: bool) -> list[CallText]:
        calls: list[CallText] = []
        position = skip_whitespace(text, position)
        while position < len(text) and text[position] != "]":
            found = call_from_object(text, position, final)
            if found is None:
                calls.append(CallText(None, "", complete=True, streamable=False))
                break
            call, end = found
            calls.append(call)
            if end is None:
                break
            position = skip_whitespace(text, end)
            if position < len(text) and text[position] == ",":
                position = skip_whitespace(text, position + 1)
        return calls

    @staticmethod
    def _named_calls(text: str, position: int, final: bool) -> list[CallText]:
        calls: list[CallText] = []
        while text.startswith(MARKER, position):
            name_start = position + len(MARKER)
            args_at = text.find(ARGS, name_start)
            if args_at == -1:
                break  # the name is still being written
            arguments_start = skip_whitespace(text, args_at + len(ARGS))
            end = value_end(text, arguments_start, final)
            arguments = text[arguments_start:end if end is not None else len(text)]
            calls.append(CallText(text[name_start:args_at].strip(), arguments, complete=end is not None,
                                  streamable=arguments[:1] in ("", "{")))
            if end is None:
                break
            position = skip_whitespace(text, end)
        return calls

    def forced_grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        schema = call_schema(functions, root="#/items")
        options = schema.pop("x-guidance")
        array = {"type": "array", "items": schema, "minItems": 1, "x-guidance": options}
        if not parallel:
            array["maxItems"] = 1
        return f"start: {self.literal(MARKER)} %json {json.dumps(array)}\n"
