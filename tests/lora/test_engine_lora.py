"""Multi-LoRA in the engine (offline `LLM`): requests for different adapters in one batch give, token
for token, what HF + PEFT give with that adapter merged (merge_and_unload); LRU slots and the CPU
cache keep that true; the prefix cache never shares KV between adapters; bad adapters are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tests.lora.helpers import reference_greedy, write_random_adapter

from kvik.core.errors import (ConfigError, ConflictError, InvalidRequestError, KvikError, LoRAAdapterError,
                              NotFoundError)
from kvik.core.sampling_params import SamplingParams
from kvik.engine import model_runner
from kvik.engine.llm import LLM

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def make_llm(base: Path, adapters: dict[str, Path], **kwargs) -> LLM:
    kwargs = {"max_loras": 8, "max_lora_rank": 8, "kv_cache_memory": "16MiB", "show_progress": False, **kwargs}
    return LLM(str(base), enable_lora=True, lora_modules={k: str(v) for k, v in adapters.items()}, **kwargs)


def mixed_batch(adapters: dict[str, Path]) -> tuple[list[list[int]], list[str | None]]:
    """Two prompts per adapter and two for the base model, interleaved."""
    names = [*adapters, None] * 2
    prompts = [[5, 17, 42, 99, 7 + i % 5, 3, 11 + i] for i in range(len(names))]
    return prompts, names


def record_segments(monkeypatch) -> list[list[tuple[int, int, int]]]:
    """Every step's LoRA segments, as the runner computes them."""
    steps: list[list[tuple[int, int, int]]] = []
    original = model_runner.lora_segments

    def recording(ordered):
        segments = original(ordered)
        steps.append(segments)
        return segments

    monkeypatch.setattr(model_runner, "lora_segments", recording)
    return steps


def check_parity(base: Path, adapters: dict[str, Path], prompts, names, outputs) -> None:
    for prompt, name, output in zip(prompts, names, outputs):
        expected = reference_greedy(base, adapters[name] if name else None, prompt, GREEDY.max_tokens)
        assert output.outputs[0].token_ids == expected, f"adapter {name}"


def test_mixed_adapters_in_one_batch_match_hf_peft_merged(lora_base, trained_adapters, monkeypatch) -> None:
    llm = make_llm(lora_base, trained_adapters)
    assert llm.engine.core.runner.cache_binding.decode_stack  # compiled path kept for base-only steps
    steps = record_segments(monkeypatch)
    prompts, names = mixed_batch(trained_adapters)
    outputs = llm.generate(prompts, GREEDY, lora=names)
    check_parity(lora_base, trained_adapters, prompts, names, outputs)
    # One step carried all eight adapters (and base tokens, which have no segment).
    assert max(len({slot for _, _, slot in step}) for step in steps) == 8
    # The adapters changed the outputs: a plain base model answers differently.
    base_only = llm.generate(prompts[:8], GREEDY)
    assert sum(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(base_only, outputs[:8])) >= 6


def test_lru_slots_and_cpu_cache_keep_tokens_exact(lora_base, trained_adapters) -> None:
    prompts, names = mixed_batch(trained_adapters)
    llm = make_llm(lora_base, trained_adapters, max_loras=3)
    check_parity(lora_base, trained_adapters, prompts, names, llm.generate(prompts, GREEDY, lora=names))
    counters = llm.engine.core.adapters.counters
    assert counters.slot_evictions >= 5 and counters.cpu_hits == counters.slot_loads and counters.disk_loads == 0
    # A CPU cache smaller than the set: evicted adapters are read from their directory again.
    llm = make_llm(lora_base, trained_adapters, max_loras=2, max_cpu_loras=2)
    check_parity(lora_base, trained_adapters, prompts, names, llm.generate(prompts, GREEDY, lora=names))
    assert llm.engine.core.adapters.counters.disk_loads >= 6


def test_prefix_cache_is_not_shared_between_adapters(lora_base, trained_adapters) -> None:
    adapters = dict(list(trained_adapters.items())[:2])
    llm = make_llm(lora_base, adapters, max_loras=2)
    prompt = list(range(3, 3 + 40))  # two full blocks of 16 and a tail
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def cached(name):
        return llm.generate([prompt], params, lora=name)[0].num_cached_tokens

    assert cached("ad0") == 0
    assert cached("ad1") == 0  # same tokens, another adapter: nothing reused
    assert cached(None) == 0  # nor the base model
    assert cached("ad0") == 32 and cached("ad1") == 32 and cached(None) == 32  # each its own


def test_random_peft_adapters_with_rslora_and_base_only_steps(lora_base, tmp_path) -> None:
    """PEFT's own save_pretrained, rsLoRA scaling, a rank below the maximum: still exact; a batch of
    base requests alone keeps the compiled decode stack."""
    adapters = {"rs": write_random_adapter(lora_base, tmp_path / "rs", seed=3, r=4, use_rslora=True),
                "plain": write_random_adapter(lora_base, tmp_path / "plain", seed=4, r=2, targets=["o_proj"])}
    llm = make_llm(lora_base, adapters, max_lora_rank=16)
    prompts, names = mixed_batch(adapters)
    check_parity(lora_base, adapters, prompts, names, llm.generate(prompts, GREEDY, lora=names))

    body = llm.engine.core.model.model  # the DecodeStackModel
    calls = []

    class CountingStack:
        def __init__(self, stack):
            self.stack = stack

        def forward_tokens(self, *args):
            calls.append(1)
            return self.stack.forward_tokens(*args)

    body.decode_stack = CountingStack(body.decode_stack)
    llm.generate(prompts[:2], GREEDY, lora="rs")  # adapter steps: the modules' path
    assert not calls
    base_outputs = llm.generate(prompts[:2], GREEDY)
    assert len(calls) >= GREEDY.max_tokens - 1  # every decode step of two base sequences
    check_parity(lora_base, adapters, prompts[:2], [None, None], base_outputs)


def test_runtime_load_unload_and_refusals(lora_base, trained_adapters, model_dir_factory, tmp_path) -> None:
    llm = make_llm(lora_base, {}, max_lora_rank=4, max_loras=2)
    info = llm.load_lora_adapter("late", str(trained_adapters["ad1"]))  # rank 4
    assert info.rank == 4 and info.lora_id >= 1
    prompt = [5, 17, 42, 99, 7, 3]
    assert llm.generate([prompt], GREEDY, lora="late")[0].outputs[0].token_ids == reference_greedy(
        lora_base, trained_adapters["ad1"], prompt, GREEDY.max_tokens)
    with pytest.raises(ConflictError):
        llm.load_lora_adapter("late", str(trained_adapters["ad1"]))
    with pytest.raises(LoRAAdapterError, match="rank 8, above --max-lora-rank 4"):
        llm.load_lora_adapter("big", str(trained_adapters["ad2"]))
    with pytest.raises(LoRAAdapterError, match="not a directory"):
        llm.load_lora_adapter("nowhere", str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoRAAdapterError, match="adapter_config.json"):
        llm.load_lora_adapter("empty", str(empty))
    other_base = model_dir_factory("llama", "small")
    with pytest.raises(LoRAAdapterError, match="another base model"):
        llm.load_lora_adapter("other", str(write_random_adapter(other_base, tmp_path / "other", seed=1, r=2)))
    dora = tmp_path / "dora"
    shutil.copytree(trained_adapters["ad1"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoRAAdapterError, match="DoRA"):
        llm.load_lora_adapter("dora", str(dora))
    with pytest.raises(InvalidRequestError, match="no adapter named 'ghost'"):
        llm.generate([prompt], GREEDY, lora="ghost")
    # In use: a request for the adapter is queued.
    llm.engine.add_request("pending", prompt, GREEDY, lora_name="late")
    with pytest.raises(ConflictError, match="in use"):
        llm.unload_lora_adapter("late")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.unload_lora_adapter("late")
    with pytest.raises(NotFoundError):
        llm.unload_lora_adapter("late")
    with pytest.raises(InvalidRequestError):
        llm.generate([prompt], GREEDY, lora="late")


def test_lora_needs_enable_flag_and_a_llama_family_model(lora_base, trained_adapters, model_dir_factory) -> None:
    with pytest.raises(ConfigError, match="enable_lora"):
        LLM(str(lora_base), lora_modules={"a": str(trained_adapters["ad0"])}, show_progress=False)
    with pytest.raises(ConfigError, match="Llama family"):
        LLM(str(model_dir_factory("gpt2")), enable_lora=True, kv_cache_memory="16MiB", show_progress=False)
    plain = LLM(str(lora_base), kv_cache_memory="16MiB", show_progress=False)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        plain.generate([[5, 6, 7]], GREEDY, lora="ad0")


def test_quantized_int8_base_serves_adapters(lora_base, trained_adapters, tmp_path) -> None:
    """Adapters run in float32 on top of int8 weight-only linears. The reference is HF + PEFT merged
    (float32) on the base's weights rounded as kvik's int8 rounds them, so on float32 activations
    each prompt token's logprob matches it closely; on int8 activations (the default on AVX512-VNNI
    CPUs) within the activation rounding's error. Either way far closer to it than to the base model."""
    import torch
    from safetensors.torch import load_file, save_file
    from tests.lora.helpers import merged_model

    from kvik.model.quant.reference import dequantize_int8, quantize_int8

    rounded = tmp_path / "int8-base"
    shutil.copytree(lora_base, rounded)
    weights = load_file(str(lora_base / "model.safetensors"))
    for name, tensor in weights.items():  # every linear, as --quantization int8 does; not the embedding
        if tensor.dim() == 2 and "embed_tokens" not in name:
            weights[name] = dequantize_int8(quantize_int8(tensor, 32))
    save_file(weights, str(rounded / "model.safetensors"), metadata={"format": "pt"})

    adapters = dict(list(trained_adapters.items())[:3])
    prompt = [5, 17, 42, 99, 7, 3, 11, 250, 31, 8, 77, 140]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def reference(base, adapter):
        with torch.no_grad():
            logits = merged_model(base, adapter)(torch.tensor([prompt])).logits[0, :-1]
        return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]

    def served(llm, lora):
        output = llm.generate([prompt], params, lora=lora)[0]
        return torch.tensor([entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])])

    expected = {name: reference(rounded, path) for name, path in adapters.items()}
    base = reference(lora_base, None)
    for activations in ("float32", "auto"):
        llm = make_llm(lora_base, adapters, quantization="int8", activations=activations)
        # float32 activations: the same arithmetic as the reference. int8 activations (VNNI CPUs): what
        # their rounding does to the int8 base alone, measured here (0.05-0.12 on this tiny random
        # model), bounds what it may do with an adapter on top.
        bound = 1e-3 if activations == "float32" else \
            2 * (served(llm, None) - reference(rounded, None)).abs().max().item() + 1e-3
        for name in adapters:
            error = (served(llm, name) - expected[name]).abs().max().item()
            effect = (expected[name] - base).abs().max().item()
            assert error < bound and effect > 5 * error, (activations, name, error, effect, bound)


def test_adapter_that_cannot_be_reloaded_fails_its_request_alone(lora_base, trained_adapters, tmp_path) -> None:
    """Evicted from the CPU cache, then its directory removed: the next request for it fails with a
    message naming the adapter; requests for other adapters go on."""
    gone = tmp_path / "gone"
    shutil.copytree(trained_adapters["ad1"], gone)
    llm = make_llm(lora_base, {"ad0": trained_adapters["ad0"], "gone": gone}, max_loras=1, max_cpu_loras=1)
    shutil.rmtree(gone)  # "gone" is in the CPU cache no more: "ad0" was registered after it
    prompt = [5, 17, 42, 99, 7, 3]
    with pytest.raises(KvikError, match="'gone' could not be reloaded"):
        llm.generate([prompt, prompt], GREEDY, lora=["ad0", "gone"])
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([prompt], GREEDY, lora="ad0")[0].outputs[0].token_ids == reference_greedy(
        lora_base, trained_adapters["ad0"], prompt, GREEDY.max_tokens)


def test_chunked_prefill_and_preemption_keep_adapter_tokens_exact(lora_base, trained_adapters) -> None:
    """Long prompts split over steps (each chunk a segment of its adapter) and a KV cache too small
    for all sequences (preempted ones give back their slot pins and come back recomputed)."""
    llm = make_llm(lora_base, trained_adapters, max_loras=4, max_model_len=128, kv_cache_memory=96 * 1024,
                   max_num_batched_tokens=24)
    names = [*trained_adapters, None]
    prompts = [[(11 * i + j) % 500 + 3 for j in range(40)] for i in range(len(names))]
    check_parity(lora_base, trained_adapters, prompts, names, llm.generate(prompts, GREEDY, lora=names))
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0
    assert all(entry.pins == 0 for entry in core.adapters.adapters.values())


def test_weight_sync_updates_the_base_under_the_adapters(lora_base, trained_adapters, model_dir_factory) -> None:
    """update_weights reaches the base layers inside the LoRA wrappers (oneDNN-packed included): after
    loading another base's weights, adapters apply on top of the new base."""
    from safetensors.torch import load_file

    new_base = model_dir_factory("llama", "tiny", seed=7)
    adapters = dict(list(trained_adapters.items())[:2])
    llm = make_llm(lora_base, adapters, max_loras=2)
    llm.update_weights(load_file(str(new_base / "model.safetensors")))
    prompts, names = mixed_batch(adapters)
    check_parity(new_base, adapters, prompts, names, llm.generate(prompts, GREEDY, lora=names))
