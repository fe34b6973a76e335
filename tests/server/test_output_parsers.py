"""Tool-call and reasoning parsers on their own: what each format's text parses to, that streaming
in any chunking adds up to exactly that, and that each format's forced grammar accepts a well-formed
call of an offered function and nothing else (checked with llguidance on a real tokenizer)."""

from __future__ import annotations

import json
import random

import llguidance
import pytest
from tokenizers import Tokenizer

from kvik.server.reasoning import ThinkingState
from kvik.server.reasoning.think_tags import ThinkTagParser
from kvik.server.serving.assistant import AssistantPlan
from kvik.server.tool_parsers import PARSERS, FunctionSpec, TokenVocabulary, ToolCallStream, detect_tool_parser
from kvik.server.tool_parsers.base import call_schema

VOCABULARY = TokenVocabulary(lambda text: None, frozenset())

# (format, text, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2]}}\n'
               '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
     "Let me look.", [("get_weather", '{"city": "Paris", "n": [1, 2]}'), ("noop", "{}")]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"s": "a } tricky \\" string"}}\n</tool_call>', None,
     [("f", '{"s": "a } tricky \\" string"}')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', None, [("f", '{"x": 1}')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}}', None, [("f", '{"x": 1}')]),  # no closing tag
    ("hermes", "Just text, <tool", "Just text, <tool", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", '{"x": 1}'), ("b", "{}")]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"q": "x;y"}}', None, [("a", '{"q": "x;y"}')]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "Paris is sunny.", "Paris is sunny.", []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', "Sure.",
     [("a", '{"x": 1}'), ("b", "{}")]),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": [1]}[TOOL_CALLS]b[ARGS]{}', None, [("a", '{"x": [1]}'), ("b", "{}")]),
    ("mistral", "No call [TOOL", "No call [TOOL", []),
]


def stream_in_chunks(parser, text: str, sizes: list[int]) -> tuple[str, list[tuple[str, str]]]:
    stream = ToolCallStream(parser)
    content, calls, position = "", {}, 0
    pieces = []
    for size in sizes:
        pieces.append(text[position:position + size])
        position += size
    pieces.append(text[position:])
    for index, piece in enumerate(pieces):
        new_content, entries = stream.feed(piece, final=index == len(pieces) - 1)
        content += new_content
        for entry in entries:
            if "id" in entry:
                assert entry["index"] not in calls and entry["function"]["arguments"] == ""
                calls[entry["index"]] = [entry["function"]["name"], ""]
            else:
                calls[entry["index"]][1] += entry["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("style,text,content,calls", CASES)
def test_parse_and_every_chunking_of_the_stream_agree(style, text, content, calls):
    parser = PARSERS[style](VOCABULARY)
    parsed = parser.parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    rng = random.Random(0)
    for chunking in [[1] * len(text), [3] * (len(text) // 3)] + [
            [rng.randint(1, 9) for _ in range(len(text) // 3)] for _ in range(5)]:
        streamed_content, streamed_calls = stream_in_chunks(parser, text, chunking)
        assert streamed_calls == calls
        assert streamed_content == (content or "")


def test_formats_detected_from_templates():
    assert detect_tool_parser("...<tool_call>\\n{{ tool_call | tojson }}...").name == "hermes"
    assert detect_tool_parser('<|start_header_id|>ipython ... "parameters": {{ args }}').name == "llama3_json"
    assert detect_tool_parser("{{ '[TOOL_CALLS]' + calls }} <tool_call>").name == "mistral"
    assert detect_tool_parser("{{ message.content }}") is None


FUNCTIONS = [
    FunctionSpec("get_weather", {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                                 "required": ["city"], "additionalProperties": False}),
    FunctionSpec("get_time", {"$defs": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]+$"}},
                              "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}},
                              "required": ["zone"], "additionalProperties": False}),
]
WELL_FORMED = {
    "hermes": ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe"}}\n</tool_call>',
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "europe"}}\n</tool_call>'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {"zone": "Asia"}}',
                    '{"name": "get_stock", "parameters": {"city": "Oslo"}}'),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
}


@pytest.fixture(scope="module")
def lltokenizer(tiny_llama):
    return llguidance.LLTokenizer(Tokenizer.from_file(str(tiny_llama / "tokenizer.json")).to_str())


def accepts(tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    tokens = tokenizer.tokenize_str(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("style", sorted(WELL_FORMED))
def test_forced_grammar_accepts_valid_calls_only(lltokenizer, style):
    parser = PARSERS[style](VOCABULARY)
    good, bad = WELL_FORMED[style]
    assert accepts(lltokenizer, parser.forced_grammar(FUNCTIONS, parallel=True), good)
    assert not accepts(lltokenizer, parser.forced_grammar(FUNCTIONS, parallel=True), bad)
    assert parser.parse(good).calls  # what the grammar forces, the parser reads
    single = WELL_FORMED["llama3_json"][0].split("; ")[0]
    if style == "llama3_json":
        assert not accepts(lltokenizer, parser.forced_grammar(FUNCTIONS, parallel=False), WELL_FORMED[style][0])
        assert accepts(lltokenizer, parser.forced_grammar(FUNCTIONS, parallel=False), single)


def test_call_schema_rebases_local_refs():
    schema = call_schema(FUNCTIONS, root="#/items")
    zone = schema["anyOf"][1]["properties"]["arguments"]["properties"]["zone"]
    assert zone == {"$ref": "#/items/anyOf/1/properties/arguments/$defs/zone"}


# -- reasoning --


@pytest.fixture(scope="module")
def think_parser():
    ids = {"<think>": 900, "</think>": 901}
    return ThinkTagParser(ids.get)


@pytest.mark.parametrize("state,text,reasoning,content", [
    (ThinkingState.OPEN, "weighing it up</think>\n\nThe answer.", "weighing it up", "The answer."),
    (ThinkingState.OPEN, "still thinking </thi", "still thinking </thi", ""),
    (ThinkingState.MODEL, "<think>\nhmm</think>Yes.", "\nhmm", "Yes."),
    (ThinkingState.MODEL, "No tags at all.", None, "No tags at all."),
    (ThinkingState.MODEL, "  <thin", None, "  <thin"),
    (ThinkingState.CLOSED, "Plain answer </think> kept", None, "Plain answer </think> kept"),
])
def test_reasoning_split_and_stream_agree(think_parser, state, text, reasoning, content):
    split = think_parser.split(text, state, final=True)
    assert (split.reasoning, split.content) == (reasoning, content)
    plan = AssistantPlan(reasoning=think_parser, thinking=state)
    for size in (1, 2, 5):
        stream = plan.stream()
        got_reasoning, got_content = "", ""
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        for index, chunk in enumerate(chunks):
            for delta in stream.feed(chunk, final=index == len(chunks) - 1):
                got_reasoning += delta.get("reasoning_content", "")
                got_content += delta.get("content", "")
        assert (got_reasoning, got_content) == (reasoning or "", content)


def test_thinking_state_is_read_from_the_end_of_the_prompt(think_parser):
    def decode(ids):
        return "".join(" " if i == 10 else "x" for i in ids)

    assert think_parser.thinking_state([1, 2, 900, 10], decode) is ThinkingState.OPEN
    assert think_parser.thinking_state([1, 900, 10, 901, 10, 10], decode) is ThinkingState.CLOSED
    assert think_parser.thinking_state([1, 900, 5, 901, 7, 8], decode) is ThinkingState.MODEL  # an old turn's
    assert think_parser.thinking_state([1, 2, 3], decode) is ThinkingState.MODEL


def test_message_combines_reasoning_and_tool_calls(think_parser):
    plan = AssistantPlan(reasoning=think_parser, thinking=ThinkingState.OPEN,
                         tools=PARSERS["hermes"](VOCABULARY))
    text = 'need weather</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    message, finish = plan.message(text, "stop")
    assert finish == "tool_calls"
    assert message["reasoning_content"] == "need weather" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
