"""Hermes-style calls (NousResearch Hermes, Qwen2.5, Qwen3, QwQ and many fine-tunes): each call is a
JSON object between tags, any text before them is the content.

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json

from kvik.server.tool_parsers.base import (WHITESPACE, CallText, FunctionSpec, Split, ToolParser,
                                           call_from_object, call_schema, held_prefix, skip_whitespace)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    template_markers = (OPEN,)
    markers = (OPEN, CLOSE)

    def split(self, text: str, final: bool) -> Split:
        pieces: list[str] = []
        calls: list[CallText] = []
        position = 0
        while True:
            start = text.find(OPEN, position)
            if start == -1:
                tail = text[position:]
                if not final:
                    tail = tail[:len(tail) - held_prefix(tail, OPEN)]
                pieces.append(tail.lstrip(WHITESPACE) if calls else tail)
                break
            before = text[position:start]
            pieces.append(before.strip(WHITESPACE) if calls else before.rstrip(WHITESPACE))
            body = skip_whitespace(text, start + len(OPEN))
            close = text.find(CLOSE, body)
            end = close if close != -1 else len(text)
            found = call_from_object(text[:end], body, final or close != -1)
            if found is None:
                # Not a call object: while streaming it may still become one; finished, it is text.
                calls.append(CallText(None, "", complete=final or close != -1, streamable=False))
            else:
                calls.append(found[0])
            if close == -1:
                break
            position = close + len(CLOSE)
        return Split("".join(pieces), calls)

    def forced_grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        call = (f"{self.literal(OPEN)} \"\\n\" %json {json.dumps(call_schema(functions))} "
                f"\"\\n\" {self.literal(CLOSE)}")
        repeat = ' ("\\n" call)*' if parallel else ""
        return f"start: call{repeat}\ncall: {call}\n"
