"""`kvik serve --quantization/--kv-cache-dtype`: the flags reach the engine process, whose greedy
output equals the offline engine's with the same arguments, and `--help` describes them. A GPTQ
checkpoint is served as int4 from its own codes."""

from __future__ import annotations

import subprocess
import sys

import openai

from kvik import LLM, SamplingParams
from tests.model.gptq_files import quantized_copy

ARGS = {"quantization": "int4", "quantization_group_size": 32, "kv_cache_dtype": "int8"}


def test_quantized_server_equals_offline_engine_with_the_same_args(server_factory, tiny_llama):
    flags = ["--quantization", "int4", "--quantization-group-size", "32", "--kv-cache-dtype", "int8"]
    server = server_factory(*flags, name="tiny-int4")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    prompts = ["Hello world", "The capital of France is", "Once upon a time"]
    response = client.completions.create(model="tiny-int4", prompt=prompts, temperature=0, max_tokens=12,
                                         extra_body={"ignore_eos": True})
    offline = LLM(str(tiny_llama), show_progress=False, max_model_len=512, **ARGS)
    assert offline.engine.info.precision.startswith("weights int4 (groups of 32")
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    got = sorted(response.choices, key=lambda choice: choice.index)
    assert [c.text for c in got] == [e.outputs[0].text for e in expected]
    # The engine process logs what it runs in: the flags were not dropped on the way.
    assert "weights int4 (groups of 32" in server.log() and "KV cache int8" in server.log()


def test_serve_help_describes_the_precision_flags():
    text = subprocess.run([sys.executable, "-m", "kvik.cli.main", "serve", "--help"], capture_output=True,
                          text=True, check=True).stdout
    text = " ".join(text.split())  # argparse wraps the help at the terminal's width
    for flag in ("--quantization {int8,int4}", "--quantization-group-size", "--quantization-zero-point",
                 "--kv-cache-dtype"):
        assert flag in text
    assert "llama.cpp's Q8_0 layout" in text and "per token and head" in text


def test_a_gptq_checkpoint_is_served_as_int4_from_its_own_codes(server_factory, tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("gptq") / "model"
    quantized_copy(tiny_llama, path, "gptq", seed=5)
    server = server_factory(model_dir=path, name="tiny-gptq")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = client.chat.completions.create(model="tiny-gptq", messages=messages, temperature=0, max_tokens=12,
                                          extra_body={"ignore_eos": True})
    offline = LLM(str(path), show_progress=False, max_model_len=512)
    expected = offline.chat([messages], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert chat.choices[0].message.content == expected[0].outputs[0].text
    assert chat.usage.completion_tokens == 12
    line = "weights int4 from the checkpoint (GPTQ, groups of 32, zero points; 8 linear layers)"
    assert offline.engine.info.precision.startswith(line) and line in server.log()
