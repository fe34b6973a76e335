"""Speculative decoding in the engine: greedy output token-exact against HF transformers (and so
against speculation off) for both proposers, with chunked prefill, preemption and prefix-cache hits;
logprobs, stop strings inside a multi-token step, seeded reproducibility, sampled outputs against
the target's exact distribution (chi-square), and the draft model's KV freed.

Random tiny models accept few drafts, so three proposers cover the paths: the n-gram lookup (mostly
rejections, some acceptances), a draft made of the target's first layer (partial acceptance), and
the target as its own draft (every draft accepted: multi-token steps and bonus tokens). Adaptive k
is off so every step speculates.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from scipy import stats

from kvik import LLM, SamplingParams
from kvik.core.errors import ConfigError
from kvik.engine.spec_decode.decoder import VERIFY_ROW_COST
from tests.engine.test_no_leaks import assert_no_leaks, drive_random_mix
from tests.engine.test_parity import MAX_NEW, PROMPTS, SHARED_PREFIX, _block_bytes, assert_matches
from tests.reference import hf_greedy, hf_model

PROPOSERS = ("ngram", "draft-layer0", "draft-self", "draft-int8")


def truncated_draft(target: Path, out: Path, num_layers: int) -> Path:
    """The target's first `num_layers` layers with its embeddings, head and tokenizer: a draft
    model that shares the tokenizer by construction."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(target, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(out / "model.safetensors")
    kept = {name: tensor for name, tensor in weights.items()
            if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < num_layers}
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    return out


def draft_block_bytes(target: Path, args: dict) -> int:
    """A draft model's KV bytes per block of 4 tokens (0 for the n-gram lookup)."""
    if args["speculative_method"] != "draft":
        return 0
    return _block_bytes(Path(args.get("speculative_model", target)), 4)


@pytest.fixture(scope="module")
def target(tiny_llama) -> Path:
    return tiny_llama


@pytest.fixture(scope="module")
def layer0_draft(target, tmp_path_factory) -> Path:
    return truncated_draft(target, tmp_path_factory.mktemp("draft") / "layer0", 1)


@pytest.fixture(scope="module")
def spec_args(target, layer0_draft):
    def make(proposer: str, **extra) -> dict:
        args = {"speculative_adaptive": False, "num_speculative_tokens": 3, **extra}
        if proposer == "ngram":
            return {"speculative_method": "ngram", "prompt_lookup_min": 1, **args}
        if proposer == "draft-int8":  # the target's own weights in int8 (no draft model named)
            return {"speculative_method": "draft", "speculative_quantization": "int8", **args}
        model = layer0_draft if proposer == "draft-layer0" else target
        return {"speculative_method": "draft", "speculative_model": str(model), **args}
    return make


@pytest.fixture(scope="module")
def reference(target):
    """Prompt ids and HF's greedy tokens and step logprobs for each."""
    llm = LLM(str(target), show_progress=False)
    texts = PROMPTS + [SHARED_PREFIX + "What is rain?", SHARED_PREFIX + "How do I make tea?"]
    prompts = [llm.engine.tokenizer.encode(t) for t in texts]
    return prompts, [hf_greedy(target, ids, MAX_NEW) for ids in prompts]


def greedy(max_tokens: int = MAX_NEW, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def spec_stats(llm: LLM):
    stats_ = llm.engine.stats()
    return stats_.spec_decode_num_draft_tokens, stats_.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_with_speculation_matches_hf(proposer, target, reference, spec_args):
    prompts, expected = reference
    llm = LLM(str(target), show_progress=False, **spec_args(proposer))
    assert_matches(llm.generate(prompts, greedy(logprobs=3)), expected, check_logprobs=True)
    drafted, accepted = spec_stats(llm)
    assert drafted > 0
    if proposer == "draft-self":
        assert accepted == drafted  # the target agrees with itself
    elif proposer == "draft-int8":
        assert accepted > drafted / 2  # int8 rounding flips some of the random model's near-ties
    else:
        assert accepted < drafted  # rejections were rolled back
    # One sequence at a time: the verification rows take the compiled decode stack alone.
    for index in (2, 4):
        assert_matches(llm.generate([prompts[index]], greedy()), [expected[index]])
    llm.engine.core.kv.pool.check_invariants()


def test_ngram_drafts_accepted_where_the_target_repeats_itself(target, reference, spec_args):
    """A random model copies nothing from its prompt, but its greedy output falls into runs of one
    token: prompted at the start of such a run, the n-gram lookup proposes the run's token and
    the target accepts it, and the output still equals HF's."""
    prompts, _ = reference
    found = None
    for ids in prompts:
        tokens, _ = hf_greedy(target, ids, 128)
        # Cut after three of a run of at least seven.
        runs = [i for i in range(3, len(tokens) - 4) if len(set(tokens[i - 3:i + 4])) == 1]
        if runs:
            found = ids + tokens[:runs[0]]
            break
    assert found is not None, "no run of a repeated token in the tiny model's greedy outputs"
    expected = hf_greedy(target, found, 16)
    llm = LLM(str(target), show_progress=False, **spec_args("ngram"))
    assert_matches(llm.generate([found], greedy(16, logprobs=3)), [expected], check_logprobs=True)
    drafted, accepted = spec_stats(llm)
    assert 0 < accepted < drafted


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_chunked_prefill_and_prefix_hits_with_speculation(proposer, target, reference, spec_args):
    prompts, expected = reference
    # A 7-token budget splits prompts across steps next to verifications (which it also caps).
    llm = LLM(str(target), show_progress=False, max_num_batched_tokens=7, block_size=4,
              **spec_args(proposer))
    assert_matches(llm.generate(prompts, greedy()), expected)
    # Again: every prompt's full blocks are now prefix hits, registered from accepted tokens only.
    before = llm.engine.core.kv.prefix_cache_hits
    outputs = llm.generate(prompts, greedy())
    assert_matches(outputs, expected)
    assert llm.engine.core.kv.prefix_cache_hits - before >= len(prompts[-1]) // 4 * 4 - 4
    assert spec_stats(llm)[0] > 0
    llm.engine.core.kv.pool.check_invariants()


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_preemption_with_speculation(proposer, target, reference, spec_args):
    prompts, expected = reference
    args = spec_args(proposer)
    # 10 blocks of 4 tokens; a draft model keeps as many blocks of its own in the same budget.
    per_block = _block_bytes(target, 4) + draft_block_bytes(target, args)
    llm = LLM(str(target), show_progress=False, block_size=4, max_model_len=40,
              kv_cache_memory=10 * per_block, **args)
    short = [(p, r) for p, r in zip(prompts, expected) if len(p) + MAX_NEW <= 40]
    outputs = llm.generate([p for p, _ in short], greedy())
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_matches(outputs, [r for _, r in short])
    llm.engine.core.kv.pool.check_invariants()
    assert llm.engine.core.kv.num_free_blocks() == llm.engine.core.kv.pool.num_blocks
    proposer_ = llm.engine.core.spec.proposer
    if proposer != "ngram":  # the draft model's blocks are back too
        assert proposer_.num_free_blocks == proposer_.pool.num_blocks and not proposer_.sequences


def test_stop_strings_and_limits_inside_multi_token_steps(target, spec_args):
    """A stop string, a stop token, min_tokens and max_tokens falling inside a step that produced
    several tokens end the output exactly where speculation off ends it."""
    off = LLM(str(target), show_progress=False)
    on = LLM(str(target), show_progress=False, **spec_args("draft-self"))
    prompt = "Once upon a time there was a small village by the sea"
    full = off.generate(prompt, greedy(40))[0].outputs[0]
    text = full.text
    cases = [
        greedy(40, stop=[text[len(text) // 2:len(text) // 2 + 3]]),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[full.token_ids[9]]),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[full.token_ids[1]], min_tokens=5),
        greedy(7),
        greedy(40, stop=[text[len(text) // 3:len(text) // 3 + 2]], include_stop_str_in_output=True, logprobs=1),
    ]
    for params in cases:
        expected, got = off.generate(prompt, params)[0].outputs[0], on.generate(prompt, params)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            expected.text, expected.token_ids, expected.finish_reason, expected.stop_reason), params
        if params.logprobs:
            assert len(got.logprobs) == len(got.token_ids)
    drafted, accepted = spec_stats(on)
    assert accepted > 0


@pytest.mark.parametrize("proposer", ["ngram", "draft-layer0"])
def test_seeded_requests_are_reproducible_with_speculation(proposer, target, spec_args):
    """With speculation on, a seeded request's tokens depend on its seed and prompt only: not on
    what shares its batch, nor on the run."""
    llm = LLM(str(target), show_progress=False, **spec_args(proposer))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=24, ignore_eos=True)
    prompt = "The moon rose over the moon rose over the"
    alone = llm.generate(prompt, seeded)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.2, max_tokens=30, ignore_eos=True)
    batch = llm.generate(["Hello there", prompt, "a", "Numbers matter: 1, 2, 3"], [noise, seeded, noise, noise])
    assert batch[1].outputs[0].token_ids == alone
    again = LLM(str(target), show_progress=False, **spec_args(proposer)).generate(prompt, seeded)
    assert again[0].outputs[0].token_ids == alone
    assert llm.generate(prompt, seeded.clone(seed=43))[0].outputs[0].token_ids != alone


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["ngram", "draft-layer0"])
def test_sampled_tokens_follow_the_target_distribution(proposer, target, spec_args):
    """The second generated token, which speculation proposes and verifies, is distributed as
    the target says: chi-square against the exact marginal sum_t1 p(t1) p(t2 | t1) from HF."""
    hf = hf_model(target)
    llm = LLM(str(target), show_progress=False, **spec_args(proposer, num_speculative_tokens=2))
    vocab = llm.engine.info.vocab_size
    # Every token once in the prompt, so the n-gram lookup (n = 1) always finds the first
    # generated token earlier and proposes what followed it.
    prompt = torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).tolist()
    prompt = prompt[:60] if proposer != "ngram" else prompt
    with torch.no_grad():
        first = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), dim=-1)
        likely = torch.nonzero(first > 1e-7).squeeze(1)
        batch = torch.cat([torch.tensor(prompt).expand(len(likely), -1), likely[:, None]], dim=1)
        second = torch.softmax(hf(batch).logits[:, -1].double(), dim=-1)
    exact = (first[likely, None] * second).sum(dim=0)
    exact /= exact.sum()
    draws = 1500
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([prompt] * draws, params)
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outputs]), minlength=vocab).double()
    drafted, _ = spec_stats(llm)
    assert drafted >= draws  # the second token went through verification almost every time
    expected = exact[:vocab] * draws
    frequent = expected >= 5
    observed = torch.cat([counts[frequent], counts[~frequent].sum().unsqueeze(0)])
    expect = torch.cat([expected[frequent], expected[~frequent].sum().unsqueeze(0)])
    result = stats.chisquare(observed.numpy(), expect.numpy() * observed.sum().item() / expect.sum().item())
    assert result.pvalue > 0.001, result


def test_configuration_errors(target, tmp_path, model_dir_factory):
    with pytest.raises(ConfigError, match="speculative_method"):
        LLM(str(target), speculative_method="medusa")
    with pytest.raises(ConfigError, match="speculative_model.*--speculative-quantization"):
        LLM(str(target), speculative_method="draft")
    with pytest.raises(ConfigError, match="speculative_quantization: 'int3'"):
        LLM(str(target), speculative_method="draft", speculative_quantization="int3")
    with pytest.raises(ConfigError, match="speculative_quantization: only used with"):
        LLM(str(target), speculative_method="ngram", speculative_quantization="int8")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(str(target), speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="prompt_lookup"):
        LLM(str(target), speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    # The small model's tokenizer has another vocabulary: not a valid draft.
    other = model_dir_factory("llama", "small")
    with pytest.raises(ConfigError, match="different tokenizer"):
        LLM(str(target), show_progress=False, speculative_method="draft", speculative_model=str(other))


def test_a_quantized_copy_of_the_target_drafts(target, layer0_draft):
    """--speculative-quantization alone: the target's weights, quantized, are the draft (a
    quarter of the bytes per draft step with int8, and the adaptive k costs it as such); with a
    draft model named, that model is quantized."""
    from kvik.model.quant.linear import WeightOnlyLinear

    llm = LLM(str(target), show_progress=False, speculative_method="draft", speculative_quantization="int8")
    core = llm.engine.core
    draft = core.spec.proposer
    kinds = {m.kind for m in draft.model.modules() if isinstance(m, WeightOnlyLinear)}
    assert kinds == {"int8"}
    assert not any(isinstance(m, WeightOnlyLinear) for m in core.model.modules())  # target untouched
    assert draft.step_bytes < core.transforms.linear_weight_bytes / 3
    assert core.spec.cost_per_draft < VERIFY_ROW_COST + 0.35
    named = LLM(str(target), show_progress=False, speculative_method="draft",
                speculative_model=str(layer0_draft), speculative_quantization="int4")
    assert {m.kind for m in named.engine.core.spec.proposer.model.modules()
            if isinstance(m, WeightOnlyLinear)} == {"int4", "int8"}  # int4 layers, int8 LM head


@pytest.mark.parametrize("proposer", ["ngram", "draft-layer0"])
def test_no_block_leaks_after_a_random_mix_with_speculation(proposer, target, spec_args):
    """Finished, aborted and preempted sequences with drafts scheduled, verified and rejected:
    afterwards every target block (and every draft-model block) is free or cached."""
    args = spec_args(proposer)
    per_block = _block_bytes(target, 4) + draft_block_bytes(target, args)
    llm = LLM(str(target), show_progress=False, block_size=4, max_model_len=64, kv_cache_memory=24 * per_block,
              max_num_seqs=12, max_num_batched_tokens=48, **args)
    engine = llm.engine
    def repetitive_prompt(rng: random.Random) -> list[int]:
        # Repetitive prompts so the lookup proposes often.
        pattern = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 4))]
        return (pattern * 30)[:rng.randrange(2, 30)]

    drive_random_mix(engine, random.Random(1), 120, repetitive_prompt)
    assert engine.core.scheduler.num_preemptions > 0
    drafted, accepted = spec_stats(llm)
    assert drafted > 0 and accepted > 0
    assert_no_leaks(engine)
    proposer_ = engine.core.spec.proposer
    if proposer != "ngram":
        assert proposer_.num_free_blocks == proposer_.pool.num_blocks and not proposer_.sequences
