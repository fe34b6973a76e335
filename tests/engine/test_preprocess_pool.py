"""The tokenizer worker pool refuses an over-long prompt itself, so a prompt of millions of tokens
never ships its ids back to the server (unpickling them would hold the server's GIL for tens of ms)."""

from __future__ import annotations

import asyncio

import pytest

from kvik.core.chat_template import TemplateLimits
from kvik.core.errors import ContextLengthExceededError
from kvik.core.tokenizer import Tokenizer, TokenizerSpec
from kvik.engine.input_processor import check_output_room
from kvik.engine.preprocess_pool import PreprocessConfig, PreprocessPool

CONTEXT = 4096


@pytest.fixture(scope="module")
def pool(tiny_llama):
    pool = PreprocessPool(TokenizerSpec.from_pretrained(str(tiny_llama)), TemplateLimits(),
                          PreprocessConfig(workers=1), max_prompt_tokens=CONTEXT)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer.from_pretrained(str(tiny_llama))


def test_worker_refuses_a_prompt_with_no_room_for_the_requested_output(pool, tokenizer):
    text = "the quick brown fox " * 200
    num_tokens = len(tokenizer.encode(text))
    assert num_tokens < CONTEXT
    # Room for the output: the ids come back, equal to the in-process tokenizer's.
    ids = asyncio.run(pool.tokenize([text], True, reserve_tokens=CONTEXT - num_tokens))
    assert ids == [tokenizer.encode(text)]
    # One token too many: refused in the worker with the message the server gives for the same case.
    with pytest.raises(ContextLengthExceededError) as refused:
        asyncio.run(pool.tokenize([text], True, reserve_tokens=CONTEXT - num_tokens + 1))
    with pytest.raises(ContextLengthExceededError) as expected:
        check_output_room(CONTEXT, num_tokens, CONTEXT - num_tokens + 1, "prompt")
    assert refused.value.message == expected.value.message
    assert refused.value.param == "max_tokens"


def test_worker_refuses_a_rendered_conversation_with_no_room(pool):
    messages = [{"role": "user", "content": "hello there " * 100}]
    rendered = asyncio.run(pool.render(messages, add_generation_prompt=True, template=None, tools=None,
                                       template_kwargs={}))
    room = CONTEXT - len(rendered.token_ids)
    with pytest.raises(ContextLengthExceededError, match="in the messages"):
        asyncio.run(pool.render(messages, add_generation_prompt=True, template=None, tools=None,
                                template_kwargs={}, reserve_tokens=room + 1))


def test_a_json_body_parsed_in_a_worker_equals_json_loads_and_fails_the_same_way(pool):
    import json

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "é ✓ " * 100_000}]}).encode()
    assert asyncio.run(pool.parse_json(body)).value == json.loads(body)
    broken = body[:-2] + b",}"
    parsed = asyncio.run(pool.parse_json(broken))
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(broken)
    assert parsed.value is None and parsed.error == (expected.value.msg, expected.value.pos)
    # Not UTF-8, and nested past the parser's recursion limit: reported, not raised in the worker.
    assert "UnicodeDecodeError" in asyncio.run(pool.parse_json(b'{"a": "\xff\xfe"}')).failure
    assert "RecursionError" in asyncio.run(pool.parse_json(b"[" * 200_000 + b"]" * 200_000)).failure
