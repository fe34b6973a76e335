"""Structured outputs in the engine (offline `LLM`): the grammar state follows the sampled tokens
through preemption/recompute and prefix-cache hits, works with n > 1 and seeds, and leaves
unconstrained sequences in the same batch exactly as they were."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from kvik import LLM, SamplingParams
from kvik.bench.json_schemas import SCHEMAS
from kvik.core.errors import InvalidRequestError
from kvik.core.sampling_params import StructuredOutputs
from kvik.engine.messages import EngineCoreRequest
from kvik.model.loader import load_model_config

NAMES = ["flat_record", "nested_address", "array_of_objects", "recursive_tree", "string_patterns",
         "tuple_prefix_items"]


def constrained(name: str, seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=300,
                          structured_outputs=StructuredOutputs(json=SCHEMAS[name]), **kwargs)


def texts(outputs) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), show_progress=False, max_model_len=512)


def block_bytes(path, block_size: int) -> int:
    cfg = load_model_config(path)
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * 4


def test_preemption_and_recompute_keep_the_grammar_in_step(tiny_llama, llm):
    """A KV pool too small for the batch preempts sequences mid-object; seeded sampling makes every
    output independent of the batch, so each must equal the output of a run without preemption."""
    prompts = [f"Record number {i} as JSON please" for i in range(len(NAMES))]
    params = [constrained(name, seed=i, n=2) for i, name in enumerate(NAMES)]
    expected = texts(llm.generate(prompts, params))
    tight = LLM(str(tiny_llama), show_progress=False, block_size=4, max_model_len=160,
                kv_cache_memory=44 * block_bytes(tiny_llama, 4))
    outputs = tight.generate(prompts, params)
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert texts(outputs) == expected
    for name, output in zip(NAMES, outputs):
        for choice in output.outputs:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.text), SCHEMAS[name])
    tight.engine.core.kv.pool.check_invariants()


def test_prefix_cache_hits_do_not_disturb_the_grammar(llm):
    prompt = "A long shared system prompt that fills several KV blocks before the question. " * 3
    params = constrained("nested_address", seed=9)
    first = llm.generate(prompt, params)[0]
    hits_before = llm.engine.core.kv.prefix_cache_hits
    second = llm.generate(prompt, params)[0]
    assert llm.engine.core.kv.prefix_cache_hits > hits_before
    assert second.num_cached_tokens > 0
    assert second.outputs[0].text == first.outputs[0].text
    jsonschema.validate(json.loads(second.outputs[0].text), SCHEMAS["nested_address"])


def test_unconstrained_neighbours_are_unchanged(llm):
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    alone = llm.generate("Hello there", free)[0].outputs[0].text
    mixed = llm.generate(["Hello there", "JSON please"], [free, constrained("flat_record", seed=3)])
    assert mixed[0].outputs[0].text == alone
    json.loads(mixed[1].outputs[0].text)


def test_n_siblings_each_follow_their_own_grammar_state(llm):
    output = llm.generate("JSON please", constrained("tags_array", seed=5, n=4))[0]
    answers = [c.text for c in output.outputs]
    assert len(set(answers)) > 1
    for answer in answers:
        jsonschema.validate(json.loads(answer), SCHEMAS["tags_array"])


def test_min_tokens_cannot_stretch_a_finished_grammar(llm):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=50, min_tokens=30,
                            structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    choice = llm.generate("Q", params)[0].outputs[0]
    assert choice.text in ("yes", "no")
    assert choice.finish_reason == "stop"
    assert len(choice.token_ids) <= 4  # the answer and one end-of-sequence token, no padding


def test_constraint_waits_for_its_start_token(llm):
    """With `start_after_token_id` the output is free until that token, then constrained."""
    tokenizer = llm.engine.tokenizer
    start = tokenizer.encode(" the", add_special_tokens=False)[0]
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=300, logit_bias={start: 8.0},
                            structured_outputs=StructuredOutputs(choice=["yes", "no"],
                                                                 start_after_token_id=start))
    choice = llm.generate("Q", params)[0].outputs[0]
    assert start in choice.token_ids
    after = choice.token_ids[choice.token_ids.index(start) + 1:]
    assert tokenizer.decode(after) in ("yes", "no")


def test_constraint_crosses_the_process_boundary_as_plain_data():
    params = constrained("ref_defs", seed=1)
    request = EngineCoreRequest("r", [1, 2], params, 10, 0.0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert decoded.params.structured_outputs == params.structured_outputs
    assert json.loads(decoded.params.structured_outputs.json) == SCHEMAS["ref_defs"]


def test_offline_api_refuses_what_the_engine_cannot_enforce(llm):
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputs(
            json={"type": "array", "uniqueItems": True})))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputs(regex="a"))
