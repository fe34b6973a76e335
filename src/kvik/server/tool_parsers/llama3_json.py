"""Llama 3.1 / 3.2 / 3.3 JSON calls: the whole answer is a call object (after an optional
`<|python_tag|>`), several separated by semicolons; arguments under "parameters".

    {"name": "get_weather", "parameters": {"city": "Paris"}}
"""

from __future__ import annotations

import json

from kvik.server.tool_parsers.base import (CallText, FunctionSpec, Split, ToolParser, call_from_object,
                                           call_schema, skip_whitespace)

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    template_markers = ('"parameters": ', "<|start_header_id|>")  # all of them, see `matches`
    markers = (PYTHON_TAG,)

    @classmethod
    def matches(cls, template: str) -> bool:
        return all(marker in template for marker in cls.template_markers)

    def split(self, text: str, final: bool) -> Split:
        start = skip_whitespace(text, 0)
        rest = text[start:]
        if rest.startswith(PYTHON_TAG):
            start = skip_whitespace(text, start + len(PYTHON_TAG))
        elif not final and (not rest or PYTHON_TAG.startswith(rest)):
            return Split("")  # could still become a call
        elif not rest.startswith("{"):
            return Split(text)
        calls: list[CallText] = []
        position = start
        while position < len(text):
            found = call_from_object(text, position, final, ("parameters", "arguments"))
            if found is None:
                return Split(text) if final or calls else Split("")
            call, end = found
            calls.append(call)
            if end is None:
                break
            position = skip_whitespace(text, end)
            if position < len(text) and text[position] == ";":
                position = skip_whitespace(text, position + 1)
            elif position < len(text):
                return Split(text) if final else Split("", calls)
        if final and calls and calls[-1].name is None and not calls[-1].complete:
            return Split(text)
        return Split("", calls)

    def forced_grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        schema = json.dumps(call_schema(functions, "parameters"))
        repeat = f" ({json.dumps(SEPARATOR)} call)*" if parallel else ""
        return f"start: call{repeat}\ncall: %json {schema}\n"

