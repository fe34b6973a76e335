"""Stop strings, stop token ids, EOS, min/max tokens, and incremental detokenization."""

from __future__ import annotations

import pytest

from kvik import LLM, SamplingParams
from kvik.core.sampling_params import OutputKind


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), show_progress=False)


def free_run(llm, prompt: str, n: int = 24):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate([prompt], params)[0].outputs[0]


def test_detokenized_text_equals_decoding_all_tokens(llm):
    for prompt in ["Hello", "The weather today", "12345 678"]:
        out = free_run(llm, prompt, 32)
        assert out.text == llm.engine.tokenizer.decode(out.token_ids)


def test_stop_string_is_cut_from_text(llm):
    full = free_run(llm, "The weather today")
    stop = full.text[5:8]
    assert stop and stop not in full.text[:5] + full.text[5:7]
    out = llm.generate(["The weather today"], SamplingParams(temperature=0, max_tokens=24,
                                                             ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    kept = llm.generate(["The weather today"], SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == full.text[:full.text.index(stop) + len(stop)]


def test_stop_token_id(llm):
    full = free_run(llm, "Hello")
    stop_id = full.token_ids[4]
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                 stop_token_ids=[stop_id]))[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_stops_unless_ignored_and_min_tokens_delays_it(llm):
    # Force EOS with a logit bias: the first token is EOS.
    eos = llm.engine.info.eos_token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100})
    out = llm.generate(["Hello"], params)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""
    out = llm.generate(["Hello"], params.clone(ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    out = llm.generate(["Hello"], params.clone(min_tokens=3))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos


def test_max_tokens_none_runs_to_context_length(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False, max_model_len=32)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 29 and out[0].outputs[0].finish_reason == "length"


def test_streaming_deltas_never_show_a_cut_stop_string(llm):
    full = free_run(llm, "The weather today")
    stop = full.text[6:10]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                            output_kind=OutputKind.DELTA)
    engine = llm.engine
    engine.add_request("stream", "The weather today", params)
    pieces = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            pieces.append(output.outputs[0].text)
    assert "".join(pieces) == full.text[:full.text.index(stop)]
    assert all(stop not in piece for piece in pieces)


def test_padded_vocab_ids_decode_to_nothing(model_dir_factory):
    path = model_dir_factory("qwen2")  # config vocab 576 > tokenizer 512
    llm = LLM(str(path), show_progress=False)
    assert llm.engine.info.vocab_size > llm.engine.tokenizer.vocab_size
    beyond = llm.engine.tokenizer.vocab_size + 3
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={beyond: 100})
    out = llm.generate(["Hello"], params)[0].outputs[0]
    assert out.token_ids == [beyond] * 6 and out.text == ""
    # And as a prompt token: accepted, since the model has an embedding for it.
    assert llm.generate([[1, beyond, 2]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
