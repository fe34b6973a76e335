"""Clear, typed errors for impossible requests and unloadable models."""

from __future__ import annotations

import json
import shutil

import pytest

from kvik import LLM, SamplingParams
from kvik.core.errors import (ConfigError, ContextLengthExceededError, InsufficientMemoryError,
                              InvalidRequestError, MissingWeightsError, UnsupportedArchitectureError)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), show_progress=False, max_model_len=64)


def test_prompt_longer_than_context(llm):
    with pytest.raises(ContextLengthExceededError, match="maximum context length is 64 tokens.*70"):
        llm.generate([[5] * 70], SamplingParams())


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="prompt: is empty"):
        llm.generate([""], SamplingParams())
    with pytest.raises(InvalidRequestError, match="prompt: is empty"):
        llm.generate([[]], SamplingParams())


def test_token_ids_outside_vocabulary(llm):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 10**6]], SamplingParams())


@pytest.mark.parametrize("kwargs,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"top_k": -2}, "top_k"),
])
def test_bad_sampling_params_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in info.value.message


def test_failed_batch_leaves_no_request_behind(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2], []], SamplingParams())
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.kv.num_free_blocks() == llm.engine.core.kv.pool.num_blocks


def test_unknown_architecture(tiny_llama, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny_llama, target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="FalconForCausalLM.*supports.*LlamaForCausalLM"):
        LLM(str(target), show_progress=False)


def test_missing_weights(tiny_llama, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny_llama, target)
    (target / "model.safetensors").unlink()
    with pytest.raises(MissingWeightsError, match="no safetensors weights"):
        LLM(str(target), show_progress=False)


def test_missing_tensor_is_named(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    target = tmp_path / "model"
    shutil.copytree(tiny_llama, target)
    tensors = load_file(target / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MissingWeightsError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        LLM(str(target), show_progress=False)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ConfigError, match="not a model directory"):
        LLM(str(tmp_path / "nowhere"), show_progress=False)
    with pytest.raises(ConfigError, match="no config.json"):
        LLM(str(tmp_path), show_progress=False)


def test_kv_cache_too_small_for_one_sequence(tiny_llama):
    with pytest.raises(InsufficientMemoryError, match="max_model_len=2048 needs 128"):
        LLM(str(tiny_llama), show_progress=False, kv_cache_memory=100_000)


def test_unknown_engine_argument(tiny_llama):
    with pytest.raises(ConfigError, match="unknown engine argument.*max_num_seq\\b"):
        LLM(str(tiny_llama), max_num_seq=3)
