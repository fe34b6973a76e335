"""Structured outputs through a real `kvik serve` and the official openai SDK.

The model has random weights: its free text is garbage (see the unconstrained check), so an output
that parses and validates can only come from the grammar constraining every token. Sampling is at
temperature 1 with seeds, so each case is deterministic and still explores the grammar.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from kvik.bench.json_schemas import SCHEMAS

MESSAGES = [{"role": "user", "content": "Reply with JSON."}]
MAX_TOKENS = 400  # the twenty schemas finish in well under 200 tokens at temperature 1
FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=FORMAT_CHECKER)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_free_text_of_this_model_is_not_json(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=0, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(response.choices[0].message.content)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_sample_validates_against_its_schema(client, name):
    """Must-show 1: per schema, four seeded samples (two requests of n=2) without streaming and two
    streamed, all at temperature 1: every one parses, validates and ends with finish_reason stop."""
    schema = SCHEMAS[name]
    texts = []
    for seed in (11, 12):
        response = client.chat.completions.create(
            model="tiny", messages=MESSAGES, response_format=json_schema_format(schema), n=2,
            temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)
        for choice in response.choices:
            assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
            texts.append(choice.message.content)
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=json_schema_format(schema), n=2,
        temperature=1.0, seed=13, max_tokens=MAX_TOKENS, stream=True)
    streamed: dict[int, list[str]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index].append(choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    texts.extend("".join(parts) for parts in streamed.values())
    for text in texts:
        assert_valid(text, schema)


def test_streamed_equals_non_streamed_for_the_same_seed(client):
    schema = SCHEMAS["nested_address"]
    kwargs = dict(model="tiny", messages=MESSAGES, response_format=json_schema_format(schema), seed=5,
                  max_tokens=MAX_TOKENS)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
              if c.choices]
    assert "".join(pieces) == whole
    assert_valid(whole, schema)


def test_completions_accept_vllm_guided_fields_streamed_and_not(client):
    schema = SCHEMAS["ref_defs"]
    response = client.completions.create(model="tiny", prompt="JSON:", max_tokens=MAX_TOKENS, seed=3,
                                         extra_body={"guided_json": schema})
    assert_valid(response.choices[0].text, schema)
    assert response.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="tiny", prompt="JSON:", max_tokens=MAX_TOKENS, seed=3,
                                       stream=True, extra_body={"structured_outputs": {"json": schema}})
    assert "".join(c.choices[0].text for c in stream) == response.choices[0].text


@pytest.mark.parametrize("field,value,check", [
    ("guided_choice", ["alpha", "beta", "gamma"], lambda t: t in ("alpha", "beta", "gamma")),
    ("guided_regex", r"[A-Z]{2}-\d{3}", lambda t: len(t) == 6 and t[:2].isupper() and t[2] == "-"
     and all(c in "0123456789" for c in t[3:])),
    ("guided_grammar", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/',
     lambda t: t.startswith("(") and t.endswith(")") and all(p.isdigit() for p in t[1:-1].split("+"))),
    ("guided_grammar", 'root ::= "yes" | "no"', lambda t: t in ("yes", "no")),
])
def test_regex_choice_and_grammar_constraints(client, field, value, check):
    for seed in range(3):
        response = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=seed,
                                                  max_tokens=60, extra_body={field: value})
        text = response.choices[0].message.content
        assert check(text), text
        assert response.choices[0].finish_reason == "stop"


def test_json_object_gives_an_object(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=2, max_tokens=MAX_TOKENS,
                                              response_format={"type": "json_object"})
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)
    else:  # an unbounded object may run out of tokens; what was written is still a JSON prefix
        assert response.choices[0].message.content.startswith("{")


def test_length_when_the_budget_ends_mid_object(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=1, max_tokens=4,
                                              response_format=json_schema_format(SCHEMAS["flat_record"]))
    assert response.choices[0].finish_reason == "length"
    assert response.choices[0].message.content.startswith("{")


def test_stop_string_ends_a_constrained_output(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=1, max_tokens=MAX_TOKENS,
                                              stop=[":"], response_format=json_schema_format(SCHEMAS["flat_record"]))
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].message.content == '{"name"'


def test_logprobs_are_the_raw_distribution(client):
    """The first token of an object must be "{", whatever the model thinks of it: it is chosen, and
    its reported logprob and rank are the unconstrained model's (it is rarely the model's top pick)."""
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, seed=4, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3,
        response_format=json_schema_format(SCHEMAS["flat_record"]))
    first = response.choices[0].logprobs.content[0]
    assert first.token == "{"
    assert [t.token for t in first.top_logprobs][0] != "{"
    assert first.logprob < first.top_logprobs[0].logprob
    assert sum(1 for t in response.choices[0].logprobs.content) == response.usage.completion_tokens


def test_seeded_constrained_sampling_is_reproducible(client):
    kwargs = dict(model="tiny", messages=MESSAGES, seed=21, n=3, max_tokens=MAX_TOKENS,
                  response_format=json_schema_format(SCHEMAS["array_of_objects"]))
    first = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    second = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    assert first == second
    assert len(set(first)) == 3


# -- must-show 3: what cannot be enforced is a 400 naming it --


def bad_request(client, **kwargs) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, **kwargs)
    return caught.value.body


@pytest.mark.parametrize("schema,named", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "integer", "not": {"const": 3}}, "not"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"type": "array", "contains": {"const": 1}}, "contains"),
])
def test_unsupported_schema_keyword_is_400_naming_it(client, schema, named):
    body = bad_request(client, response_format=json_schema_format(schema))
    assert f'"{named}"' in body["message"]
    assert body["param"] == "response_format.json_schema.schema"
    assert body["type"] == "invalid_request_error" and body["code"] == "unsupported_constraint"


@pytest.mark.parametrize("extra,param,words", [
    ({"guided_regex": "(?=a)b"}, "guided_regex", "look-around"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar", "unknown name"),
    ({"guided_json": {"$ref": "#/$defs/none"}}, "guided_json", "does not exist"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "one output constraint"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not permitted"),
    ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos", "cannot be combined"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
])
def test_bad_constraints_are_400(client, extra, param, words):
    body = bad_request(client, extra_body=extra)
    assert body["param"] == param
    assert words in body["message"]


def test_json_schema_format_without_schema_is_400(client):
    body = bad_request(client, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert body["param"] == "response_format.json_schema.schema"
